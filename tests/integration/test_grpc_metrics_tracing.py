"""gRPC through Ray Serve's proxy, metrics on Ray's metrics export port, and (when the app runs with the file span
exporter) one trace per request across Router and lane replica -- against the real app (real Serve, real vLLM).

The session app listens for gRPC on GRPC_PORT (the conftest rewrites grpc_options.port of serve_configs/local.yaml,
whose grpc_servicer_functions name the LlmLanes and grpc.health.v1 servicers).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.proto.llm_lanes.v1 import llm_lanes_pb2 as pb
from app.proto.llm_lanes.v1 import llm_lanes_pb2_grpc as pb_grpc
from app.router.arrival_stamp import ARRIVAL_HEADER
from tests.integration import conftest
from tests.integration.conftest import GRPC_PORT, wait_until

APPLICATION = (("application", "llm-lanes"),)
RPC_TIMEOUT_S = 120
# Ray exports application metrics every few seconds (its report interval); give it room on a busy 2-core machine.
METRICS_EXPORT_TIMEOUT_S = 90
RAY_SESSION = Path("/tmp/ray/session_latest")


@pytest.fixture(scope="module")
def channel(app_url):
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as ch:
        grpc.channel_ready_future(ch).result(timeout=60)
        yield ch


@pytest.fixture(scope="module")
def stub(channel) -> pb_grpc.LlmLanesStub:
    return pb_grpc.LlmLanesStub(channel)


def completion(model: str, prompt: str = "tell me about lanes", max_tokens: int = 8, **fields) -> pb.CompletionRequest:
    return pb.CompletionRequest(model=model, prompt=prompt,
                                sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0), **fields)


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


# ---- gRPC ---------------------------------------------------------------------------------------------------------


def test_grpc_complete_unary(stub, served_model):
    reply = stub.Complete(completion(served_model), metadata=APPLICATION, timeout=RPC_TIMEOUT_S)
    assert reply.id.startswith("cmpl-") and reply.model == served_model
    assert reply.text and reply.finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= 8
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.serving.lane == "hot"
    assert reply.serving.request_class == pb.REQUEST_CLASS_INTERACTIVE


def test_grpc_generate_streams(stub, served_model):
    chunks = list(stub.Generate(completion(served_model, max_tokens=24, service_tier="priority"),
                                metadata=APPLICATION, timeout=RPC_TIMEOUT_S))
    if chunks[-1].finish_reason == "length":
        assert len(chunks) >= 2, "a 24-token answer comes in more than one chunk"
    assert chunks[0].serving.lane == "hot"
    assert chunks[0].serving.request_class == pb.REQUEST_CLASS_REALTIME
    assert chunks[-1].finish_reason in ("stop", "length")
    assert all(not c.finish_reason for c in chunks[:-1])
    last_usage = chunks[-1].usage
    assert last_usage.completion_tokens == sum(c.num_tokens for c in chunks) > 0
    assert len({c.id for c in chunks}) == 1


def test_grpc_chat_complete_and_stream(stub, served_model):
    request = pb.ChatCompletionRequest(model=served_model, messages=[pb.ChatMessage(role="user", content="Say hi")],
                                       sampling=pb.SamplingParams(max_tokens=12, temperature=0.0))
    reply = stub.ChatComplete(request, metadata=APPLICATION, timeout=RPC_TIMEOUT_S)
    assert reply.id.startswith("chatcmpl-")
    assert reply.message.role == "assistant" and reply.message.content
    assert reply.usage.completion_tokens > 0 and reply.serving.lane == "hot"

    chunks = list(stub.ChatCompleteStream(request, metadata=APPLICATION, timeout=RPC_TIMEOUT_S))
    assert chunks[0].role == "assistant" and chunks[0].serving.lane == "hot"
    assert all(c.role == "" for c in chunks[1:])
    assert "".join(c.content for c in chunks)
    assert chunks[-1].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == sum(c.num_tokens for c in chunks) > 0


def test_grpc_request_class_is_honoured(stub, served_model):
    batch = stub.Complete(completion(served_model, request_class=pb.REQUEST_CLASS_BATCH), metadata=APPLICATION,
                          timeout=RPC_TIMEOUT_S)
    assert batch.serving.lane == "cold"
    assert batch.serving.request_class == pb.REQUEST_CLASS_BATCH
    flex = stub.Complete(completion(served_model, service_tier="flex"), metadata=APPLICATION, timeout=RPC_TIMEOUT_S)
    assert flex.serving.lane == "cold"
    # The enum wins over service_tier, as X-Request-Class wins on HTTP.
    realtime = stub.Complete(completion(served_model, service_tier="flex", request_class=pb.REQUEST_CLASS_REALTIME),
                             metadata=APPLICATION, timeout=RPC_TIMEOUT_S)
    assert realtime.serving.lane == "hot" and realtime.serving.request_class == pb.REQUEST_CLASS_REALTIME


def test_grpc_empty_prompt_is_invalid_argument(stub, served_model):
    error = rpc_error(lambda: stub.Complete(completion(served_model, prompt=""), metadata=APPLICATION,
                                            timeout=RPC_TIMEOUT_S))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "must be provided and non-empty" in error.details()  # vLLM's own refusal
    trailing = dict(error.trailing_metadata() or ())
    assert trailing.get("http-status") == "400"
    assert trailing.get("error-code") == "invalid_value"


def test_grpc_unknown_model_is_not_found(stub):
    error = rpc_error(lambda: stub.Complete(completion("no-such-model"), metadata=APPLICATION,
                                            timeout=RPC_TIMEOUT_S))
    assert error.code() is grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in error.details()
    assert dict(error.trailing_metadata() or ()).get("http-status") == "404"


def test_grpc_streaming_error_keeps_its_code(stub):
    # Streaming RPCs raise after setting the code: Serve keeps code and details (not the trailing metadata).
    error = rpc_error(lambda: list(stub.Generate(completion("no-such-model"), metadata=APPLICATION,
                                                 timeout=RPC_TIMEOUT_S)))
    assert error.code() is grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in error.details()


def test_grpc_get_stats(stub):
    reply = stub.GetStats(pb.GetStatsRequest(), metadata=APPLICATION, timeout=30)
    stats = reply.stats
    assert set(stats["lanes"].keys()) == {"hot", "cold"}
    assert stats["lanes"]["hot"][0]["lane"] == "hot"
    assert stats["lanes"]["cold"][0]["running"] >= 0
    assert set(stats["router"]["breakers"].keys()) == {"hot", "cold"}


def test_grpc_batch_submit_and_get(stub, served_model):
    line = {"custom_id": "grpc-1", "method": "POST", "url": "/v1/completions",
            "body": {"model": served_model, "prompt": "batch over grpc", "max_tokens": 4}}
    batch = stub.SubmitBatch(pb.SubmitBatchRequest(input_content=(json.dumps(line) + "\n").encode(),
                                                   endpoint="/v1/completions", metadata={"via": "grpc"}),
                             metadata=APPLICATION, timeout=30)
    assert batch.id and batch.request_counts.total == 1 and batch.metadata["via"] == "grpc"

    def finished():
        reply = stub.GetBatch(pb.GetBatchRequest(batch_id=batch.id, include_output=True), metadata=APPLICATION,
                              timeout=30)
        return reply if reply.batch.status in ("completed", "failed") else None

    reply = wait_until(finished, timeout_s=180, interval_s=1)
    assert reply, "the batch did not finish within 180 s"
    assert reply.batch.status == "completed" and reply.batch.request_counts.completed == 1
    [output] = [json.loads(x) for x in reply.output_content.decode().splitlines()]
    assert output["custom_id"] == "grpc-1" and output["response"]["status_code"] == 200

    missing = rpc_error(lambda: stub.GetBatch(pb.GetBatchRequest(batch_id="batch_missing"), metadata=APPLICATION,
                                              timeout=30))
    assert missing.code() is grpc.StatusCode.NOT_FOUND


def test_serve_proxy_healthz(channel):
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    reply = serve_pb2_grpc.RayServeAPIServiceStub(channel).Healthz(serve_pb2.HealthzRequest(), timeout=30)
    assert reply.message == "success"


def test_grpc_standard_health_check(channel):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)

    def serving():
        reply = health.Check(health_pb2.HealthCheckRequest(service="llm_lanes.v1.LlmLanes"), metadata=APPLICATION,
                             timeout=30)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    # Another test may have opened a lane's breaker on purpose; it closes after its cooldown.
    assert wait_until(serving, timeout_s=30, interval_s=1)
    # Without application metadata: the only application answers (what grpc_health_probe sends).
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=30).status == health_pb2.HealthCheckResponse.SERVING
    unknown = rpc_error(lambda: health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"),
                                             metadata=APPLICATION, timeout=30))
    assert unknown.code() is grpc.StatusCode.NOT_FOUND
    watch = health.Watch(health_pb2.HealthCheckRequest(), metadata=APPLICATION, timeout=30)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


# ---- metrics ------------------------------------------------------------------------------------------------------


def metrics_targets() -> list[str]:
    """host:port of every metrics endpoint of the app's Ray session (the file Prometheus' discovery reads)."""
    discovery = RAY_SESSION / "prom_metrics_service_discovery.json"
    if discovery.exists():
        targets = [t for group in json.loads(discovery.read_text()) for t in group["targets"]]
        if targets:
            return targets
    return [f"127.0.0.1:{p.read_text().strip()}" for p in RAY_SESSION.glob("metrics_export_port_*")]


def scrape() -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for target in metrics_targets():
        try:
            text = httpx.get(f"http://{target}/metrics", timeout=10).text
        except httpx.HTTPError:
            continue
        for family in text_string_to_metric_families(text):
            samples.extend((s.name, dict(s.labels), s.value) for s in family.samples)
    return samples


def named(samples, name: str) -> list[tuple[dict[str, str], float]]:
    return [(labels, value) for sample_name, labels, value in samples if sample_name == name]


def test_metrics_are_exported_with_lane_and_class_labels(app_url, served_model):
    assert metrics_targets(), f"no metrics export address under {RAY_SESSION}"
    with httpx.Client(timeout=120) as client:
        for tier in ("auto", "priority", "flex"):
            body = {"model": served_model, "prompt": "metrics please", "max_tokens": 16, "stream": True,
                    "service_tier": tier}
            with client.stream("POST", f"{app_url}/v1/completions", json=body) as response:
                assert response.status_code == 200
                assert sum(1 for line in response.iter_lines() if line.startswith("data: ")) >= 2
        bad = client.post(f"{app_url}/v1/completions", json={"model": "no-such-model", "prompt": "x"})
        assert bad.status_code == 404

    wanted = {("hot", "interactive"), ("hot", "realtime"), ("cold", "batch")}

    def exported():
        samples = scrape()
        ttft = {(labels.get("lane"), labels.get("request_class"))
                for labels, value in named(samples, "ray_llm_lanes_ttft_seconds_count") if value > 0}
        outcomes = {labels.get("outcome") for labels, value in named(samples, "ray_llm_lanes_requests_total")
                    if value > 0}
        kv_lanes = {labels.get("lane") for labels, _ in named(samples, "ray_llm_lanes_kv_cache_usage")}
        ok = wanted <= ttft and {"success", "error"} <= outcomes and kv_lanes >= {"hot", "cold"}
        return samples if ok else None

    samples = wait_until(exported, timeout_s=METRICS_EXPORT_TIMEOUT_S, interval_s=3)
    if not samples:
        present = sorted({name for name, _, _ in scrape() if "llm_lanes" in name or "vllm" in name})
        pytest.fail(f"llm-lanes metrics not exported within {METRICS_EXPORT_TIMEOUT_S} s; present: {present}")

    ttft_buckets = named(samples, "ray_llm_lanes_ttft_seconds_bucket")
    assert any(float(labels["le"]) == 0.45 for labels, _ in ttft_buckets), "the 450 ms goal is a bucket boundary"
    for labels, _ in ttft_buckets:
        assert labels["deployment"] == "Router" and labels["application"] == "llm-lanes"
    requests = named(samples, "ray_llm_lanes_requests_total")
    assert any(labels["outcome"] == "error" and labels["status"] == "404" and labels["lane"] == "none"
               for labels, value in requests if value > 0)
    assert any(labels["outcome"] == "success" and labels["status"] == "200" and labels["lane"] == "cold"
               and labels["request_class"] == "batch" for labels, value in requests if value > 0)
    e2e = {(labels["lane"], labels["request_class"]) for labels, value in named(samples,
                                                                               "ray_llm_lanes_e2e_seconds_count")
           if value > 0}
    assert wanted <= e2e
    assert sum(value for _, value in named(samples, "ray_llm_lanes_output_tokens_total")) > 0
    assert sum(value for _, value in named(samples, "ray_llm_lanes_router_decision_seconds_count")) > 0
    admissions = named(samples, "ray_llm_lanes_admission_decisions_total")
    assert any(labels["decision"] == "admit" for labels, value in admissions if value > 0)
    assert {labels["request_class"] for labels, _ in named(samples, "ray_llm_lanes_queue_depth")} >= {
        "realtime", "interactive", "batch"}
    for labels, value in named(samples, "ray_llm_lanes_kv_cache_usage"):
        assert 0.0 <= value <= 1.0 and labels["deployment"] in ("HotLane", "ColdLane")


def test_vllm_engine_metrics_are_exported(app_url, served_model):
    httpx.post(f"{app_url}/v1/completions", json={"model": served_model, "prompt": "vllm metrics", "max_tokens": 8},
               timeout=120).raise_for_status()

    gauges = {"ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting", "ray_vllm_kv_cache_usage_perc"}
    seen: set[str] = set()

    def exported():
        samples = scrape()
        vllm = [(name, labels, value) for name, labels, value in samples if name.startswith("ray_vllm_")]
        seen.update(name for name, _, _ in vllm)
        generated = [value for labels, value in named(samples, "ray_vllm_generation_tokens_total")
                     if labels.get("model_name") == served_model]
        # Counters and gauges reach Ray's metrics port on the exporter's own schedule: wait for both.
        return vllm if sum(generated) > 0 and gauges <= {name for name, _, _ in vllm} else None

    vllm = wait_until(exported, timeout_s=METRICS_EXPORT_TIMEOUT_S, interval_s=3)
    assert vllm, (f"no ray_vllm_* metrics with generated tokens and the engine's gauges {sorted(gauges)}: is "
                  f"observability.vllm_metrics on? seen: {sorted(seen)}")
    names = {name for name, _, _ in vllm}
    assert gauges <= names
    assert "ray_vllm_time_to_first_token_seconds_count" in names
    # One series per lane replica: vLLM's ReplicaId is Serve's replica id.
    replica_ids = {labels.get("ReplicaId") for name, labels, _ in vllm if name == "ray_vllm_num_requests_running"}
    assert len(replica_ids) >= 2 and "" not in replica_ids


# ---- tracing (active when the session app writes spans to conftest.SPAN_FILE) --------------------------------------


def test_one_trace_spans_router_and_lane(app_url, served_model):
    span_file = getattr(conftest, "SPAN_FILE", None)
    if span_file is None:
        pytest.skip("the session app runs without tracing (set conftest.SPAN_FILE and the file exporter to run)")
    from app.observability.tracing import read_span_file

    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    traceparent = f"00-{trace_id}-00f067aa0ba902b7-01"
    # A client's own arrival stamp (a day old) is replaced by the proxy's (app/router/arrival_stamp.py).
    response = httpx.post(f"{app_url}/v1/completions",
                          headers={"traceparent": traceparent, ARRIVAL_HEADER: str(time.time() - 86400)},
                          json={"model": served_model, "prompt": "trace me", "max_tokens": 8, "stream": True},
                          timeout=120)
    assert response.status_code == 200

    def spans_of_trace():
        if not Path(span_file).exists():
            return None
        spans = [s for s in read_span_file(str(span_file)) if s["trace_id"] == trace_id]
        return spans if {"request", "lane_generate", "decode"} <= {s["name"] for s in spans} else None

    spans = wait_until(spans_of_trace, timeout_s=30, interval_s=0.5)
    assert spans, "the request's spans did not reach the span file"
    by_name = {s["name"]: s for s in spans}
    request = by_name["request"]
    assert request["parent_span_id"] == "00f067aa0ba902b7" and request["component"] == "Router"
    assert 0 < request["attributes"]["llm_lanes.proxy_wait_s"] < 5, request["attributes"]
    for name in ("classify", "admit", "route", "queue_wait"):
        assert by_name[name]["parent_span_id"] == request["span_id"], name
    lane = by_name["lane_generate"]
    assert lane["parent_span_id"] == request["span_id"] and lane["component"] == "HotLane"
    for name in ("engine_queue", "prefill", "decode"):
        assert by_name[name]["parent_span_id"] == lane["span_id"], name
    assert by_name["prefill"]["end_time_ns"] <= by_name["decode"]["end_time_ns"]
    # One host, one wall clock: the lane starts inside the request (its end races the Router's last chunk).
    assert request["start_time_ns"] <= lane["start_time_ns"] <= request["end_time_ns"]
    # load_tests.ttft_breakdown splits this request's time to first token into hops that add up to it.
    from load_tests.ttft_breakdown import SEGMENTS, request_segments

    request_class, hops, _ = request_segments(spans)
    assert request_class == "interactive"
    parts = [hops[name] for name in SEGMENTS if name != "ttft_at_router"]
    assert all(part >= 0 for part in parts), hops
    assert sum(parts) == pytest.approx(hops["ttft_at_router"], abs=0.01)
