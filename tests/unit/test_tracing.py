"""Tracing helpers: spans in separate "processes" join into one trace through the carrier dict."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.observability import tracing as tr


def _memory_tracing(component: str, sample_ratio: float = 1.0) -> tr.Tracing:
    return tr.setup_tracing({"exporter": "memory", "sample_ratio": sample_ratio}, component=component)


def _by_name(spans: list[dict]) -> dict[str, dict]:
    names = [s["name"] for s in spans]
    assert len(names) == len(set(names)), names
    return {s["name"]: s for s in spans}


def test_none_exporter_is_a_no_op():
    tracing = tr.setup_tracing(None)
    assert not tracing.enabled
    with tracing.span(tr.SPAN_CLASSIFY) as span:
        assert span is trace.INVALID_SPAN and not span.is_recording()
    assert tracing.start_span(tr.SPAN_DECODE) is trace.INVALID_SPAN
    assert tracing.inject() == {}
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    tracing.record_engine_phases(arrival_ns=1, scheduled_ns=2, first_token_ns=3, finished_ns=4)
    assert tracing.finished_spans() == []


def test_settings_validation():
    assert not tr.setup_tracing({}).enabled
    for bad, message in (({"exporter": "jaeger"}, "exporter"), ({"exporter": "otlp"}, "otlp_endpoint"),
                         ({"exporter": "file"}, "file_path"), ({"sample_ratio": 1.5}, "sample_ratio")):
        with pytest.raises(ValueError, match=message):
            tr.setup_tracing(bad)
    otlp = tr.setup_tracing({"exporter": "otlp", "otlp_endpoint": "http://127.0.0.1:4318/v1/traces"})
    assert otlp.enabled
    otlp.shutdown()  # nothing was recorded, so nothing is sent


def test_one_trace_across_router_prefix_cache_and_lane():
    router = _memory_tracing("Router")
    prefix_cache = _memory_tracing("PrefixCache")
    lane = _memory_tracing("HotLane")

    client_traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    incoming = router.extract({"traceparent": client_traceparent})

    with router.span(tr.SPAN_REQUEST, context=incoming, kind=trace.SpanKind.SERVER):
        with router.span(tr.SPAN_CLASSIFY):
            pass
        with router.span(tr.SPAN_ADMIT):
            with router.span(tr.SPAN_QUEUE_WAIT):
                pass
        with router.span(tr.SPAN_ROUTE):
            lookup_request = {"block_hashes": [1, 2], tr.TRACE_CONTEXT_FIELD: router.inject()}
            # ... PrefixCache replica, another process:
            incoming_lookup = prefix_cache.extract(lookup_request[tr.TRACE_CONTEXT_FIELD])
            with prefix_cache.span(tr.SPAN_PREFIX_LOOKUP, context=incoming_lookup):
                pass
        lane_request = {"prompt_token_ids": [1, 2, 3], tr.TRACE_CONTEXT_FIELD: router.inject()}

    # ... lane replica, another process, possibly after the Router's span closed (streaming):
    generate = lane.start_span(tr.SPAN_LANE_GENERATE, context=lane.extract(lane_request[tr.TRACE_CONTEXT_FIELD]))
    now = time.time_ns()
    lane.record_engine_phases(
        arrival_ns=now,
        scheduled_ns=now + 1_000,
        first_token_ns=now + 5_000,
        finished_ns=now + 9_000,
        context=tr.Tracing.context_with(generate),
        attributes={"lane": "hot"},
    )
    generate.end()

    router_spans = _by_name(router.finished_spans())
    cache_spans = _by_name(prefix_cache.finished_spans())
    lane_spans = _by_name(lane.finished_spans())
    all_spans = [*router_spans.values(), *cache_spans.values(), *lane_spans.values()]

    assert {s["trace_id"] for s in all_spans} == {"0af7651916cd43dd8448eb211c80319c"}
    assert router_spans["request"]["parent_span_id"] == "b7ad6b7169203331"
    request_id = router_spans["request"]["span_id"]
    for name in ("classify", "admit", "route"):
        assert router_spans[name]["parent_span_id"] == request_id
    assert router_spans["queue_wait"]["parent_span_id"] == router_spans["admit"]["span_id"]
    assert cache_spans["prefix_lookup"]["parent_span_id"] == router_spans["route"]["span_id"]
    assert cache_spans["prefix_lookup"]["component"] == "PrefixCache"
    # The lane carrier was injected inside `request` (after `route` closed), so the lane hangs off `request`.
    assert lane_spans["lane_generate"]["parent_span_id"] == request_id
    for name in ("engine_queue", "prefill", "decode"):
        assert lane_spans[name]["parent_span_id"] == lane_spans["lane_generate"]["span_id"]
        assert lane_spans[name]["attributes"] == {"lane": "hot"}
    assert lane_spans["prefill"]["start_time_ns"] == lane_spans["engine_queue"]["end_time_ns"] == now + 1_000
    assert lane_spans["decode"]["end_time_ns"] - lane_spans["decode"]["start_time_ns"] == 4_000


def test_new_trace_when_nothing_comes_in_and_grpc_metadata_is_accepted():
    router = _memory_tracing("Router")
    assert router.extract({}) is None
    with router.span(tr.SPAN_REQUEST, context=router.extract(None)):
        carrier = router.inject()
    assert carrier["traceparent"].startswith("00-")
    root = router.finished_spans()[0]
    assert root["parent_span_id"] is None and carrier["traceparent"].split("-")[1] == root["trace_id"]

    metadata = [("application", "llm-lanes"), ("traceparent", carrier["traceparent"]), ("x-bin", b"\x00")]
    lane = _memory_tracing("HotLane")
    with lane.span(tr.SPAN_LANE_GENERATE, context=lane.extract(tr.carrier_from_grpc_metadata(metadata))):
        pass
    assert lane.finished_spans()[0]["trace_id"] == root["trace_id"]
    assert lane.finished_spans()[0]["parent_span_id"] == root["span_id"]


def test_downstream_follows_the_routers_sampling_decision():
    router = _memory_tracing("Router", sample_ratio=0.0)
    lane = _memory_tracing("HotLane", sample_ratio=1.0)
    with router.span(tr.SPAN_REQUEST) as span:
        assert not span.is_recording()
        carrier = router.inject()
    # Propagated with the sampled bit (0x01) clear; OpenTelemetry may set the W3C "random" bit (0x02).
    assert int(carrier["traceparent"].rsplit("-", 1)[1], 16) & 0x01 == 0
    with lane.span(tr.SPAN_LANE_GENERATE, context=lane.extract(carrier)):
        pass
    assert router.finished_spans() == [] and lane.finished_spans() == []


def test_aborted_request_leaves_out_phases_it_never_reached():
    lane = _memory_tracing("ColdLane")
    lane.record_engine_phases(arrival_ns=10, scheduled_ns=None, first_token_ns=None, finished_ns=20)
    assert lane.finished_spans() == []
    lane.record_engine_phases(arrival_ns=10, scheduled_ns=12, first_token_ns=None, finished_ns=20)
    assert [s["name"] for s in lane.finished_spans()] == ["engine_queue"]


def test_exception_in_span_is_recorded_and_raised():
    tracing = _memory_tracing("Router")
    with pytest.raises(RuntimeError):
        with tracing.span(tr.SPAN_ADMIT):
            raise RuntimeError("queue full")
    assert tracing.finished_spans()[0]["status"] == "ERROR"


def test_explicit_exporter_override():
    exporter = InMemorySpanExporter()
    tracing = tr.setup_tracing(None, exporter=exporter)
    with tracing.span(tr.SPAN_ROUTE):
        pass
    assert [s.name for s in exporter.get_finished_spans()] == ["route"]


def test_file_exporter_joins_a_real_second_process(tmp_path):
    span_file = tmp_path / "spans.jsonl"
    router = tr.setup_tracing({"exporter": "file", "file_path": str(span_file)}, component="Router")
    with router.span(tr.SPAN_REQUEST):
        with router.span(tr.SPAN_ROUTE):
            carrier = router.inject()

    child = textwrap.dedent(
        """
        import json, sys
        from app.observability import tracing as tr
        lane = tr.setup_tracing({"exporter": "file", "file_path": sys.argv[1]}, component="HotLane")
        with lane.span(tr.SPAN_LANE_GENERATE, context=lane.extract(json.loads(sys.argv[2]))):
            with lane.span(tr.SPAN_DECODE):
                pass
        lane.shutdown()
        """
    )
    subprocess.run([sys.executable, "-c", child, str(span_file), tr.json.dumps(carrier)], check=True, timeout=60)

    spans = _by_name(tr.read_span_file(str(span_file)))
    assert set(spans) == {"request", "route", "lane_generate", "decode"}
    assert len({s["trace_id"] for s in spans.values()}) == 1
    assert spans["lane_generate"]["parent_span_id"] == spans["route"]["span_id"]
    assert spans["lane_generate"]["component"] == "HotLane"
    assert spans["decode"]["parent_span_id"] == spans["lane_generate"]["span_id"]
