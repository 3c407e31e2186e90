"""A client's bad input is that client's 4xx: the request models refuse what the engine would refuse (400 naming the
parameter), a lane's refusal of a request reaches the client as 400 and never counts against the lane's breaker, and
neither does a deadline the client itself asked for. Fakes around the Router's real request path; no Ray."""

from __future__ import annotations

import asyncio
import pickle

import pytest
from fastapi.testclient import TestClient

from app.classes import Lane
from app.lanes.types import LaneRequest, LaneRequestInvalid
from app.router import openai_api as api
from app.router.breaker import BreakerState
from app.router.endpoints import CHAT, COMPLETION
from app.router.http_api import HTTP_ROUTES, make_http_app
from tests.fakes import FakeLane, FakeStream, generation, make_pipeline, make_router
from tests.hostile_requests import generated, requests_


def completion(**fields):
    return {"model": "tiny", "prompt": "hello", **fields}


def chat(content="hello", **fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **fields}


LONE_SURROGATE = "a\ud800b"


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    return make_router(tmp_path_factory.mktemp("bad_input"))


def refusal(router, endpoint, body) -> api.OpenAIError:
    """The error the pipeline answers for this body (HTTP, gRPC and batch lines all go through answer())."""
    with pytest.raises(api.OpenAIError) as refused:
        asyncio.run(router.pipeline.answer(endpoint, body))
    return refused.value


# vLLM's server names the parameter where its checks do (its empty-stop and n checks name none).
@pytest.mark.parametrize("endpoint, fields, param", [
    (COMPLETION, completion(stop=[""]), None),
    (CHAT, chat(stop=["x", ""]), None),
    (COMPLETION, completion(seed=2**64), "seed"),
    (COMPLETION, completion(seed=-(2**63) - 1), "seed"),
    (COMPLETION, completion(temperature=2.5), "temperature"),
    (COMPLETION, completion(temperature=float("nan")), "temperature"),
    (COMPLETION, completion(top_p=0), "top_p"),
    (COMPLETION, completion(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_completion_tokens=0), "max_tokens"),
    (COMPLETION, completion(n=0), None),
    (COMPLETION, completion(prompt=LONE_SURROGATE), "prompt"),
    (COMPLETION, completion(prompt=[LONE_SURROGATE]), "prompt"),
    (COMPLETION, completion(stop=[LONE_SURROGATE]), "stop"),
    (COMPLETION, completion(model=LONE_SURROGATE), "model"),
    (COMPLETION, completion(service_tier="\udfff"), "service_tier"),
    (CHAT, chat(LONE_SURROGATE), "messages"),
    (CHAT, chat([{"type": "text", "text": LONE_SURROGATE}]), "messages"),
    (COMPLETION, completion(stop=5), "stop"),
    (COMPLETION, completion(logit_bias={"abc": 1}), "logit_bias"),
    (COMPLETION, completion(response_format=-1), "response_format"),
    (CHAT, chat(tools="str"), "tools"),
    (CHAT, chat(tool_choice="required"), "tool_choice"),
    (COMPLETION, completion(prompt="x" * 100_000), "prompt"),
    (COMPLETION, completion(service_tier="gold"), "service_tier"),
    (CHAT, chat(priority=5), "priority"),
])
def test_what_vllms_server_refuses_is_a_400_naming_its_parameter(router, endpoint, fields, param):
    error = refusal(router, endpoint, fields)
    assert (error.status, error.param) == (400, param), error.body()
    assert not router.lanes["hot"].requests and not router.lanes["cold"].requests


def test_more_choices_than_the_router_takes_are_refused_naming_n(router):
    limit = router.pipeline.cfg.router.max_choices
    error = refusal(router, COMPLETION, completion(n=limit + 1))
    assert (error.status, error.param, error.code) == (400, "n", "too_many_choices")
    assert "router.max_choices" in error.message
    assert refusal(router, COMPLETION, completion(n=float(limit + 1))).code == "too_many_choices"


def test_too_many_messages_are_refused_before_rendering(router):
    messages = [{"role": "user", "content": "x"}] * (router.pipeline.cfg.router.max_messages + 1)
    error = refusal(router, CHAT, {"model": "tiny", "messages": messages})
    assert (error.status, error.param, error.code) == (400, "messages", "too_many_messages")


@pytest.mark.parametrize("fields", [completion(seed=2**63 - 1), completion(seed=-1), completion(stop=["x", "y"]),
                                    completion(temperature=0, top_p=1), completion(prompt="héllo 🙂"),
                                    completion(echo=True, presence_penalty=1), completion(top_k=5, min_p=0.1)])
def test_values_the_engine_takes_are_accepted(router, fields):
    answer = asyncio.run(router.pipeline.answer(COMPLETION, fields))
    assert answer.response["choices"][0]["text"].endswith("abcdef")


def test_lone_surrogates_are_found_in_nested_content_parts():
    assert api.has_lone_surrogate([{"type": "text", "text": "ok"}, {"\udc80": "key"}])
    assert not api.has_lone_surrogate([{"type": "text", "text": "😀 fine"}, 5, None])


# ---- over HTTP: raw JSON escapes and malformed bodies ---------------------------------------------------------------

@pytest.fixture
def http(tmp_path):
    app = make_http_app()
    router = make_router(tmp_path)
    for name in ("completions", "chat_completions"):
        HTTP_ROUTES[name](app)(getattr(router, name))
    with TestClient(app) as client:
        yield client, router


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", rb'{"model": "tiny", "prompt": "a\ud800"}', "prompt"),
    ("/v1/completions", rb'{"model": "tiny", "prompt": "hi", "stop": ["\udfff"]}', "stop"),
    ("/v1/chat/completions", rb'{"model": "tiny", "messages": [{"role": "user", "content": "\ud83d"}]}',
     "messages"),
    ("/v1/completions", rb'{"model": "tiny", "prompt": "hi", "max_tokens": 4, "stop": [""]}', None),
    ("/v1/completions", rb'{"model": "tiny", "prompt": "hi", "max_tokens": 4, "seed": 18446744073709551616}', "seed"),
    ("/v1/completions", rb'{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "' + b"x" * 200_000 + b'"}', "prompt"),
])
def test_http_answers_bad_values_400_and_no_lane_sees_them(http, path, raw, param):
    client, router = http
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert not router.lanes["hot"].requests and not router.lanes["cold"].requests


def test_an_endpoint_this_server_does_not_have_is_named_with_those_it_has(http):
    client, _ = http
    missing = client.post("/v1/responses", json={"model": "tiny", "input": "hi"})
    error = missing.json()["error"]
    assert (missing.status_code, error["code"]) == (404, "not_found")
    assert "POST /v1/responses is not an endpoint" in error["message"] and "/v1/chat/completions" in error["message"]
    wrong_method = client.get("/v1/chat/completions")
    assert (wrong_method.status_code, wrong_method.headers["allow"]) == (405, "POST")
    assert wrong_method.json()["error"]["message"].endswith("/v1/chat/completions takes POST, not GET")


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"model": "tiny", "prompt": "x"', b"\xff\xfe", b"[]", b"5",
                                 b'{"model": "tiny", "prompt": "x", "max_tokens": 1e999}'])
def test_http_answers_malformed_bodies_4xx(http, raw):
    client, _ = http
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# ---- a lane's refusal is the client's 400, never the lane's failure ------------------------------------------------

class RefusingStream(FakeStream):
    def __init__(self):
        super().__init__([])

    async def __anext__(self):
        raise LaneRequestInvalid("stop cannot contain an empty string.", "stop")


class RefusingLane(FakeLane):
    """A lane whose engine refuses every request whose prompt starts with token 0, and serves the rest."""

    def remote(self, request: LaneRequest):
        if request.prompt_token_ids[0] == 0:
            self.requests.append(request)
            return RefusingStream()
        return super().remote(request)


async def test_a_lanes_refusal_is_a_400_and_never_opens_its_breaker():
    pipeline, lanes, _ = make_pipeline({"hot": RefusingLane("hot"), "cold": RefusingLane("cold")})
    threshold = pipeline.cfg.admission.breaker.failure_threshold
    for _ in range(5 * threshold):
        with pytest.raises(api.OpenAIError) as refused:
            await pipeline.start(COMPLETION, generation(prompt_token_ids=[0, 5]))
        assert (refused.value.status, refused.value.param) == (400, "stop")
        assert "empty string" in refused.value.message
    assert len(lanes["hot"].requests) == 5 * threshold, "each refusal came from the lane"
    assert {lane: b.state for lane, b in pipeline.control.breakers.items()} == {
        Lane.HOT: BreakerState.CLOSED, Lane.COLD: BreakerState.CLOSED}
    answer = await pipeline.answer(COMPLETION, completion(max_tokens=2))
    assert answer.calls[0].lane is Lane.HOT and answer.response["choices"][0]["text"] == "abcdef"


async def test_a_lane_failure_still_counts_against_its_breaker():
    class DeadStream(FakeStream):
        async def __anext__(self):
            raise RuntimeError("the replica died")

    class DeadLane(FakeLane):
        def remote(self, request):
            return DeadStream([])

    pipeline, _, _ = make_pipeline({"hot": DeadLane("hot"), "cold": FakeLane("cold")})
    for _ in range(pipeline.cfg.admission.breaker.failure_threshold):
        with pytest.raises(api.OpenAIError) as failed:
            await pipeline.start(COMPLETION, generation(),
                                 class_header="realtime")
        assert failed.value.status == 503
    assert pipeline.control.breakers[Lane.HOT].state is BreakerState.OPEN


async def test_the_clients_own_short_deadline_is_a_504_that_no_breaker_counts():
    slow = {"hot": FakeLane("hot", delay_s=0.2), "cold": FakeLane("cold", delay_s=0.2)}
    pipeline, _, _ = make_pipeline(slow)
    for _ in range(3 * pipeline.cfg.admission.breaker.failure_threshold):
        with pytest.raises(api.OpenAIError) as late:
            await pipeline.start(COMPLETION, generation(),
                                 client_timeout_s=0.01)
        assert late.value.status == 504
        assert "0.01 s deadline of its X-Request-Timeout header" in late.value.message
    assert all(b.state is BreakerState.CLOSED for b in pipeline.control.breakers.values())


def test_lane_request_invalid_survives_pickling_with_its_parameter():
    copy = pickle.loads(pickle.dumps(LaneRequestInvalid("seed too large", "seed")))
    assert (copy.message, copy.param, str(copy)) == ("seed too large", "seed", "seed too large")


# ---- the engine adapter's backstop --------------------------------------------------------------------------------

def test_the_engine_adapter_tells_vllms_refusals_from_its_failures():
    pytest.importorskip("vllm")
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    from app.lanes.engine import request_invalid

    invalid = request_invalid(VLLMValidationError("top_p must be in (0, 1], got 2.", parameter="top_p", value=2))
    assert (invalid.message, invalid.param) == ("top_p must be in (0, 1], got 2.", "top_p")
    wrapped = EngineGenerateError()
    wrapped.__cause__ = OverflowError("can't serialize ints < -2**63 or > 2**64 - 1")
    assert request_invalid(wrapped).message.startswith("can't serialize")
    assert request_invalid(ValueError("bad \udc80")).message == "bad \\udc80", "printable as UTF-8"
    assert request_invalid(EngineDeadError()) is None
    assert request_invalid(EngineGenerateError()) is None
    assert request_invalid(RuntimeError("CUDA error")) is None


async def test_the_engine_adapter_raises_lane_request_invalid_only_before_the_first_output():
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.engine.exceptions import EngineGenerateError

    from app.classes import RequestClass
    from app.config import load_app_config
    from app.lanes.engine import VllmEngine
    from app.lanes.types import SamplingOptions
    from tests.fakes import cpu_args

    class FakeAsyncLLM:
        def __init__(self, outputs_before_error: int):
            self.outputs_before_error = outputs_before_error

        async def generate(self, prompt, params, request_id, priority=0):
            for _ in range(self.outputs_before_error):
                yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1], text="a", finish_reason=None)],
                                      num_cached_tokens=0, finished=False)
            raise EngineGenerateError() from OverflowError("can't serialize ints > 2**64 - 1")

    cfg = load_app_config(cpu_args())
    engine = VllmEngine(cfg, cfg.hot_lane.engine, "hot", "r1")
    request = LaneRequest("r", [1, 2], SamplingOptions(max_tokens=4), RequestClass.INTERACTIVE, 10)

    engine._engine = FakeAsyncLLM(0)
    with pytest.raises(LaneRequestInvalid):
        [chunk async for chunk in engine.generate(request)]
    engine._engine = FakeAsyncLLM(1)
    with pytest.raises(EngineGenerateError):
        [chunk async for chunk in engine.generate(request)]
    # vLLM's own checks of the sampling values, before the engine is asked at all.
    bad = LaneRequest("r", [1, 2], SamplingOptions(max_tokens=4, stop=("",)), RequestClass.INTERACTIVE, 10)
    with pytest.raises(LaneRequestInvalid, match="empty string"):
        [chunk async for chunk in engine.generate(bad)]


# ---- bounded work on bad input ------------------------------------------------------------------------------------

def test_a_prompt_far_over_the_context_is_refused_without_tokenizing_it(router):
    import time

    started = time.perf_counter()
    error = refusal(router, COMPLETION, completion(prompt="word " * 2_000_000))  # 10 MB
    assert (error.status, error.param, error.code) == (400, "prompt", "context_length_exceeded")
    assert time.perf_counter() - started < 2.0, "refused from its length, not after tokenizing 10 MB"
    messages = [{"role": "user", "content": "word " * 200_000}] * 10
    assert refusal(router, CHAT, {"model": "tiny", "messages": messages}).code == "context_length_exceeded"


def test_a_body_over_the_limit_is_413_before_it_is_parsed(tmp_path):
    app = make_http_app()
    router = make_router(tmp_path, router={"max_request_bytes": 4096})
    HTTP_ROUTES["completions"](app)(router.completions)
    with TestClient(app) as client:
        response = client.post("/v1/completions", content=b'{"model": "tiny", "prompt": "' + b"x" * 5000 + b'"}',
                               headers={"content-type": "application/json"})
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        small = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert small.status_code == 200


# ---- fields vLLM's request models do not know -----------------------------------------------------------------------

@pytest.mark.parametrize("endpoint, fields, param", [
    (CHAT, chat(temprature=0), "temprature"),
    (COMPLETION, completion(max_token=3), "max_token"),
    (CHAT, chat(functions=[{"name": "f", "parameters": {}}]), "functions"),
    (CHAT, chat(store=True), "store"),
    (CHAT, chat(store=False, metadata={"team": "a"}), "metadata"),
    (COMPLETION, completion(zeta=1, alpha=2), "alpha"),
    (CHAT, chat(stream=True, stream_options={"include_usag": True}), "stream_options.include_usag"),
    (CHAT, chat(response_format={"type": "text", "foo": 1}), "response_format.foo"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}, "strct": True}}]),
     "tools.0.function.strct"),
    (CHAT, {"model": "tiny", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "contnet": "hi"}]},
     "messages.1.contnet"),
])
def test_a_field_that_vllms_models_do_not_know_is_refused_naming_it(router, endpoint, fields, param):
    sent = len(router.lanes["hot"].requests) + len(router.lanes["cold"].requests)
    error = refusal(router, endpoint, fields)
    assert (error.status, error.param, error.code) == (400, param, "unrecognized_argument"), error.body()
    assert param in error.message
    assert len(router.lanes["hot"].requests) + len(router.lanes["cold"].requests) == sent



def conversation(*messages):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}, *messages]}


def call(function):
    return {"id": "call_1", "type": "function", "function": function}


# pydantic tries each member of vLLM's message and content-part unions and lists every member's errors (seven for a
# text part without its text); the refusal names the place in the request, as the member the value was meant for.
@pytest.mark.parametrize("fields, param, says", [
    (conversation({"role": "user", "content": [{"type": "text"}]}), "messages.1.content.0.text", "Field required"),
    (conversation({"role": "user", "content": [{"type": "text", "text": 5}]}), "messages.1.content.0.text",
     "valid string"),
    (conversation({"role": "user", "content": [{"text": "hi"}]}), "messages.1.content.0.type", "Field required"),
    (conversation({"role": "user", "content": [{"type": "txet", "text": "hi"}]}), "messages.1.content.0.type",
     "'text', 'image_url', 'input_audio' or 'file'"),
    (conversation({"role": "user", "content": [5]}), "messages.1.content.0", "valid dictionary"),
    (conversation({"role": "user", "content": {"type": "text", "text": "hi"}}), "messages.1.content",
     "a string or a list, not an object"),
    (conversation({"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}),
     "messages.1.content.1.text", "Field required"),
    (conversation({"content": "hi"}), "messages.1.role", "Field required"),
    (conversation({"role": 5, "content": "hi"}), "messages.1.role", "valid string"),
    (conversation("hi"), "messages.1", "valid dictionary"),
    (conversation({"role": "assistant", "tool_calls": [call({"name": "f", "argumets": "{}"})]}),
     "messages.1.tool_calls.0.function.arguments", "Field required"),
    (conversation({"role": "assistant", "tool_calls": [call({"name": "f", "arguments": 5})]}),
     "messages.1.tool_calls.0.function.arguments", "valid string"),
    (conversation({"role": "assistant", "tool_calls": [call({"name": "f", "arguments": "{}"}), 7]}),
     "messages.1.tool_calls.1", "valid dictionary"),
])
def test_a_malformed_message_is_refused_naming_its_place(router, fields, param, says):
    error = refusal(router, CHAT, fields)
    assert (error.status, error.param) == (400, param), error.body()
    assert error.message == f"{param}: {error.message.split(': ', 1)[1]}" and says in error.message
    assert "validation error" not in error.message and "Param" not in error.message


def test_tokenize_names_the_place_of_a_malformed_message(router):
    with pytest.raises(api.OpenAIError) as refused:
        asyncio.run(router.pipeline.surface.tokenize(conversation({"role": "user", "content": [{"type": "text"}]})))
    assert (refused.value.status, refused.value.param) == (400, "messages.1.content.0.text")


def test_union_errors_are_narrowed_to_the_member_the_value_was_meant_for():
    def error(loc, kind="missing", **ctx):
        return {"loc": loc, "type": kind, "msg": kind, **({"ctx": ctx} if ctx else {})}

    # The member whose own literal the value does not contradict, with its class name dropped; a later error kept.
    errors = [error(("messages", 0, "DeveloperParam", "role"), "literal_error", expected="'developer'"),
              error(("messages", 0, "UserParam", "content")), error(("messages", 0, "UserParam", "name")),
              error(("messages", 0, "CustomParam", "content")), error(("n",), "greater_than")]
    assert [e["loc"] for e in api.narrow_union_errors(errors)] == [("messages", 0, "content"), ("n",)]
    # Every member's literal contradicted: one error saying what the field may be.
    errors = [error((0, "TextPart", "type"), "literal_error", expected="'text'"), error((0, "TextPart", "text")),
              error((0, "ImagePart", "type"), "literal_error", expected="'image_url'")]
    assert [(e["loc"], e["msg"]) for e in api.narrow_union_errors(errors)] == [
        ((0, "type"), "Input should be 'text' or 'image_url'")]
    # Nested unions narrow one after the other; errors without a union are left as they are.
    errors = [error(("messages", 1, "AssistantParam", "tool_calls", 0, "FunctionCall", "function", "arguments")),
              error(("messages", 1, "AssistantParam", "tool_calls", 0, "CustomCall", "type"), "literal_error",
                    expected="'custom'")]
    assert [e["loc"] for e in api.narrow_union_errors(errors)] == [("messages", 1, "tool_calls", 0, "function",
                                                                    "arguments")]
    assert api.narrow_union_errors([error(("seed",), "int_type")]) == [error(("seed",), "int_type")]

WEATHER = {"type": "function", "function": {"name": "weather", "description": "d", "strict": True,
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("fields", [
    chat(service_tier="flex"), chat(store=False), chat(store=None), chat(user="u-1"),
    chat(stream_options={"include_usage": True}, stream=True),
    chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                 "schema": {"type": "object"}}}),
    chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}}),
    {"model": "tiny", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]},
])
def test_fields_of_vllms_models_and_those_the_router_honours_are_accepted(router, fields):
    async def answered():
        answer = await router.pipeline.answer(CHAT, fields)
        if answer.events is not None:
            return "".join([event async for event in answer.events])
        return answer.response["choices"][0]["message"]["content"]

    text = asyncio.run(answered())
    assert text and "error" not in text


def test_an_unrecognized_argument_error_names_a_few_fields_not_all():
    error = api.unrecognized_arguments({f"field_{i:04d}": i for i in range(5000)})
    assert error.param == "field_0000"
    assert "field_0004" in error.message and "field_0005" not in error.message
    assert "and 4995 more" in error.message and len(error.message) < 200
    assert api.unrecognized_arguments({"service_tier": "flex", "store": False}) is None
    assert api.unrecognized_arguments({"store": 0}).param == "store"
    assert api.unrecognized_arguments({"best_of": 2.0}, n=2) is None
    assert api.unrecognized_arguments({"best_of": True}).param == "best_of"
    assert api.unrecognized_arguments({"modalities": ["text"], "prompt_cache_key": "k", "safety_identifier": "u"}) is None
    assert api.unrecognized_arguments({"modalities": ["text", "audio"]}).param == "modalities"


def test_tokenize_and_detokenize_round_trip_and_refuse_fields_they_do_not_know(router):
    surface = router.pipeline.surface
    tokens = asyncio.run(surface.tokenize({"model": "tiny", "prompt": "hello world"}))
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = asyncio.run(surface.detokenize({"model": "tiny", "tokens": tokens["tokens"]}))
    assert text["prompt"].strip() == "hello world"
    with pytest.raises(api.OpenAIError) as refused:
        asyncio.run(surface.tokenize({"model": "tiny", "prompt": "hi", "service_tier": "flex"}))
    assert (refused.value.status, refused.value.param) == (400, "service_tier")


def test_a_batch_is_refused_naming_the_field_that_is_wrong_or_unknown(tmp_path):
    from app.batch.store import BatchStoreError
    from app.router.batch_api import BATCH_ROUTES, openai_error_from_store

    app = make_http_app({BatchStoreError: openai_error_from_store})
    router = make_router(tmp_path)
    for name in ("upload_file", "create_batch"):
        BATCH_ROUTES[name](app)(getattr(router, name))
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "x"}}'
    with TestClient(app) as client:
        file_id = client.post("/v1/files", files={"file": ("in.jsonl", line)}, data={"purpose": "batch"}).json()["id"]
        batch = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
        for body, status, param in [
                ({**batch, "completion_windw": "1h"}, 400, "completion_windw"),
                ({**batch, "store": None}, 400, "store"),
                ({**batch, "input_file_id": "file-nope"}, 404, "input_file_id"),
                ({**batch, "endpoint": "/v1/embeddings"}, 400, "endpoint"),
                ({**batch, "completion_window": "soon"}, 400, "completion_window")]:
            answer = client.post("/v1/batches", json=body)
            assert (answer.status_code, answer.json()["error"]["param"]) == (status, param), answer.text
        assert client.post("/v1/batches", json=batch).json()["status"] == "in_progress"


def test_a_query_parameter_a_route_does_not_declare_is_refused_naming_it(tmp_path):
    from app.batch.store import BatchStoreError
    from app.router.batch_api import BATCH_ROUTES, openai_error_from_store

    app = make_http_app({BatchStoreError: openai_error_from_store})
    router = make_router(tmp_path)
    for name in ("list_files", "list_batches"):
        BATCH_ROUTES[name](app)(getattr(router, name))
    HTTP_ROUTES["chat_completions"](app)(router.chat_completions)
    with TestClient(app) as client:
        for method, url, status, param in [
                ("GET", "/v1/files?sort=asc", 400, "sort"), ("GET", "/v1/files?order=up", 422, "order"),
                ("GET", "/v1/files?purpose=batch&after=file-nope", 404, "after"),
                ("GET", "/v1/batches?limit=0", 400, "limit"), ("GET", "/v1/batches?after=batch_nope", 404, "after"),
                ("POST", "/v1/chat/completions?stream=true", 400, "stream"),
                ("GET", "/v1/files?prompt_cache_key=k", 400, "prompt_cache_key")]:
            answer = client.request(method, url, json=chat())
            assert (answer.status_code, answer.json()["error"]["param"]) == (status, param), answer.text
        assert client.get("/v1/files?purpose=batch&limit=5&order=asc").json()["has_more"] is False
        assert client.get("/v1/batches?limit=5").status_code == 200


HOSTILE = 1000


def test_thousands_of_hostile_bodies_are_never_answered_5xx(http):
    """The generated hostile bodies of tests/hostile_requests.py (the real app gets 1,200 of them with its engine
    behind, tests/integration/test_bad_input.py): the Router's surface answers each below 500."""
    client, _ = http
    server_errors = []
    for path, raw in generated(requests_(), HOSTILE):
        # The fakes serve the model "tiny".
        raw = raw.replace(b'"model": "tiny-llama"', b'"model": "tiny"')
        response = client.post(path, content=raw, headers={"content-type": "application/json"})
        if response.status_code >= 500:
            server_errors.append((response.status_code, path, raw[:300], response.text[:300]))
    assert not server_errors, f"{len(server_errors)} answers 5xx, e.g. {server_errors[:5]}"


@pytest.mark.parametrize("body", [completion(prompt=[""]), completion(prompt=[[]]), completion(prompt=["", "hi"]),
                                  completion(prompt=""), chat(messages=[])])
async def test_a_request_that_can_never_succeed_is_400_even_when_admission_refuses_everything(body):
    """Admission refusing every interactive request (a queue bound of 0: a full Router): a request with nothing to
    prompt with is still 400, not the 429 a client would retry forever; a valid one is 429."""
    pipeline, lanes, _ = make_pipeline(admission={"interactive_queue_bound": 0})
    endpoint = COMPLETION if "prompt" in body else CHAT
    with pytest.raises(api.OpenAIError) as refused:
        await pipeline.answer(endpoint, body)
    assert refused.value.status == 400, refused.value.body()
    with pytest.raises(api.OpenAIError) as full:
        await pipeline.answer(COMPLETION, completion(max_tokens=2))
    assert full.value.status == 429 and full.value.code == "queue_full"
    assert not lanes["hot"].requests and not lanes["cold"].requests
