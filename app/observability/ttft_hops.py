"""Where a streamed request's time to first token goes, hop by hop, from the app's own trace spans.

Built for the realtime target (TTFT p99 <= 50 ms on the H200), where the engine's first step, not the request path,
is most of it (docs/history.md, round 9). This splits the TTFT the Router sees into the hops of that
path, per request class, from the JSON-lines span file the app writes with
`observability.tracing: {exporter: file, file_path: ...}`:

  router_work        request span start -> route span end: parse, tokenize, classify, admit, route (Router)
  hop_to_lane        route end -> lane_generate start: the Serve handle call reaching the lane replica (Ray)
  lane_wait          engine_queue span: the hot replica's realtime gate and KV-headroom waits
  engine_first_token prefill span: vLLM takes the request, schedules it, runs the prefill, returns the first chunk
  hop_back           prefill end -> queue_wait end: the first chunk travelling back to the Router (Ray)
  ttft_at_router     request start -> queue_wait end: the sum, as the Router sees it (the client adds its own
                     HTTP hop on both ends)

All spans come from processes on one host (time.time_ns), so the differences between them are meaningful. A request
handed from the hot lane to the cold lane (decode handoff) has two lane_generate spans; its first token is the
first one's. Non-streamed requests are left out: their first chunk is their whole answer.

The CLI is `python -m load_tests.ttft_breakdown SPANS.jsonl`; `python -m app.tools.doctor --trace-file SPANS.jsonl`
reports the same split as a finding, with what to change for the largest part.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from app.observability.percentile import percentile
from app.observability.tracing import (
    SPAN_ENGINE_QUEUE,
    SPAN_LANE_GENERATE,
    SPAN_PREFILL,
    SPAN_QUEUE_WAIT,
    SPAN_REQUEST,
    SPAN_ROUTE,
)

SEGMENTS = ("router_work", "hop_to_lane", "lane_wait", "engine_first_token", "hop_back", "ttft_at_router")
NS_PER_MS = 1e6


def _first(spans: Iterable[dict[str, Any]], name: str, parent: str | None = None) -> dict[str, Any] | None:
    matching = [s for s in spans if s.get("name") == name and (parent is None or s.get("parent_span_id") == parent)]
    return min(matching, key=lambda s: s["start_time_ns"]) if matching else None


def request_segments(trace: list[dict[str, Any]]) -> tuple[str, dict[str, float], int] | None:
    """(request class, segment -> ms, start in ns) for one trace, or None when it is not a complete streamed
    request."""
    request = _first(trace, SPAN_REQUEST)
    if request is None:
        return None
    route = _first(trace, SPAN_ROUTE, request["span_id"])
    queue_wait = _first(trace, SPAN_QUEUE_WAIT, request["span_id"])
    lane = _first(trace, SPAN_LANE_GENERATE)
    if route is None or queue_wait is None or lane is None or not lane.get("attributes", {}).get("llm_lanes.streamed"):
        return None
    engine_queue = _first(trace, SPAN_ENGINE_QUEUE, lane["span_id"])
    prefill = _first(trace, SPAN_PREFILL, lane["span_id"])
    if engine_queue is None or prefill is None:
        return None
    request_class = request.get("attributes", {}).get("llm_lanes.request_class") or "unknown"
    edges = {
        "router_work": (request["start_time_ns"], route["end_time_ns"]),
        "hop_to_lane": (route["end_time_ns"], lane["start_time_ns"]),
        "lane_wait": (engine_queue["start_time_ns"], engine_queue["end_time_ns"]),
        "engine_first_token": (prefill["start_time_ns"], prefill["end_time_ns"]),
        "hop_back": (prefill["end_time_ns"], queue_wait["end_time_ns"]),
        "ttft_at_router": (request["start_time_ns"], queue_wait["end_time_ns"]),
    }
    return (request_class, {name: (end - start) / NS_PER_MS for name, (start, end) in edges.items()},
            request["start_time_ns"])


def ttft_breakdown(spans: Iterable[dict[str, Any]], since_ns: int | None = None) -> dict[str, dict[str, Any]]:
    """request class -> {"requests": n, segment -> {"p50", "p90", "p99"} in ms}, over the requests that began at or
    after `since_ns` (all when None): the span file also holds the requests sent before the measurement, e.g. the
    GPU campaign's readiness probes on an idle GPU."""
    traces: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        if span.get("trace_id") and span.get("start_time_ns") is not None and span.get("end_time_ns") is not None:
            traces[span["trace_id"]].append(span)
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for trace in traces.values():
        found = request_segments(trace)
        if found is None:
            continue
        request_class, segments, started_ns = found
        if since_ns is not None and started_ns < since_ns:
            continue
        for name, ms in segments.items():
            samples[request_class][name].append(ms)
    return {
        request_class: {"requests": len(by_segment["ttft_at_router"]),
                        **{name: {q: round(percentile(by_segment[name], p), 2)
                                  for q, p in (("p50", 50), ("p90", 90), ("p99", 99))} for name in SEGMENTS}}
        for request_class, by_segment in sorted(samples.items())
    }


def format_breakdown(breakdown: Mapping[str, Mapping[str, Any]]) -> str:
    if not breakdown:
        return "no complete streamed request in the span file (is tracing on, with sample_ratio 1.0?)"
    header = "| class | requests | " + " | ".join(f"{name} p50 / p99 (ms)" for name in SEGMENTS) + " |"
    lines = [header, "|" + "---|" * (len(SEGMENTS) + 2)]
    for request_class, row in breakdown.items():
        cells = " | ".join(f"{row[name]['p50']:.1f} / {row[name]['p99']:.1f}" for name in SEGMENTS)
        lines.append(f"| {request_class} | {row['requests']} | {cells} |")
    return "\n".join(lines)
