"""Observability wiring: the observability config block, the Router's gRPC methods, request metrics and traces, and the
lane replica's trace and engine gauges -- driven through the real Router/LaneReplica code with fake lanes, a fake
metrics backend, a fake tokenizer and a real SQLite batch store (no Ray cluster, no vLLM engine)."""

from __future__ import annotations

import asyncio
import importlib
import typing
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import yaml

from app.classes import Lane, RequestClass
from app.config import TRACING_EXPORTERS, ConfigError, load_app_config
from app.lanes.types import EngineStats, LaneChunk, LaneRequest, SamplingOptions
from app.observability import tracing as tr
from app.observability.metrics import LlmLanesMetrics
from app.prefix_cache.replica_feed import ReplicaPrefixFeed
from app.proto import convert
from app.router.deployment import publish_router_gauges
from app.proto.llm_lanes.v1 import llm_lanes_pb2 as pb
from tests.fakes import FakeMetricsModule, cpu_args, make_router
from tests.unit.grpc_fakes import FakeServicerContext

REPO = Path(__file__).resolve().parents[2]
SERVE_CONFIGS = sorted((REPO / "serve_configs").glob("*.yaml"))
TRACEPARENT = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"


# ---- config -------------------------------------------------------------------------------------------------------


def test_observability_defaults_are_off_and_cost_nothing():
    cfg = load_app_config(cpu_args())
    assert cfg.observability.tracing.exporter == "none"
    assert cfg.observability.vllm_metrics is True
    assert not tr.setup_tracing(cfg.observability.tracing).enabled
    assert not tr.setup_tracing(cfg.observability.tracing.model_dump()).enabled


def test_config_exporters_match_the_tracing_module():
    assert TRACING_EXPORTERS == tr.EXPORTERS
    from app.config import TracingConfig

    literal = typing.get_type_hints(TracingConfig)["exporter"]
    assert typing.get_args(literal) == tr.EXPORTERS


@pytest.mark.parametrize("tracing", [
    {"exporter": "console"},
    {"exporter": "memory", "sample_ratio": 0.25},
    {"exporter": "file", "file_path": "/tmp/spans.jsonl"},
    {"exporter": "otlp", "otlp_endpoint": "http://collector:4318/v1/traces", "service_name": "lanes-prod"},
])
def test_every_valid_tracing_block_builds_tracing(tracing):
    cfg = load_app_config(cpu_args(observability={"tracing": tracing, "vllm_metrics": False}))
    assert cfg.observability.tracing.exporter == tracing["exporter"]
    if tracing["exporter"] in ("memory", "file"):  # local exporters: building them touches nothing outside
        assert tr.setup_tracing(cfg.observability.tracing.model_dump()).enabled
    assert cfg.observability.vllm_metrics is False


@pytest.mark.parametrize("tracing, message", [
    ({"exporter": "otlp"}, "observability.tracing: exporter 'otlp' needs otlp_endpoint"),
    ({"exporter": "file"}, "observability.tracing: exporter 'file' needs file_path"),
    ({"exporter": "jaeger"}, "observability.tracing.exporter"),
    ({"sample_ratio": 1.5}, "observability.tracing.sample_ratio"),
    ({"sample_ratio": -0.1}, "observability.tracing.sample_ratio"),
    ({"service_name": ""}, "observability.tracing.service_name"),
    ({"exporter": "none", "endpoint": "x"}, "observability.tracing.endpoint: unknown key"),
])
def test_invalid_tracing_blocks_name_the_field(tracing, message):
    with pytest.raises(ConfigError) as caught:
        load_app_config(cpu_args(observability={"tracing": tracing}))
    assert message in str(caught.value)


@pytest.mark.parametrize("path", [p for p in SERVE_CONFIGS if p.name != "local.yaml"], ids=lambda p: p.name)
def test_every_serve_config_wires_the_grpc_servicers(path):
    document = yaml.safe_load(path.read_text())
    options = document["grpc_options"]
    assert options["port"] == 9000
    functions = options["grpc_servicer_functions"]
    assert functions == [convert.LLM_LANES_SERVICER_FUNCTION, convert.HEALTH_SERVICER_FUNCTION]
    for dotted in functions:  # what Serve's proxy does with them
        module, _, name = dotted.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name))
    load_app_config(document["applications"][0]["args"])


def test_the_local_config_starts_no_grpc_proxy():
    """Serve binds its gRPC proxy to every interface and local.yaml has no keys: no gRPC there (Serve starts the
    proxy only for servicer functions)."""
    document = yaml.safe_load((REPO / "serve_configs" / "local.yaml").read_text())
    assert not (document.get("grpc_options") or {}).get("grpc_servicer_functions")
    assert document["http_options"]["host"] == "127.0.0.1"


# ---- fakes --------------------------------------------------------------------------------------------------------


def grpc_context(metadata=(("application", "llm-lanes"),)):
    from ray.serve.grpc_util import RayServegRPCContext  # import only: no Ray cluster starts

    return RayServegRPCContext(FakeServicerContext(metadata))


def completion(prompt="hello there", **fields) -> pb.CompletionRequest:
    return pb.CompletionRequest(model=fields.pop("model", "tiny"), prompt=prompt,
                                sampling=pb.SamplingParams(max_tokens=6, temperature=0.0), **fields)


def requests_total(router) -> list[dict[str, str]]:
    return [tags for _, tags in router.metrics_backend.of("llm_lanes_requests_total")]


async def collect(stream) -> list:
    return [message async for message in stream]


# ---- pure helpers -------------------------------------------------------------------------------------------------


def test_outcome_for_status_and_reason_label():
    from app.router.record import outcome_for_status, reason_label

    assert [outcome_for_status(s) for s in (200, 400, 404, 429, 499, 503, 504, 408)] == [
        "success", "error", "error", "rejected", "cancelled", "error", "timeout", "timeout"]
    assert reason_label("queue_full (12 >= 24)") == "queue_full"
    assert reason_label("long_context") == "long_context"


# ---- gRPC on the Router -------------------------------------------------------------------------------------------


async def test_grpc_complete_takes_the_http_path_and_records_metrics(tmp_path):
    router = make_router(tmp_path)
    context = grpc_context()
    reply = await router.Complete(completion(), grpc_context=context)
    assert isinstance(reply, pb.CompletionResponse)
    assert reply.text == "abcdef" and reply.finish_reason == "length"
    prompt_tokens = len(router.pipeline.surface.tokenizer.encode("hello there"))  # vLLM's: with the BOS token
    assert reply.usage.completion_tokens == 6 and reply.usage.prompt_tokens == prompt_tokens
    assert reply.serving.lane == "hot"
    assert reply.serving.request_class == pb.REQUEST_CLASS_INTERACTIVE
    assert context.code() is None
    sent = router.lanes["hot"].requests[0]
    assert sent.stream is False and sent.engine_params.temperature == 0.0 and sent.trace_carrier == {}

    backend = router.metrics_backend
    assert requests_total(router) == [{"lane": "hot", "request_class": "interactive", "outcome": "success",
                                       "status": "200"}]
    assert backend.of("llm_lanes_output_tokens_total") == [(6.0, {"lane": "hot", "request_class": "interactive"})]
    assert len(backend.of("llm_lanes_e2e_seconds")) == 1
    assert len(backend.of("llm_lanes_router_decision_seconds")) == 1
    # A non-streamed answer arrives whole: no TTFT/TPOT sample would mean anything.
    assert backend.of("llm_lanes_ttft_seconds") == [] and backend.of("llm_lanes_tpot_seconds") == []
    assert backend.of("llm_lanes_admission_decisions_total") == [
        (1.0, {"decision": "admit", "reason": "queued", "request_class": "interactive"})]
    # The queue depth is the periodic publisher's, not written per request: every class, the request gone.
    assert backend.of("llm_lanes_queue_depth") == []
    await publish_router_gauges(router.batch_store, router.control, router.metrics)
    assert sorted((tags["request_class"], value) for value, tags in backend.of("llm_lanes_queue_depth")) == [
        ("batch", 0.0), ("interactive", 0.0), ("realtime", 0.0)]


async def test_grpc_request_class_enum_wins_and_batch_goes_cold(tmp_path):
    router = make_router(tmp_path)
    reply = await router.Complete(completion(request_class=pb.REQUEST_CLASS_BATCH, service_tier="priority"),
                                  grpc_context=grpc_context())
    assert reply.serving.lane == "cold" and reply.serving.request_class == pb.REQUEST_CLASS_BATCH
    assert router.lanes["cold"].requests and not router.lanes["hot"].requests


async def test_grpc_an_empty_model_is_not_found_as_on_http(tmp_path):
    router = make_router(tmp_path)
    context = grpc_context()
    reply = await router.Complete(completion(model=""), grpc_context=context)
    assert reply == pb.CompletionResponse() and context.code() is grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("request_, code, status", [
    (completion(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "400"),
    (completion(model="gpt-9"), grpc.StatusCode.NOT_FOUND, "404"),
])
async def test_grpc_unary_errors_set_the_status_and_count_once(tmp_path, request_, code, status):
    router = make_router(tmp_path)
    context = grpc_context()
    reply = await router.Complete(request_, grpc_context=context)
    assert reply == pb.CompletionResponse()
    assert context.code() is code
    assert context.details()
    assert ("http-status", status) in context.trailing_metadata()
    assert ("request_id", "req-1") in context.trailing_metadata()
    assert requests_total(router) == [{"lane": "none", "request_class": "interactive", "outcome": "error",
                                       "status": status}]
    assert not router.lanes["hot"].requests


async def test_grpc_invalid_sampling_is_invalid_argument(tmp_path):
    router = make_router(tmp_path)
    context = grpc_context()
    request = completion()
    request.sampling.temperature = 5.0
    await router.Complete(request, grpc_context=context)
    assert context.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in context.details()


async def test_grpc_carries_every_openai_field_and_returns_the_whole_answer(tmp_path):
    from google.protobuf import json_format, struct_pb2

    router = make_router(tmp_path)
    fields = struct_pb2.Struct()
    fields.update({"logprobs": 1, "presence_penalty": 0.5, "frequency_penalty": 0.25, "max_tokens": 99})
    reply = await router.Complete(completion(openai_fields=fields), grpc_context=grpc_context())
    sent, = router.lanes["hot"].requests
    params = sent.engine_params
    assert (params.logprobs, params.presence_penalty, params.frequency_penalty) == (1, 0.5, 0.25)
    assert params.max_tokens == 6, "the typed field wins"
    whole = json_format.MessageToDict(reply.openai)
    assert whole["choices"][0]["logprobs"]["token_logprobs"] == [-1.0] * 6
    assert whole["choices"][0]["text"] == reply.text == "abcdef"

    fields = struct_pb2.Struct()
    fields.update({"response_format": -1})
    context = grpc_context()
    await router.Complete(completion(openai_fields=fields), grpc_context=context)
    assert context.code() is grpc.StatusCode.INVALID_ARGUMENT and "response_format" in context.details()


async def test_grpc_rejection_is_resource_exhausted_with_retry_after(tmp_path):
    router = make_router(tmp_path, admission={"interactive_queue_bound": 0})
    context = grpc_context()
    await router.ChatComplete(pb.ChatCompletionRequest(model="tiny", messages=[pb.ChatMessage(role="user",
                                                                                              content="hi")]),
                              grpc_context=context)
    assert context.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert any(key == "retry-after" for key, _ in context.trailing_metadata())
    assert requests_total(router) == [{"lane": "none", "request_class": "interactive", "outcome": "rejected",
                                       "status": "429"}]
    decisions = router.metrics_backend.of("llm_lanes_admission_decisions_total")
    assert decisions == [(1.0, {"decision": "reject", "reason": "queue_full", "request_class": "interactive"})]


async def test_grpc_generate_streams_chunks_with_serving_first_and_usage_last(tmp_path):
    router = make_router(tmp_path)
    chunks = await collect(router.Generate(completion(service_tier="priority"), grpc_context=grpc_context()))
    assert [c.text for c in chunks] == ["ab", "cd", "ef"]
    assert [c.num_tokens for c in chunks] == [2, 2, 2]
    assert chunks[0].serving.lane == "hot" and chunks[0].serving.request_class == pb.REQUEST_CLASS_REALTIME
    assert not chunks[1].HasField("serving")
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 6
    assert not chunks[0].HasField("usage")
    assert router.lanes["hot"].requests[0].stream is True

    backend = router.metrics_backend
    labels = {"lane": "hot", "request_class": "realtime"}
    assert [tags for _, tags in backend.of("llm_lanes_ttft_seconds")] == [labels]
    assert [tags for _, tags in backend.of("llm_lanes_tpot_seconds")] == [labels]
    assert [tags for _, tags in backend.of("llm_lanes_queue_wait_seconds")] == [{"request_class": "realtime"}]
    assert requests_total(router) == [{**labels, "outcome": "success", "status": "200"}]


async def test_grpc_chat_stream_sets_the_role_on_the_first_chunk(tmp_path):
    router = make_router(tmp_path)
    request = pb.ChatCompletionRequest(model="tiny", messages=[pb.ChatMessage(role="user", content="hi")])
    chunks = await collect(router.ChatCompleteStream(request, grpc_context=grpc_context()))
    assert chunks[0].role == "assistant" and chunks[1].role == ""
    assert "".join(c.content for c in chunks) == "abcdef"
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 6


async def test_grpc_stream_error_sets_the_code_then_raises(tmp_path):
    router = make_router(tmp_path)
    context = grpc_context()
    with pytest.raises(RuntimeError, match="does not exist"):
        await collect(router.Generate(completion(model="other"), grpc_context=context))
    # Serve wraps the raised error with the code and details set on the context (gRPCStatusError).
    assert context.code() is grpc.StatusCode.NOT_FOUND


async def test_grpc_client_leaving_mid_stream_counts_as_cancelled(tmp_path):
    router = make_router(tmp_path)
    stream = router.Generate(completion(), grpc_context=grpc_context())
    first = await anext(stream)
    assert first.text == "ab"
    await stream.aclose()
    assert requests_total(router) == [{"lane": "hot", "request_class": "interactive", "outcome": "cancelled",
                                       "status": "499"}]
    assert router.lanes["hot"].requests and router.metrics_backend.of("llm_lanes_e2e_seconds") == []


async def test_grpc_get_stats_is_the_admin_document(tmp_path):
    router = make_router(tmp_path)

    class StatsHandle:
        def __init__(self, body):
            self.stats = SimpleNamespace(remote=lambda: asyncio.sleep(0, result=body))

    router.lane_handles = {Lane.HOT: StatsHandle({"running": 1, "lane": "hot"}),
                           Lane.COLD: StatsHandle({"running": 2})}
    router.prefix_cache = StatsHandle({"entries": 3})
    reply = await router.GetStats(pb.GetStatsRequest(), grpc_context=grpc_context())
    document = reply.stats
    assert document["lanes"]["hot"][0]["running"] == 1
    assert document["prefix_cache"]["entries"] == 3
    assert document["router"]["breakers"]["hot"] == "closed"
    assert (document["router"]["batch_window"], document["router"]["batch_in_flight_limit"]) == (16, 16)
    assert document["router"]["replicas_seen"] == {"cold": 1, "router": 1}


async def test_grpc_submit_and_get_batch_use_the_batch_store(tmp_path):
    router = make_router(tmp_path)
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "x"}}\n'
    batch = await router.SubmitBatch(pb.SubmitBatchRequest(input_content=line, endpoint="/v1/completions",
                                                           metadata={"team": "search"}), grpc_context=grpc_context())
    assert batch.id and batch.input_file_id and batch.request_counts.total == 1
    assert batch.metadata["team"] == "search" and batch.completion_window == "24h"
    reply = await router.GetBatch(pb.GetBatchRequest(batch_id=batch.id, include_output=True),
                                  grpc_context=grpc_context())
    assert reply.batch.id == batch.id and reply.output_content == b""

    context = grpc_context()
    await router.GetBatch(pb.GetBatchRequest(batch_id="batch_missing"), grpc_context=context)
    assert context.code() is grpc.StatusCode.NOT_FOUND

    context = grpc_context()
    await router.SubmitBatch(pb.SubmitBatchRequest(input_content=line, endpoint="/v1/embeddings"),
                             grpc_context=context)
    assert context.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_grpc_health_check_list_and_watch(tmp_path, monkeypatch):
    from grpc_health.v1 import health_pb2

    from app.router import grpc_api

    monkeypatch.setattr(grpc_api, "HEALTH_WATCH_INTERVAL_S", 0.01)
    router = make_router(tmp_path)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert (await router.Check(health_pb2.HealthCheckRequest(), grpc_context=grpc_context())).status == serving
    reply = await router.Check(health_pb2.HealthCheckRequest(service="llm_lanes.v1.LlmLanes"),
                               grpc_context=grpc_context())
    assert reply.status == serving
    context = grpc_context()
    await router.Check(health_pb2.HealthCheckRequest(service="nope"), grpc_context=context)
    assert context.code() is grpc.StatusCode.NOT_FOUND
    listed = await router.List(health_pb2.HealthListRequest(), grpc_context=grpc_context())
    assert set(listed.statuses) == {"", "llm_lanes.v1.LlmLanes"}

    watch = router.Watch(health_pb2.HealthCheckRequest(), grpc_context=grpc_context())
    assert (await anext(watch)).status == serving
    for _ in range(router.cfg.admission.breaker.failure_threshold):
        router.control.breakers[next(iter(router.control.breakers))].record_failure()
    assert (await asyncio.wait_for(anext(watch), timeout=5)).status == health_pb2.HealthCheckResponse.NOT_SERVING
    await watch.aclose()


# ---- tracing through the Router and a lane replica ----------------------------------------------------------------


async def test_router_trace_continues_the_caller_and_reaches_the_lane(tmp_path):
    router = make_router(tmp_path, tracing_exporter="memory")
    metadata = (("application", "llm-lanes"), ("traceparent", TRACEPARENT))
    chunks = await collect(router.Generate(completion(), grpc_context=grpc_context(metadata)))
    assert chunks
    spans = {span["name"]: span for span in router.tracing.finished_spans()}
    assert set(spans) == {tr.SPAN_REQUEST, tr.SPAN_CLASSIFY, tr.SPAN_ADMIT, tr.SPAN_ROUTE, tr.SPAN_QUEUE_WAIT}
    request = spans[tr.SPAN_REQUEST]
    assert request["trace_id"] == "a" * 32 and request["parent_span_id"] == "b" * 16
    for name in (tr.SPAN_CLASSIFY, tr.SPAN_ADMIT, tr.SPAN_ROUTE, tr.SPAN_QUEUE_WAIT):
        assert spans[name]["parent_span_id"] == request["span_id"], name
    assert request["attributes"]["llm_lanes.outcome"] == "success"
    assert request["attributes"]["llm_lanes.lane"] == "hot"
    carrier = router.lanes["hot"].requests[0].trace_carrier
    assert carrier["traceparent"].split("-")[1:3] == ["a" * 32, request["span_id"]]


async def test_router_trace_records_a_failed_request(tmp_path):
    router = make_router(tmp_path, tracing_exporter="memory")
    await router.Complete(completion(prompt=""), grpc_context=grpc_context())
    spans = {span["name"]: span for span in router.tracing.finished_spans()}
    # Refused while vLLM's code rendered it: before classification, admission and any lane.
    assert set(spans) == {tr.SPAN_REQUEST}
    assert spans[tr.SPAN_REQUEST]["attributes"]["http.response.status_code"] == 400


async def test_http_path_continues_the_traceparent_header_and_honours_the_class_header(tmp_path):
    from starlette.requests import Request

    router = make_router(tmp_path, tracing_exporter="memory")

    async def receive():
        return {"type": "http.request", "body": b'{"model": "tiny", "prompt": "hi", "max_tokens": 6}',
                "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                       "headers": [(b"traceparent", TRACEPARENT.encode()), (b"x-request-class", b"batch")]}, receive)
    response = await router.completions(request)
    assert response.status_code == 200 and response.headers["x-llm-lanes-lane"] == "cold"
    request_span = next(s for s in router.tracing.finished_spans() if s["name"] == tr.SPAN_REQUEST)
    assert request_span["trace_id"] == "a" * 32
    assert requests_total(router) == [{"lane": "cold", "request_class": "batch", "outcome": "success",
                                       "status": "200"}]


async def test_router_publishes_the_batch_backlog(tmp_path):
    router = make_router(tmp_path)
    lines = "".join('{"custom_id": "%s", "method": "POST", "url": "/v1/completions", '
                    '"body": {"model": "tiny", "prompt": "x"}}\n' % i for i in range(3)).encode()
    batch = await router.SubmitBatch(pb.SubmitBatchRequest(input_content=lines, endpoint="/v1/completions"),
                                     grpc_context=grpc_context())
    assert batch.request_counts.total == 3
    await publish_router_gauges(router.batch_store, router.control, router.metrics)
    assert router.metrics_backend.of("llm_lanes_batch_backlog_lines") == [(3.0, {})]
    assert len(router.metrics_backend.of("llm_lanes_queue_depth")) == 3


class FakeEngine:
    def __init__(self):
        self.usage = 0.25
        self.queries = 0
        self.hits = 0

    async def start(self):
        pass

    async def generate(self, request):
        for i in range(3):
            await asyncio.sleep(0.001)
            yield LaneChunk(text="x", completion_tokens=i + 1, prompt_tokens=4,
                            finish_reason="stop" if i == 2 else None)

    async def abort(self, request_id):
        pass

    def stats(self):
        return EngineStats(kv_cache_usage=self.usage, prefix_cache_queries=self.queries,
                           prefix_cache_hits=self.hits)

    def shutdown(self):
        pass


async def make_replica(monkeypatch, exporter: str):
    """A LaneReplica with a fake engine; Serve's replica context and metrics module are faked."""
    import ray.serve
    from app.lanes import replica as replica_module
    from app.observability import metrics as metrics_module

    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: SimpleNamespace(
        replica_id=SimpleNamespace(unique_id="r1", to_full_id_str=lambda: "llm-lanes#ColdLane#r1")))
    backend = FakeMetricsModule()
    monkeypatch.setattr(metrics_module, "LlmLanesMetrics", lambda: LlmLanesMetrics(metrics_module=backend))

    class ColdReplica(replica_module.LaneReplica):
        lane = "cold"

    replica = object.__new__(ColdReplica)
    args = cpu_args(observability={"tracing": {"exporter": exporter}})
    await replica.__init__(args, None, ReplicaPrefixFeed, engine_factory=lambda cfg, lane, replica_id, **_: FakeEngine())
    return replica, backend


def lane_request(carrier: dict[str, str], stream: bool = True) -> LaneRequest:
    return LaneRequest(request_id="cmpl-1", prompt_token_ids=[1, 2, 3, 4], sampling=SamplingOptions(max_tokens=3),
                       request_class=RequestClass.BATCH, priority=10, stream=stream, trace_carrier=carrier)


async def test_lane_replica_traces_lane_generate_with_its_phases(monkeypatch):
    replica, _ = await make_replica(monkeypatch, "memory")
    try:
        chunks = [c async for c in replica.generate(lane_request({"traceparent": TRACEPARENT}))]
        assert len(chunks) == 3
        spans = {span["name"]: span for span in replica.tracing.finished_spans()}
        assert set(spans) == {tr.SPAN_LANE_GENERATE, tr.SPAN_ENGINE_QUEUE, tr.SPAN_PREFILL, tr.SPAN_DECODE}
        root = spans[tr.SPAN_LANE_GENERATE]
        assert root["trace_id"] == "a" * 32 and root["parent_span_id"] == "b" * 16
        assert root["component"] == "ColdLane"
        assert root["attributes"]["llm_lanes.completion_tokens"] == 3
        for phase in (tr.SPAN_ENGINE_QUEUE, tr.SPAN_PREFILL, tr.SPAN_DECODE):
            assert spans[phase]["parent_span_id"] == root["span_id"]
        assert spans[tr.SPAN_ENGINE_QUEUE]["end_time_ns"] <= spans[tr.SPAN_PREFILL]["start_time_ns"]
        assert spans[tr.SPAN_PREFILL]["end_time_ns"] == spans[tr.SPAN_DECODE]["start_time_ns"]
        assert spans[tr.SPAN_DECODE]["end_time_ns"] == root["end_time_ns"]

        # Not streamed: one chunk at the end, so only the engine queue is a phase we can time.
        replica.tracing._memory_exporter.clear()
        [c async for c in replica.generate(lane_request({"traceparent": TRACEPARENT}, stream=False))]
        names = sorted(span["name"] for span in replica.tracing.finished_spans())
        assert names == sorted([tr.SPAN_LANE_GENERATE, tr.SPAN_ENGINE_QUEUE])
    finally:
        replica.__del__()


async def test_lane_replica_marks_an_abandoned_stream_cancelled(monkeypatch):
    replica, _ = await make_replica(monkeypatch, "memory")
    try:
        stream = replica.generate(lane_request({"traceparent": TRACEPARENT}))
        await anext(stream)
        await stream.aclose()
        root = next(s for s in replica.tracing.finished_spans() if s["name"] == tr.SPAN_LANE_GENERATE)
        assert root["attributes"]["llm_lanes.cancelled"] is True and root["status"] == "UNSET"
    finally:
        replica.__del__()


async def test_an_abandoned_stream_leaves_the_engine_before_generate_returns(monkeypatch):
    """The caller's aclose() ends the engine request at once (counted aborted, out of flight), not when the event loop
    finalizes the abandoned inner generator later: a gate's slot must not be free while its request still runs."""
    replica, _ = await make_replica(monkeypatch, "none")
    try:
        stream = replica.generate(lane_request({}))
        await anext(stream)
        assert replica.inflight_by_class["batch"] == 1
        await stream.aclose()
        assert replica.inflight_by_class["batch"] == 0
        assert replica.aborted_by_class["batch"] == 1
    finally:
        replica.__del__()


async def test_a_request_is_counted_served_before_its_last_chunk_goes_out(monkeypatch):
    """The Router gives a request's slot to the next one on its last chunk: by then the replica counts it served."""
    replica, _ = await make_replica(monkeypatch, "none")
    try:
        counts = []
        async for chunk in replica.generate(lane_request({})):
            counts.append((chunk.finish_reason, replica.inflight_by_class["batch"], replica.served_by_class["batch"]))
        assert counts[-1][0] is not None and counts[-1][1:] == (0, 1), counts
        assert all((inflight, served) == (1, 0) for reason, inflight, served in counts if reason is None), counts
        assert replica.served_by_class["batch"] == 1 and replica.aborted_by_class["batch"] == 0
    finally:
        replica.__del__()


async def test_lane_replica_without_tracing_records_nothing_and_publishes_engine_gauges(monkeypatch):
    replica, backend = await make_replica(monkeypatch, "none")
    try:
        assert not replica.tracing.enabled
        [c async for c in replica.generate(lane_request({}))]
        await asyncio.sleep(0)  # the periodic publisher's first round
        replica.engine.queries, replica.engine.hits = 100, 40
        stats = await replica.stats()
        assert stats["kv_cache_usage"] == 0.25
        assert backend.of("llm_lanes_kv_cache_usage")[-1] == (0.25, {"lane": "cold"})
        assert backend.of("llm_lanes_prefix_cache_hit_rate")[-1] == (0.4, {"lane": "cold"})
    finally:
        replica.__del__()
    assert replica._metrics_task.cancelling() or replica._metrics_task.cancelled() or replica._metrics_task.done()


def test_prefix_hit_rate_window_covers_recent_traffic_and_survives_resets():
    from app.lanes.replica import PrefixHitRateWindow

    now = [0.0]
    window = PrefixHitRateWindow(window_s=60, clock=lambda: now[0])
    assert window.update(0, 0) is None  # nothing asked yet
    now[0] = 10
    assert window.update(100, 50) == 0.5
    now[0] = 69
    assert window.update(200, 150) == pytest.approx(150 / 200)  # baseline still the t=0 reading
    now[0] = 80
    # t=10 is now the newest reading at least 60 s old: the window is t=10..80.
    assert window.update(300, 150) == pytest.approx(100 / 200)
    now[0] = 90
    assert window.update(300, 150) == pytest.approx(100 / 200)
    now[0] = 200
    assert window.update(300, 150) is None  # no queries in the last window: leave the gauge alone
    now[0] = 210
    assert window.update(10, 9) == 0.9  # the engine reset its counters


# ---- the vLLM stat loggers ------------------------------------------------------------------------------------------


def _engine(vllm_metrics: bool):
    from app.lanes.engine import VllmEngine

    cfg = load_app_config(cpu_args(observability={"vllm_metrics": vllm_metrics}))
    return VllmEngine(cfg, cfg.hot_lane.engine, "hot", "r1")


def test_stat_loggers_mix_ours_per_engine_with_vllms_ray_logger():
    pytest.importorskip("vllm")
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase, PrometheusStatLogger
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    ours, ray_logger = _engine(True).stat_logger_factories()
    assert ray_logger is RayPrometheusStatLogger
    # StatLoggerManager (vLLM 0.32) builds AggregateStatLoggerBase subclasses once and wraps anything else per
    # engine; a PrometheusStatLogger subclass replaces its default prometheus_client logger.
    assert issubclass(ray_logger, AggregateStatLoggerBase) and issubclass(ray_logger, PrometheusStatLogger)
    assert not issubclass(ours, AggregateStatLoggerBase)
    assert [f.__name__ for f in _engine(False).stat_logger_factories()] == ["LatestSchedulerStats"]
