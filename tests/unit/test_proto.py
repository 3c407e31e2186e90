"""The llm_lanes.v1 proto, its generated stubs and the pure conversions in app/proto/convert.py."""

from __future__ import annotations

import importlib
from concurrent import futures

import grpc
import pytest
from google.protobuf import json_format

from app.proto import convert
from app.proto.llm_lanes.v1 import llm_lanes_pb2 as pb
from app.proto.llm_lanes.v1 import llm_lanes_pb2_grpc as pb_grpc
from app.classes import RequestClass, classify
from tests.unit.grpc_fakes import FakeServicerContext


def _import_attr(path: str):
    module_name, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def test_servicer_function_path_imports_like_ray_serve_does():
    add_servicer = _import_attr(convert.LLM_LANES_SERVICER_FUNCTION)
    assert add_servicer is pb_grpc.add_LlmLanesServicer_to_server


def test_service_methods_have_the_shapes_ray_proxy_dispatches_on():
    service = pb.DESCRIPTOR.services_by_name["LlmLanes"]
    assert service.full_name == "llm_lanes.v1.LlmLanes"
    shapes = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert shapes == {
        "Generate": (False, True),
        "Complete": (False, False),
        "ChatComplete": (False, False),
        "ChatCompleteStream": (False, True),
        "GetStats": (False, False),
        "SubmitBatch": (False, False),
        "GetBatch": (False, False),
    }
    assert pb.DESCRIPTOR.name == "llm_lanes/v1/llm_lanes.proto"


def test_request_class_enum_matches_router_classes():
    assert set(convert.REQUEST_CLASS_FROM_PROTO.values()) == {c.value for c in RequestClass}


def test_proto_round_trip_keeps_optional_presence():
    request = pb.CompletionRequest(
        model="tiny-llama",
        prompt="hello",
        sampling=pb.SamplingParams(max_tokens=16, temperature=0.0, stop=["\n"]),
        request_class=pb.REQUEST_CLASS_REALTIME,
    )
    decoded = pb.CompletionRequest.FromString(request.SerializeToString())
    assert decoded == request
    assert decoded.sampling.HasField("temperature") and decoded.sampling.temperature == 0.0
    assert not decoded.sampling.HasField("top_p")
    assert not decoded.HasField("service_tier")


def test_completion_request_to_openai_sends_only_set_fields():
    request = pb.CompletionRequest(
        model="tiny-llama",
        prompt="hello",
        sampling=pb.SamplingParams(max_tokens=16, temperature=0.0, top_p=0.9, stop=["\n", "END"], seed=7),
        user="u1",
    )
    converted = convert.completion_request_to_openai(request, stream=False)
    assert converted.body == {
        "model": "tiny-llama",
        "prompt": "hello",
        "max_tokens": 16,
        "temperature": 0.0,
        "top_p": 0.9,
        "stop": ["\n", "END"],
        "seed": 7,
        "user": "u1",
        "stream": False,
    }
    assert converted.request_class is None

    bare = convert.completion_request_to_openai(pb.CompletionRequest(prompt="x"), stream=True)
    assert bare.body == {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}


def test_request_class_enum_wins_over_service_tier_like_the_header():
    request = pb.CompletionRequest(prompt="x", service_tier="flex", request_class=pb.REQUEST_CLASS_REALTIME)
    converted = convert.completion_request_to_openai(request, stream=False)
    assert converted.body["service_tier"] == "flex"
    assert converted.request_class == "realtime"
    assert classify(converted.body.get("service_tier"), converted.request_class) is RequestClass.REALTIME

    tier_only = convert.completion_request_to_openai(
        pb.CompletionRequest(prompt="x", service_tier="flex"), stream=False
    )
    assert classify(tier_only.body.get("service_tier"), tier_only.request_class) is RequestClass.BATCH

    default = convert.completion_request_to_openai(pb.CompletionRequest(prompt="x"), stream=False)
    assert classify(default.body.get("service_tier"), default.request_class) is RequestClass.INTERACTIVE


def test_unknown_request_class_number_is_invalid_argument():
    request = pb.CompletionRequest(prompt="x")
    request.request_class = 42  # open enum: a newer client's value arrives as an int
    with pytest.raises(convert.InvalidProtoRequest) as excinfo:
        convert.completion_request_to_openai(request, stream=False)
    assert excinfo.value.param == "request_class"


def test_chat_request_to_openai():
    request = pb.ChatCompletionRequest(
        model="tiny-llama",
        messages=[
            pb.ChatMessage(role="system", content="be brief"),
            pb.ChatMessage(role="user", content="hi", name="ann"),
        ],
        sampling=pb.SamplingParams(max_tokens=8),
        request_class=pb.REQUEST_CLASS_BATCH,
    )
    converted = convert.chat_request_to_openai(request, stream=True)
    assert converted.body == {
        "model": "tiny-llama",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi", "name": "ann"},
        ],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert converted.request_class == "batch"


USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17, "prompt_tokens_details": {"cached_tokens": 8}}


def test_completion_response_from_openai():
    response = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "tiny-llama",
        "choices": [{"index": 0, "text": "world", "finish_reason": "length", "logprobs": None}],
        "usage": USAGE,
    }
    serving = convert.serving_info("cold", "interactive", ["long_prompt"])
    message = convert.completion_response_from_openai(response, serving)
    assert (message.id, message.model, message.created, message.text, message.finish_reason) == (
        "cmpl-1",
        "tiny-llama",
        1700000000,
        "world",
        "length",
    )
    assert (message.usage.prompt_tokens, message.usage.completion_tokens, message.usage.total_tokens) == (12, 5, 17)
    assert message.usage.cached_prompt_tokens == 8
    assert message.serving.lane == "cold"
    assert message.serving.request_class == pb.REQUEST_CLASS_INTERACTIVE
    assert list(message.serving.degraded_reasons) == ["long_prompt"]
    assert pb.CompletionResponse.FromString(message.SerializeToString()) == message


def test_completion_chunks_from_openai_stream():
    first = {
        "id": "cmpl-2",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "He", "finish_reason": None, "token_ids": [10, 11]}],
    }
    last_text = {
        "id": "cmpl-2",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "y", "finish_reason": "stop"}],
    }
    usage_only = {"id": "cmpl-2", "created": 1, "model": "m", "choices": [], "usage": USAGE}

    chunk = convert.completion_chunk_from_openai(first, convert.serving_info("hot", "realtime"))
    assert (chunk.text, chunk.num_tokens, chunk.finish_reason) == ("He", 2, "")
    assert chunk.serving.lane == "hot" and not chunk.HasField("usage")

    chunk = convert.completion_chunk_from_openai(last_text, num_tokens=1)
    assert (chunk.text, chunk.num_tokens, chunk.finish_reason) == ("y", 1, "stop")
    assert not chunk.HasField("serving")

    chunk = convert.completion_chunk_from_openai(usage_only)
    assert chunk.text == "" and chunk.usage.total_tokens == 17


def test_chat_response_and_chunks_from_openai():
    response = {
        "id": "chat-1",
        "created": 2,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": None}, "finish_reason": "stop"}],
        "usage": USAGE,
    }
    message = convert.chat_response_from_openai(response)
    assert message.message.role == "assistant" and message.message.content == ""
    assert message.finish_reason == "stop" and message.usage.completion_tokens == 5

    role_chunk = {"id": "chat-1", "created": 2, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    text_chunk = {
        "id": "chat-1",
        "created": 2,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "length"}],
    }
    assert convert.chat_chunk_from_openai(role_chunk).role == "assistant"
    chunk = convert.chat_chunk_from_openai(text_chunk)
    assert (chunk.role, chunk.content, chunk.finish_reason) == ("", "Hi", "length")


def test_stats_struct_round_trip():
    stats = {"lanes": {"hot": {"replicas": [{"replica": "r1", "running": 3, "kv_usage": 0.5, "breaker": None}]}}}
    message = convert.stats_response_from_dict(stats)
    decoded = pb.GetStatsResponse.FromString(message.SerializeToString())
    back = json_format.MessageToDict(decoded.stats)
    replica = back["lanes"]["hot"]["replicas"][0]
    assert replica == {"replica": "r1", "running": 3.0, "kv_usage": 0.5, "breaker": None}


def test_submit_batch_from_proto_validates():
    request = pb.SubmitBatchRequest(input_content=b'{"custom_id": "a"}\n', endpoint="/v1/chat/completions")
    submission = convert.submit_batch_from_proto(request)
    assert submission.completion_window == "24h" and submission.input_content.startswith(b"{")
    with pytest.raises(convert.InvalidProtoRequest) as excinfo:
        convert.submit_batch_from_proto(pb.SubmitBatchRequest(endpoint="/v1/completions"))
    assert excinfo.value.param == "input_content"
    with pytest.raises(convert.InvalidProtoRequest) as excinfo:
        convert.submit_batch_from_proto(pb.SubmitBatchRequest(input_content=b"x", endpoint="/v1/embeddings"))
    assert excinfo.value.param == "endpoint"


def test_batch_from_openai():
    batch = {
        "id": "batch_1",
        "object": "batch",
        "endpoint": "/v1/completions",
        "status": "in_progress",
        "completion_window": "24h",
        "created_at": 100,
        "completed_at": None,
        "input_file_id": "file_1",
        "output_file_id": None,
        "error_file_id": None,
        "request_counts": {"total": 10, "completed": 4, "failed": 1},
        "metadata": {"team": "search"},
    }
    message = convert.batch_from_openai(batch)
    assert (message.id, message.status, message.output_file_id) == ("batch_1", "in_progress", "")
    assert not message.HasField("completed_at")
    assert (message.request_counts.total, message.request_counts.completed, message.request_counts.failed) == (10, 4, 1)
    assert dict(message.metadata) == {"team": "search"}

    done = convert.get_batch_response({**batch, "status": "completed", "completed_at": 200}, b'{"ok": 1}\n')
    assert done.batch.completed_at == 200 and done.output_content == b'{"ok": 1}\n'


@pytest.mark.parametrize(
    "status,code",
    [
        (400, grpc.StatusCode.INVALID_ARGUMENT),
        (404, grpc.StatusCode.NOT_FOUND),
        (409, grpc.StatusCode.FAILED_PRECONDITION),
        (413, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (422, grpc.StatusCode.INVALID_ARGUMENT),
        (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (500, grpc.StatusCode.INTERNAL),
        (503, grpc.StatusCode.UNAVAILABLE),
        (504, grpc.StatusCode.DEADLINE_EXCEEDED),
        (418, grpc.StatusCode.FAILED_PRECONDITION),
        (507, grpc.StatusCode.INTERNAL),
        (302, grpc.StatusCode.UNKNOWN),
    ],
)
def test_grpc_code_for_http_status(status, code):
    assert convert.grpc_code_for_http_status(status) is code


def test_grpc_error_from_openai_carries_body_and_retry_after():
    body = {"error": {"message": "queue full for class realtime", "type": "rate_limit", "param": None, "code": "busy"}}
    error = convert.grpc_error_from_openai(429, body, retry_after_s=1.6)
    assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details == "queue full for class realtime"
    assert error.trailing_metadata == (
        ("http-status", "429"),
        ("error-type", "rate_limit"),
        ("error-code", "busy"),
        ("retry-after", "2"),
    )
    assert convert.grpc_error_from_openai(500, None).details == "HTTP 500"


def test_rate_limit_headers_travel_as_grpc_metadata_and_other_headers_do_not():
    headers = {"x-ratelimit-limit-requests": "30", "X-RateLimit-Remaining-Tokens": "0", "x-llm-lanes-lane": "hot",
               "Retry-After": "3"}
    assert convert.metadata_from_headers(headers) == [("x-ratelimit-limit-requests", "30"),
                                                      ("x-ratelimit-remaining-tokens", "0")]
    error = convert.grpc_error_from_openai(429, {"error": {"message": "slow down"}}, 3, headers)
    assert error.trailing_metadata == (("http-status", "429"), ("retry-after", "3"),
                                       ("x-ratelimit-limit-requests", "30"), ("x-ratelimit-remaining-tokens", "0"))


# A caller that sends a W3C traceparent along with the application name.
TRACED_METADATA = (("application", "llm-lanes"), ("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-01"))


def test_apply_grpc_error_on_ray_serve_context_keeps_request_id():
    from ray.serve.grpc_util import RayServegRPCContext  # import only: no Ray cluster starts

    context = RayServegRPCContext(FakeServicerContext(TRACED_METADATA))
    assert context.application() == "llm-lanes"
    convert.apply_grpc_error(context, convert.grpc_error_from_openai(400, {"error": {"message": "bad max_tokens"}}))
    assert context.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert context.details() == "bad max_tokens"
    assert context.trailing_metadata() == [("request_id", "req-1"), ("http-status", "400")]


class _EchoServicer(pb_grpc.LlmLanesServicer):
    """Shaped like the Router's gRPC methods: proto -> OpenAI dict -> proto, errors via the context."""

    def Complete(self, request, context):
        try:
            converted = convert.completion_request_to_openai(request, stream=False)
        except convert.InvalidProtoRequest as exc:
            error = convert.grpc_error_from_openai(400, {"error": {"message": str(exc), "param": exc.param}})
            context.abort(error.code, error.details)
        response = {
            "id": "c1",
            "model": converted.body.get("model", ""),
            "choices": [{"text": converted.body["prompt"].upper(), "finish_reason": "stop"}],
        }
        return convert.completion_response_from_openai(response, convert.serving_info("hot", converted.request_class))

    def Generate(self, request, context):
        converted = convert.completion_request_to_openai(request, stream=True)
        for piece in converted.body["prompt"].split():
            yield convert.completion_chunk_from_openai({"choices": [{"text": piece}]}, num_tokens=1)
        yield convert.completion_chunk_from_openai({"choices": [], "usage": USAGE})


def test_stubs_work_over_a_real_channel():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_LlmLanesServicer_to_server(_EchoServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.LlmLanesStub(channel)
            metadata = (("application", "llm-lanes"),)
            reply = stub.Complete(
                pb.CompletionRequest(prompt="hi", request_class=pb.REQUEST_CLASS_REALTIME), metadata=metadata
            )
            assert reply.text == "HI" and reply.serving.request_class == pb.REQUEST_CLASS_REALTIME

            chunks = list(stub.Generate(pb.CompletionRequest(prompt="a b c"), metadata=metadata))
            assert [c.text for c in chunks] == ["a", "b", "c", ""]
            assert chunks[-1].usage.total_tokens == 17

            bad = pb.CompletionRequest(prompt="x")
            bad.request_class = 9
            with pytest.raises(grpc.RpcError) as excinfo:
                stub.Complete(bad, metadata=metadata)
            assert excinfo.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "request_class" in excinfo.value.details()

            with pytest.raises(grpc.RpcError) as excinfo:
                stub.GetStats(pb.GetStatsRequest(), metadata=metadata)
            assert excinfo.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(grace=None)
