"""Flow 3 of the doctor, long tail: the realtime reserve, p99 vs p50, where the p99 time goes, the slowest traces,
TTFT by hop, and how to profile."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from app.classes import RequestClass
from app.observability.tracing import (
    SPAN_DECODE, SPAN_ENGINE_QUEUE, SPAN_PREFILL, SPAN_PREFIX_LOOKUP, SPAN_QUEUE_WAIT, SPAN_REQUEST, SPAN_ROUTE,
)
from app.tools.doctor.model import (
    CLASS_HOME_LANE, FLOW_LONG_TAIL, M_E2E, M_QUEUE_WAIT, M_TTFT, OK, PROBLEM, UNKNOWN_LANE, V_DECODE_TIME,
    V_PREFILL_TIME, V_QUEUE_TIME, WARN, DoctorInputs, Finding, TraceSummary, _lane_key, _n, _s, _worst, histograms,
)
from app.tools.doctor.thresholds import (
    E2E_TAIL_RATIO_WARN, MIN_SAMPLES_FOR_TAIL, PATH_SHARE_WARN, SLOW_TRACE_RATIO_WARN, TTFT_TAIL_RATIO_PROBLEM,
    TTFT_TAIL_RATIO_WARN,
)


def check_realtime_reserve(inputs: DoctorInputs) -> list[Finding]:
    """With hot replicas kept for realtime (admission.realtime_reserved_hot_replicas): did requests stay on their own
    side? A crossing means one side had no replica that could take a request: full, or down."""
    preferred = inputs.reserve_routing.get("preferred", 0)
    fallback = inputs.reserve_routing.get("fallback", 0)
    total = preferred + fallback
    if not total:
        return []
    numbers = {"preferred": preferred, "fallback": fallback}
    if fallback:
        return [Finding(
            FLOW_LONG_TAIL, "realtime reserve", "hot", WARN,
            f"{_n(fallback)} of {_n(total)} hot-lane routings crossed the realtime reserve",
            f"preferred {_n(preferred)}, fallback {_n(fallback)} (one Router replica's count since it started)",
            "one side of the hot lane had no replica that could take a request: a reserved or an interactive replica "
            "is down (see the replica findings) or full (max_ongoing_requests); raise hot_lane.deployment."
            "num_replicas, or admission.realtime_reserved_hot_replicas for realtime load", numbers)]
    return [Finding(FLOW_LONG_TAIL, "realtime reserve", "hot", OK, "realtime reserve held",
                    f"{_n(total)} hot-lane routings, none crossed the reserve", "", numbers)]


def check_latency_tails(inputs: DoctorInputs) -> list[Finding]:
    """p99/p50 of TTFT and E2E per lane and class, and realtime TTFT p99 against the guide's 450 ms goal."""
    if inputs.metrics is None or not inputs.metrics.has(M_TTFT + "_bucket"):
        return []

    def key(labels: Mapping[str, str]) -> tuple[str, str] | None:
        lane = labels.get("lane", UNKNOWN_LANE)
        return None if lane == "none" else (lane, labels.get("request_class", "?"))

    ttft = histograms(inputs.metrics, M_TTFT, key)
    e2e = histograms(inputs.metrics, M_E2E, key)
    findings = []
    for lane, request_class in sorted(ttft):
        hist = ttft[(lane, request_class)]
        subject = f"{lane}/{request_class}"
        if hist.count < MIN_SAMPLES_FOR_TAIL:
            inputs.notes.append(f"tail of {subject} not judged: {_n(hist.count)} requests (< {MIN_SAMPLES_FOR_TAIL})")
            continue
        t50, t99 = hist.quantile(0.5), hist.quantile(0.99)
        t_ratio = t99 / t50 if t50 and t99 else None
        evidence = f"n={_n(hist.count)}: TTFT p50 {_s(t50)}, p99 {_s(t99)}" + (
            f" (x{t_ratio:.1f})" if t_ratio else "")
        data: dict[str, Any] = {"requests": hist.count, "ttft_p50_s": t50, "ttft_p99_s": t99, "ttft_ratio": t_ratio}
        e_hist = e2e.get((lane, request_class))
        e_ratio = None
        if e_hist is not None and e_hist.count >= MIN_SAMPLES_FOR_TAIL:
            e50, e99 = e_hist.quantile(0.5), e_hist.quantile(0.99)
            e_ratio = e99 / e50 if e50 and e99 else None
            evidence += f"; E2E p50 {_s(e50)}, p99 {_s(e99)}" + (f" (x{e_ratio:.1f})" if e_ratio else "")
            data.update(e2e_p50_s=e50, e2e_p99_s=e99, e2e_ratio=e_ratio)
        problems: list[tuple[str, str]] = []
        if request_class == RequestClass.REALTIME.value and t99 is not None and t99 > inputs.realtime_ttft_p99_goal_s:
            problems.append((PROBLEM, f"realtime TTFT p99 {_s(t99)} above the {_s(inputs.realtime_ttft_p99_goal_s)} "
                                      "goal"))
        if t_ratio and t_ratio >= TTFT_TAIL_RATIO_PROBLEM:
            problems.append((PROBLEM, f"TTFT p99 is {t_ratio:.0f}x its median"))
        elif t_ratio and t_ratio >= TTFT_TAIL_RATIO_WARN:
            problems.append((WARN, f"TTFT p99 is {t_ratio:.0f}x its median"))
        if e_ratio and e_ratio >= E2E_TAIL_RATIO_WARN:
            problems.append((WARN, f"E2E p99 is {e_ratio:.0f}x its median"))
        if not problems:
            findings.append(Finding(FLOW_LONG_TAIL, "latency tail", subject, OK, "tail within bounds", evidence,
                                    "", data))
            continue
        findings.append(Finding(
            FLOW_LONG_TAIL, "latency tail", subject, _worst(s for s, _ in problems),
            "; ".join(text for _, text in problems), evidence,
            "see where the p99 time goes (next finding) and the slowest traces; a TTFT tail is queueing or long "
            "prefills in front of the request, an E2E-only tail is long generations or slow decode steps "
            "(profile with nsys, below)",
            data,
        ))
    return findings


PHASE_ACTIONS = {
    "admission queue": "requests wait in the Router's admission queue: the lane is at capacity; add replicas or "
                       "let interactive traffic spill earlier (admission.interactive_ttft_slo_s)",
    "engine queue": "requests wait inside vLLM for a slot: see the engine-stats and KV-pressure findings "
                    "(max_num_seqs or KV cache)",
    "prefill": "prefill dominates: long prompts; check the long-context findings and max_num_batched_tokens",
    "decode": "decode dominates: long generations or slow steps at high batch; compare TPOT across lanes and "
              "profile a decode step with nsys",
}


def check_tail_breakdown(inputs: DoctorInputs) -> list[Finding]:
    """Where the p99 time goes per lane: admission queue (ours) and vLLM's queue / prefill / decode histograms."""
    if inputs.metrics is None:
        return []
    key = _lane_key(inputs)
    phases: dict[str, dict[str, float | None]] = defaultdict(dict)
    for phase, name in (("engine queue", V_QUEUE_TIME), ("prefill", V_PREFILL_TIME), ("decode", V_DECODE_TIME)):
        for lane, hist in histograms(inputs.metrics, name, key).items():
            if hist.count >= MIN_SAMPLES_FOR_TAIL:
                phases[lane][phase] = hist.quantile(0.99)
    # The admission queue is per class: realtime/interactive wait for the hot lane, batch for the cold one.
    queue_waits = histograms(inputs.metrics, M_QUEUE_WAIT, lambda labels: labels.get("request_class", "?"))
    for request_class, hist in queue_waits.items():
        lane = CLASS_HOME_LANE.get(request_class)
        if lane and hist.count >= MIN_SAMPLES_FOR_TAIL:
            p99 = hist.quantile(0.99)
            previous = phases[lane].get("admission queue")
            phases[lane]["admission queue"] = p99 if previous is None else max(previous, p99 or 0.0)
    findings = []
    for lane, by_phase in sorted(phases.items()):
        known = {k: v for k, v in by_phase.items() if v is not None}
        if not known:
            continue
        dominant = max(known, key=known.get)
        findings.append(Finding(
            FLOW_LONG_TAIL, "where the p99 time goes", lane, OK, f"the largest p99 phase is {dominant}",
            ", ".join(f"{phase} p99 {_s(v)}" for phase, v in known.items()),
            PHASE_ACTIONS[dominant], {"p99_s": known, "dominant": dominant},
        ))
    return findings


TRACE_PHASES = (SPAN_QUEUE_WAIT, SPAN_ROUTE, SPAN_PREFIX_LOOKUP, SPAN_ENGINE_QUEUE, SPAN_PREFILL, SPAN_DECODE)
_LANE_ATTRIBUTES = ("lane", "llm_lanes.lane")
_CLASS_ATTRIBUTES = ("request_class", "llm_lanes.request_class")


def summarize_traces(spans: list[dict[str, Any]]) -> list[TraceSummary]:
    """One summary per trace (span dicts as app.observability.tracing.span_to_dict writes them), slowest first.
    The root is the `request` span, else the span without a parent in the trace."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        if span.get("trace_id") and span.get("start_time_ns") is not None and span.get("end_time_ns") is not None:
            by_trace[span["trace_id"]].append(span)
    summaries = []
    for trace_id, members in by_trace.items():
        ids = {s.get("span_id") for s in members}
        roots = [s for s in members if s.get("name") == SPAN_REQUEST] or [
            s for s in members if s.get("parent_span_id") not in ids
        ]
        root = max(roots, key=lambda s: s["end_time_ns"] - s["start_time_ns"])
        phases: dict[str, float] = defaultdict(float)
        lane = request_class = None
        for s in members:
            if s.get("name") in TRACE_PHASES:
                phases[s["name"]] += (s["end_time_ns"] - s["start_time_ns"]) / 1e9
            attributes = s.get("attributes") or {}
            lane = lane or next((attributes[k] for k in _LANE_ATTRIBUTES if attributes.get(k)), None)
            request_class = request_class or next((attributes[k] for k in _CLASS_ATTRIBUTES if attributes.get(k)),
                                                  None)
        summaries.append(TraceSummary(trace_id, (root["end_time_ns"] - root["start_time_ns"]) / 1e9,
                                      root.get("name", "?"), lane, request_class, dict(phases)))
    return sorted(summaries, key=lambda t: t.duration_s, reverse=True)


_TRACE_PHASE_TO_ACTION = {SPAN_QUEUE_WAIT: "admission queue", SPAN_ENGINE_QUEUE: "engine queue",
                          SPAN_PREFILL: "prefill", SPAN_DECODE: "decode"}


def check_slowest_traces(inputs: DoctorInputs) -> list[Finding]:
    if inputs.spans is None:
        return []
    traces = summarize_traces(inputs.spans)
    if not traces:
        inputs.notes.append("trace file has no complete spans: slowest traces not listed")
        return []
    durations = sorted(t.duration_s for t in traces)
    median = durations[len(durations) // 2]
    slowest = traces[: inputs.slowest_traces]
    lines = []
    for t in slowest:
        phase_text = ", ".join(f"{p} {_s(v)}" for p, v in sorted(t.phases_s.items(), key=lambda kv: -kv[1]))
        who = "/".join(x for x in (t.lane, t.request_class) if x) or "-"
        lines.append(f"{t.trace_id} {_s(t.duration_s)} [{who}]" + (f" {phase_text}" if phase_text else ""))
    evidence = f"{len(traces)} traces, median {_s(median)}; slowest: " + "; ".join(lines)
    top = slowest[0]
    data = {"traces": len(traces), "median_s": median,
            "slowest": [asdict(t) | {"dominant_phase": t.dominant_phase} for t in slowest]}
    phase = _TRACE_PHASE_TO_ACTION.get(top.dominant_phase or "")
    action = (f"the slowest request spent most time in {top.dominant_phase}: " + PHASE_ACTIONS[phase]) if phase else (
        "open the slowest trace in your trace viewer (trace id above) to see which span is long")
    if median > 0 and top.duration_s >= SLOW_TRACE_RATIO_WARN * median and len(traces) >= 2:
        return [Finding(FLOW_LONG_TAIL, "slowest traces", "traces", WARN,
                        f"the slowest request took {top.duration_s / median:.0f}x the median", evidence, action, data)]
    return [Finding(FLOW_LONG_TAIL, "slowest traces", "traces", OK, "no outlier among the traced requests",
                    evidence, action, data)]


HOP_ACTIONS = {
    "engine_first_token": "the engine's first step: check that the hot lane's CUDA graphs cover its prefills "
                          "(preflight, hot_lane.engine.cuda_graph_max_tokens), the GPU share the cold lane leaves it "
                          "(MPS cap) and the cold lane's chunk budget; for realtime, a hot replica of its own "
                          "(admission.realtime_reserved_hot_replicas) so it never waits for an interactive prefill "
                          "(docs/operators.md, \"One GPU for both lanes\")",
    "router_work": "the Router's own work (tokenize, admit, route): long prompts are tokenized off the event loop; "
                   "add Router replicas if its CPU is busy",
    "hop_to_lane": "the Serve handle call to the lane: set gpu-single.yaml's runtime_env (gRPC between replicas, "
                   "code on each replica's main loop) and give the Router replicas their own cores",
    "hop_back": "the first chunk's way back to the Router: the same Serve settings as for hop_to_lane",
    "lane_wait": "the hot replica's realtime gate / KV headroom: see the KV-pressure findings",
}


def check_ttft_hops(inputs: DoctorInputs) -> list[Finding]:
    """Per class, where the median streamed TTFT goes (app.observability.ttft_hops), and what to change for the
    largest part. Needs a trace file with every request traced (sample_ratio 1.0)."""
    if inputs.spans is None:
        return []
    from app.observability.ttft_hops import SEGMENTS, ttft_breakdown

    findings = []
    for request_class, row in ttft_breakdown(inputs.spans).items():
        ttft = row["ttft_at_router"]["p50"]
        parts = {name: row[name]["p50"] for name in SEGMENTS if name != "ttft_at_router"}
        largest = max(parts, key=parts.get)
        path = parts["router_work"] + parts["hop_to_lane"] + parts["hop_back"]
        evidence = (f"{row['requests']} streamed requests, TTFT p50 {ttft:.1f} ms / p99 "
                    f"{row['ttft_at_router']['p99']:.1f} ms: " + ", ".join(f"{n} {v:.1f}" for n, v in parts.items())
                    + " ms (p50)")
        data = {"breakdown": row, "path_ms": path, "largest": largest}
        if ttft > 0 and path >= PATH_SHARE_WARN * ttft:
            hop = max(("router_work", "hop_to_lane", "hop_back"), key=parts.get)
            findings.append(Finding(FLOW_LONG_TAIL, "TTFT by hop", request_class, WARN,
                                    f"the request path is {path / ttft:.0%} of the median TTFT ({path:.1f} ms)",
                                    evidence, HOP_ACTIONS[hop], data))
        else:
            findings.append(Finding(FLOW_LONG_TAIL, "TTFT by hop", request_class, OK,
                                    f"{largest} is the largest part of the median TTFT ({parts[largest]:.1f} of "
                                    f"{ttft:.1f} ms)", evidence, HOP_ACTIONS[largest], data))
    return findings


def profiling_guidance(serve_config: str | None) -> list[str]:
    """The guide's `nsys profile -t cuda,nvtx` step, spelled out for a Ray Serve app."""
    config = serve_config or "serve_configs/gpu-single.yaml"
    return [
        "Profile one node with Nsight Systems (nsys follows the child processes: Ray, the replicas, vLLM's engine "
        "core); start from a node with no Ray running (ray stop):",
        f"  RAY_AUTH_MODE=disabled nsys profile -t cuda,nvtx --trace-fork-before-exec=true --stats=true "
        f"-o /tmp/llm-lanes-profile --force-overwrite=true python -m ray.serve.scripts run {config}",
        "  then reproduce the tail from another shell: python -m load_tests.run --scenario "
        "load_tests/scenarios/mixed.yaml --url http://127.0.0.1:8000 --out /tmp/doctor-load",
        "  stop serve (Ctrl-C) so nsys writes /tmp/llm-lanes-profile.nsys-rep; open it in nsys-ui, or "
        "nsys stats /tmp/llm-lanes-profile.nsys-rep; look for gaps between kernels (CPU-bound scheduling) and "
        "long prefill kernels next to decode steps",
        "  TP workers under Ray: add ray_workers_use_nsight: true to the lane's extra_engine_args; their reports "
        "go to /tmp/ray/session_latest/logs/nsight/",
    ]

