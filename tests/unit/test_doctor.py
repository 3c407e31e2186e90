"""Doctor: every finding from synthetic stats documents and Prometheus exposition text, plus the CLI against an
in-process HTTP server that serves fake /v1/admin/stats, /v1/models and /metrics."""

from __future__ import annotations

import http.server
import json
import math
import threading
from collections.abc import Iterator, Mapping, Sequence

import pytest

from app.observability.metrics import E2E_BUCKETS_S, QUEUE_WAIT_BUCKETS_S, TTFT_BUCKETS_S
from app.tools.doctor.checks import exit_code
from app.tools.doctor.checks_long_tail import (
    check_latency_tails, check_realtime_reserve, check_slowest_traces, check_tail_breakdown, check_ttft_hops,
    profiling_guidance, summarize_traces,
)
from app.tools.doctor.checks_oom import (
    check_batched_tokens, check_kv_pressure, check_long_context_degrades, check_prompt_lengths,
)
from app.tools.doctor.checks_throughput import (
    check_admission_queue, check_batch_backlog, check_breakers, check_replica_scheduler, check_request_outcomes,
    check_routing_balance,
)
from app.tools.doctor.cli import main
from app.tools.doctor.inputs import (
    batch_backlog_from_metrics, gather_inputs, merge_metric_replicas, parse_stats, read_span_lines,
)
from app.tools.doctor.model import (
    FLOW_OOM, OK, PROBLEM, WARN, DoctorInputs, Finding, Histogram, LaneLimits, MetricsSnapshot, ReplicaStats,
)

# ---- realistic exposition text ------------------------------------------------------------------------------------

# Labels Ray adds to every series on its export port, and the ones Serve adds inside a replica.
RAY_LABELS = {
    "Component": "core_worker",
    "NodeAddress": "10.0.0.5",
    "SessionName": "session_2026_01_12_10-00-00_000000_1234",
    "Version": "2.60.0",
}
HOT, COLD, HOT2 = "xqqu2fxs", "k3v9ab01", "p0d7zz12"


def one_two_five(limit: int) -> list[float]:
    """vLLM's request-token buckets (build_1_2_5_buckets): 1, 2, 5, 10, ... up to max_model_len."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return out
            out.append(float(value))
        exponent += 1


def _labels(labels: Mapping[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in labels.items())


class Exposition:
    """Builds Prometheus text as Ray's export port writes it: # HELP / # TYPE, one block per family."""

    def __init__(self) -> None:
        self.families: dict[str, tuple[str, str, list[str]]] = {}

    def _family(self, name: str, kind: str, help_text: str) -> list[str]:
        return self.families.setdefault(name, (kind, help_text, []))[2]

    def gauge(self, name: str, labels: Mapping[str, str], value: float, help_text: str = "g") -> "Exposition":
        self._family(name, "gauge", help_text).append(f"{name}{{{_labels({**RAY_LABELS, **labels})}}} {value}")
        return self

    def counter(self, name: str, labels: Mapping[str, str], value: float, help_text: str = "c") -> "Exposition":
        self._family(name, "counter", help_text).append(f"{name}{{{_labels({**RAY_LABELS, **labels})}}} {value}")
        return self

    def histogram(self, name: str, labels: Mapping[str, str], bounds: Sequence[float],
                  observations: Sequence[float], help_text: str = "h") -> "Exposition":
        lines = self._family(name, "histogram", help_text)
        all_labels = {**RAY_LABELS, **labels}
        for bound in [*bounds, math.inf]:
            le = "+Inf" if math.isinf(bound) else repr(float(bound))
            count = sum(1 for o in observations if o <= bound)
            lines.append(f"{name}_bucket{{{_labels({**all_labels, 'le': le})}}} {float(count)}")
        lines.append(f"{name}_count{{{_labels(all_labels)}}} {float(len(observations))}")
        lines.append(f"{name}_sum{{{_labels(all_labels)}}} {float(sum(observations))}")
        return self

    def text(self) -> str:
        out = []
        for name, (kind, help_text, lines) in self.families.items():
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines]
        return "\n".join(out) + "\n"

    def snapshot(self) -> MetricsSnapshot:
        return MetricsSnapshot.parse(self.text())


def vllm(replica: str) -> dict[str, str]:
    return {"ReplicaId": replica, "WorkerId": f"w-{replica}", "engine": "0", "model_name": "tiny-llama"}


def serve_labels(lane: str, request_class: str, replica: str = "r-router") -> dict[str, str]:
    return {"application": "llm-lanes", "deployment": "Router", "replica": replica, "lane": lane,
            "request_class": request_class}


def replica(lane: str, replica_id: str, **values) -> ReplicaStats:
    return ReplicaStats(lane=lane, replica_id=replica_id, **values)


def inputs_with(metrics: Exposition | None = None, replicas: list[ReplicaStats] | None = None, **kw) -> DoctorInputs:
    return DoctorInputs(replicas=replicas if replicas is not None else [replica("hot", HOT), replica("cold", COLD)],
                        metrics=metrics.snapshot() if metrics is not None else None, **kw)


def only(findings: list[Finding], subject: str | None = None) -> Finding:
    chosen = [f for f in findings if subject is None or f.subject == subject]
    assert len(chosen) == 1, chosen
    return chosen[0]


STATS_DOCUMENT = {
    "lanes": {
        "hot": [{"lane": "hot", "replica_id": HOT, "running": 0, "waiting": 0, "kv_cache_usage": 0.0,
                 "prefix_cache_queries": 17, "prefix_cache_hits": 0, "kv_capacity_tokens": 131072,
                 "prefix_cache_hit_rate": 0.0, "inflight_by_class": {}, "served_by_class": {"interactive": 1}}],
        "cold": [{"lane": "cold", "replica_id": COLD, "running": 2, "waiting": 0, "kv_cache_usage": 0.25,
                  "prefix_cache_queries": 3, "prefix_cache_hits": 1, "kv_capacity_tokens": 131072,
                  "prefix_cache_hit_rate": 0.33, "inflight_by_class": {"batch": 2}, "served_by_class": {"batch": 9},
                  "some_future_field": {"x": 1}}],
    },
    "prefix_cache": {"entries": 0, "evictions": 0, "replicas": {}},
    "router": {"breakers": {"hot": "closed", "cold": "closed"},
               "queued_by_class": {"realtime": 0, "interactive": 0, "batch": 0}, "batch_window": 16},
}


# ---- histograms and snapshots ---------------------------------------------------------------------------------------


def test_histogram_quantile_interpolates_like_prometheus():
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.5], 2 in (0.5, 1.0].
    hist = Histogram(((0.1, 4.0), (0.5, 8.0), (1.0, 10.0), (math.inf, 10.0)))
    assert hist.count == 10
    assert hist.quantile(0.5) == pytest.approx(0.1 + 0.4 * (5 - 4) / 4)  # 0.2
    assert hist.quantile(0.99) == pytest.approx(0.5 + 0.5 * (9.9 - 8) / 2)  # 0.975
    assert hist.quantile_bucket(0.99) == (0.5, 1.0)
    assert hist.largest_bucket() == (0.5, 1.0)
    # The q-th observation in the +Inf bucket: Prometheus answers the largest finite bound.
    overflow = Histogram(((1.0, 1.0), (math.inf, 10.0)))
    assert overflow.quantile(0.99) == 1.0
    assert overflow.largest_bucket() == (1.0, math.inf)
    assert Histogram(((1.0, 0.0), (math.inf, 0.0))).quantile(0.5) is None


def test_count_above_gives_exact_bounds_around_the_threshold():
    bounds = one_two_five(20000)  # ... 5000, 10000, 20000
    prompts = [100] * 90 + [6000] * 6 + [15000] * 4
    hist = Histogram(tuple((b, float(sum(p <= b for p in prompts))) for b in [*bounds, math.inf]))
    # 8192 lies inside (5000, 10000]: the 4 prompts of 15000 are surely above, the 6 of 6000 maybe.
    assert hist.count_above(8192) == (4, 10)
    assert hist.count_above(10000) == (4, 4)  # a bucket bound: exact


def test_snapshot_parses_ray_exposition_and_subtracts_cumulative_series_over_a_window():
    earlier = (Exposition()
               .counter("ray_vllm_num_preemptions_total", vllm(HOT), 5)
               .counter("ray_vllm_num_preemptions_total", vllm(COLD), 7)
               .gauge("ray_vllm_num_requests_running", vllm(HOT), 3)).snapshot()
    later = (Exposition()
             .counter("ray_vllm_num_preemptions_total", vllm(HOT), 8)
             .counter("ray_vllm_num_preemptions_total", vllm(COLD), 2)  # replica restarted: counter reset
             .gauge("ray_vllm_num_requests_running", vllm(HOT), 1)).snapshot()
    assert later.select("ray_vllm_num_preemptions_total", ReplicaId=HOT)[0].labels["Version"] == "2.60.0"
    delta = later.delta_since(earlier)
    assert delta.select("ray_vllm_num_preemptions_total", ReplicaId=HOT)[0].value == 3
    assert delta.select("ray_vllm_num_preemptions_total", ReplicaId=COLD)[0].value == 2
    assert delta.select("ray_vllm_num_requests_running")[0].value == 1  # gauge: the later value
    with pytest.raises(ValueError):
        MetricsSnapshot.parse("<html>not metrics{{</html> x")


# ---- reading the stats document -------------------------------------------------------------------------------------


def test_parse_stats_reads_replicas_and_ignores_unknown_fields():
    parsed = parse_stats(STATS_DOCUMENT)
    assert [(r.lane, r.replica_id, r.running, r.kv_cache_usage, r.kv_capacity_tokens) for r in parsed.replicas] == [
        ("hot", HOT, 0, 0.0, 131072), ("cold", COLD, 2, 0.25, 131072)]
    assert parsed.breakers == {"hot": "closed", "cold": "closed"}
    assert parsed.batch_backlog_lines is None and parsed.notes == [] and parsed.lanes_present == ("hot", "cold")
    assert parse_stats({"lanes": STATS_DOCUMENT["lanes"]}).breakers == {}  # before the router section


def test_parse_stats_reads_the_router_section():
    document = {
        "lanes": {"hot": [{**STATS_DOCUMENT["lanes"]["hot"][0],
                           "gate_waiting_by_class": {"realtime": 3, "interactive": 0, "batch": 0},
                           "max_inflight_by_class": {"realtime": 4}, "held_for_kv_headroom": 2}]},
        "prefix_cache": {},
        "router": {"breakers": {"hot": "closed", "cold": "open"},
                   "queued_by_class": {"realtime": 0, "interactive": 7, "batch": 0}, "batch_window": 24},
    }
    parsed = parse_stats(document)
    assert parsed.breakers == {"hot": "closed", "cold": "open"}
    assert parsed.admission_queued == {"realtime": 0, "interactive": 7, "batch": 0}
    assert parsed.batch_window == 24
    assert parsed.replicas[0].gate_waiting_by_class == {"realtime": 3, "interactive": 0, "batch": 0}
    assert parsed.reserve_routing == {}  # no reserve


def test_the_realtime_reserve_finding():
    document = {**STATS_DOCUMENT, "router": {**STATS_DOCUMENT["router"], "replica_routing": {
        "HotLane": {"reasons": {"short_prompt": 12}, "reserve_routing": {"preferred": 10, "fallback": 2}},
        "ColdLane": {"reasons": {"no_match": 3}}}}}
    parsed = parse_stats(document)
    assert parsed.reserve_routing == {"preferred": 10, "fallback": 2}
    crossed = only(check_realtime_reserve(inputs_with(reserve_routing=parsed.reserve_routing)))
    assert crossed.severity == WARN
    assert crossed.summary == "2 of 12 hot-lane routings crossed the realtime reserve"
    assert "realtime_reserved_hot_replicas" in crossed.action
    held = only(check_realtime_reserve(inputs_with(reserve_routing={"preferred": 155})))
    assert held.severity == OK and held.summary == "realtime reserve held"
    assert check_realtime_reserve(inputs_with()) == []  # no reserve, no finding


def test_parse_stats_tolerates_errors_future_shapes_and_missing_lanes():
    document = {
        "lanes": {
            "hot": {"replicas": [{"replica_id": HOT, "running": 1, "waiting": 0, "max_num_seqs": 64}],
                    "breaker": {"state": "half_open", "failures": 3}},
            "cold": [{"error": "RayServeException: timed out"}],
        },
        "breakers": {"cold": "open"},
        "batch_backlog": {"lines": 120, "tokens": 50000},
    }
    parsed = parse_stats(document)
    assert parsed.replicas[0].max_num_seqs == 64 and parsed.replicas[0].lane == "hot"
    assert parsed.replicas[1].error == "RayServeException: timed out" and parsed.replicas[1].lane == "cold"
    assert parsed.breakers == {"hot": "half_open", "cold": "open"}
    assert parsed.batch_backlog_lines == 120
    assert parse_stats({"prefix_cache": {}}).notes == [
        "stats document has no `lanes`: engine stats not checked"]


def test_metric_replicas_are_merged_with_lane_from_our_kv_gauge():
    metrics = (Exposition()
               .gauge("ray_vllm_num_requests_running", vllm(HOT), 4)
               .gauge("ray_vllm_num_requests_running", vllm(HOT2), 0)
               .gauge("ray_vllm_num_requests_waiting", vllm(HOT2), 0)
               .gauge("ray_vllm_kv_cache_usage_perc", vllm(HOT2), 0.1)
               .counter("ray_vllm_num_preemptions_total", vllm(HOT), 12)
               .gauge("ray_vllm_num_requests_waiting_by_reason", {**vllm(HOT), "reason": "capacity"}, 2)
               .gauge("ray_llm_lanes_kv_cache_usage",
                      {"application": "llm-lanes", "deployment": "HotLane", "replica": HOT2, "lane": "hot"}, 0.1))
    merged = merge_metric_replicas(
        [replica("hot", HOT, running=4, waiting=2, kv_cache_usage=0.5)], metrics.snapshot())
    by_id = {r.replica_id: r for r in merged}
    assert by_id[HOT].preemptions == 12 and by_id[HOT].waiting_by_reason == {"capacity": 2}
    assert by_id[HOT].source == "stats" and by_id[HOT].running == 4
    assert by_id[HOT2].lane == "hot" and by_id[HOT2].source == "metrics" and by_id[HOT2].kv_cache_usage == 0.1


# ---- flow 1: OOM with low GPU use -----------------------------------------------------------------------------------

PROMPT_BOUNDS = one_two_five(32768)


def prompts(replica_id: str, observations: Sequence[float]) -> Exposition:
    return Exposition().histogram("ray_vllm_request_prompt_tokens", vllm(replica_id), PROMPT_BOUNDS, observations)


def test_prompt_lengths_ok_for_ordinary_traffic():
    finding = only(check_prompt_lengths(inputs_with(prompts(HOT, [300] * 100), max_model_len=32768)))
    assert finding.severity == OK and finding.subject == "hot"
    assert "p99 in (200, 500]" in finding.evidence and "max_model_len 32,768" in finding.evidence


def test_prompt_lengths_warn_on_a_tail_far_above_the_median():
    observations = [150] * 95 + [3000] * 5
    finding = only(check_prompt_lengths(inputs_with(prompts(COLD, observations), max_model_len=32768)))
    assert finding.severity == WARN and "abnormally long contexts" in finding.summary
    assert finding.data["p99_over_p50_at_least"] == pytest.approx(2000 / 200)


def test_prompt_lengths_warn_near_max_model_len():
    observations = [500] * 98 + [2040] * 2
    finding = only(check_prompt_lengths(
        inputs_with(Exposition().histogram("ray_vllm_request_prompt_tokens", vllm(COLD), one_two_five(2048),
                                           observations), max_model_len=2048)))
    assert finding.severity == WARN and "at least 2 prompts within 10% of max_model_len" in finding.summary


def test_prompt_lengths_problem_when_long_prompts_ran_on_the_hot_lane():
    observations = [400] * 97 + [15000] * 3
    findings = check_prompt_lengths(inputs_with(prompts(HOT, observations), max_model_len=32768))
    finding = only(findings)
    assert finding.severity == PROBLEM and "3 prompts above 8,192 tokens ran on the hot lane" in finding.summary
    assert "long_context_threshold" in finding.action
    # A single-pool deployment (no cold lane) has nowhere to degrade to: not a PROBLEM there.
    single_pool = inputs_with(prompts(HOT, observations), max_model_len=32768, lanes_present=("hot",))
    assert only(check_prompt_lengths(single_pool)).severity != PROBLEM


def test_long_context_degrade_counts():
    def metrics(degraded: int) -> Exposition:
        return (Exposition()
                .counter("ray_llm_lanes_degrade_total", {"reason": "long_context", "request_class": "interactive"},
                         degraded)
                .counter("ray_llm_lanes_degrade_total", {"reason": "hot_saturated", "request_class": "interactive"},
                         50)
                .counter("ray_llm_lanes_requests_total",
                         {**serve_labels("hot", "interactive"), "outcome": "success", "status": "200"}, 1000))

    rare = only(check_long_context_degrades(inputs_with(metrics(5))))
    assert rare.severity == OK and "5 long-context degrades" in rare.evidence and "(0%)" in rare.evidence
    common = only(check_long_context_degrades(inputs_with(metrics(150))))
    assert common.severity == WARN and common.data["share"] == pytest.approx(0.15)


def test_batched_tokens_vs_the_longest_prompts():
    observations = [300] * 90 + [12000] * 10  # p99 in (10000, 20000]
    limits = {"hot": LaneLimits(max_num_seqs=64, max_num_batched_tokens=4096),
              "cold": LaneLimits(max_num_seqs=64, max_num_batched_tokens=16384)}
    hot = only(check_batched_tokens(inputs_with(prompts(HOT, observations), lane_limits=limits)))
    assert hot.severity == WARN and "at least 3 prefill steps of 4,096 tokens" in hot.summary
    cold = only(check_batched_tokens(inputs_with(prompts(COLD, [300] * 100), lane_limits=limits)))
    assert cold.severity == OK and "max_num_batched_tokens 16,384" in cold.evidence
    assert check_batched_tokens(inputs_with(prompts(HOT, observations))) == []  # limits unknown


def test_kv_pressure_findings():
    replicas = [
        replica("hot", HOT, running=30, waiting=5, kv_cache_usage=0.98, preemptions=12),
        replica("hot", HOT2, running=10, waiting=0, kv_cache_usage=0.96, preemptions=0),
        replica("cold", COLD, running=3, waiting=0, kv_cache_usage=0.4, preemptions=2),
        replica("cold", "c2", running=1, waiting=0, kv_cache_usage=0.2, preemptions=0),
        replica("cold", "c3", error="timed out"),
    ]
    findings = {f.subject: f for f in check_kv_pressure(inputs_with(replicas=replicas))}
    assert findings[f"hot {HOT}"].severity == PROBLEM and "98% in use" in findings[f"hot {HOT}"].evidence
    assert "12 preemptions" in findings[f"hot {HOT}"].evidence
    assert findings[f"hot {HOT2}"].severity == WARN and "95%" in findings[f"hot {HOT2}"].summary
    assert findings[f"cold {COLD}"].severity == WARN and "preempted" in findings[f"cold {COLD}"].summary
    assert findings["all"].severity == OK and findings["all"].data["replicas"] == 1  # c2; c3 errored


# ---- flow 2: throughput drop ----------------------------------------------------------------------------------------


def test_scheduler_findings_name_what_starves_it():
    replicas = [
        replica("hot", "kv", running=6, waiting=9, kv_cache_usage=0.97),
        replica("hot", "seqs", running=64, waiting=3, kv_cache_usage=0.40),
        replica("cold", "free", running=2, waiting=4, kv_cache_usage=0.10, waiting_by_reason={"deferred": 4}),
        replica("cold", "idle", running=0, waiting=0, kv_cache_usage=0.0),
        replica("hot", "gone", error="ActorDiedError"),
    ]
    limits = {"hot": LaneLimits(64, 8192), "cold": LaneLimits(128, 8192)}
    findings = {f.subject: f for f in check_replica_scheduler(inputs_with(replicas=replicas,
                                                                                 lane_limits=limits))}
    assert findings["hot kv"].severity == PROBLEM and "full KV cache" in findings["hot kv"].summary
    assert findings["hot seqs"].severity == PROBLEM and "max_num_seqs" in findings["hot seqs"].summary
    assert "running 64 of max_num_seqs 64" in findings["hot seqs"].evidence
    assert findings["cold free"].severity == WARN and "deferred 4" in findings["cold free"].evidence
    assert findings["hot gone"].severity == PROBLEM and "ActorDiedError" in findings["hot gone"].evidence
    assert findings["all"].severity == OK and "cold idle: running 0" in findings["all"].evidence


def test_scheduler_without_limits_suspects_max_num_seqs():
    finding = only(check_replica_scheduler(
        inputs_with(replicas=[replica("hot", HOT, running=32, waiting=8, kv_cache_usage=0.3)])))
    assert finding.severity == WARN and "--serve-config" in finding.action


def test_requests_held_at_the_realtime_gate():
    held = replica("hot", HOT, running=4, waiting=0, kv_cache_usage=0.2,
                   gate_waiting_by_class={"realtime": 3, "interactive": 0})
    finding = only(check_replica_scheduler(inputs_with(replicas=[held])))
    assert finding.severity == WARN and "realtime gate" in finding.summary
    assert "held by the replica's gate: realtime 3" in finding.evidence
    assert "realtime_max_inflight" in finding.action


def test_admission_queue():
    busy = [replica("hot", HOT, running=30, waiting=2), replica("cold", COLD, running=0, waiting=0)]
    findings = {f.subject: f for f in check_admission_queue(
        inputs_with(replicas=busy, admission_queued={"realtime": 2, "interactive": 5, "batch": 4}))}
    assert findings["hot"].severity == WARN and "interactive 5, realtime 2" in findings["hot"].evidence
    assert findings["cold"].severity == PROBLEM and "engines idle" in findings["cold"].summary
    empty = only(check_admission_queue(inputs_with(admission_queued={"realtime": 0, "interactive": 0})))
    assert empty.severity == OK
    assert check_admission_queue(inputs_with()) == []  # the stats document has no router section


def test_routing_balance():
    idle_next_to_waiting = [replica("hot", "a", running=0, waiting=0), replica("hot", "b", running=4, waiting=3)]
    finding = only(check_routing_balance(inputs_with(replicas=idle_next_to_waiting)))
    assert finding.severity == WARN and "a is idle while b has 7 requests" in finding.summary
    lopsided = [replica("cold", "a", running=1, waiting=0), replica("cold", "b", running=20, waiting=0)]
    assert only(check_routing_balance(inputs_with(replicas=lopsided))).severity == WARN
    even = [replica("cold", "a", running=10, waiting=1), replica("cold", "b", running=12, waiting=0)]
    assert only(check_routing_balance(inputs_with(replicas=even))).severity == OK
    single = inputs_with(replicas=[replica("hot", "a", running=1, waiting=0)])
    assert check_routing_balance(single) == []
    assert single.notes == ["routing balance of the hot lane not checked: 1 replica visible"]


def requests_metric(lane: str, outcomes: Mapping[str, int]) -> Exposition:
    exposition = Exposition()
    status = {"success": "200", "error": "500", "timeout": "504", "rejected": "429", "cancelled": "499"}
    for outcome, count in outcomes.items():
        exposition.counter("ray_llm_lanes_requests_total",
                           {**serve_labels(lane, "interactive"), "outcome": outcome, "status": status[outcome]}, count)
    return exposition


@pytest.mark.parametrize(("outcomes", "severity", "words"), [
    ({"success": 900, "error": 60, "timeout": 40}, PROBLEM, "10% of requests end in error or timeout"),
    ({"success": 980, "timeout": 20}, WARN, "2% of requests end in error or timeout"),
    ({"success": 900, "rejected": 100}, WARN, "10% of requests rejected"),
    ({"success": 995, "cancelled": 5}, OK, "errors and rejections are rare"),
])
def test_request_outcomes(outcomes, severity, words):
    finding = only(check_request_outcomes(inputs_with(requests_metric("hot", outcomes))))
    assert finding.severity == severity and words in finding.summary


def test_batch_backlog_with_an_idle_cold_lane():
    idle = [replica("cold", COLD, running=0, waiting=0)]
    stuck = only(check_batch_backlog(inputs_with(replicas=idle, batch_backlog_lines=500, batch_window=16)))
    assert stuck.severity == PROBLEM and "500 batch lines" in stuck.evidence and "window 16" in stuck.evidence
    busy = [replica("cold", COLD, running=24, waiting=3)]
    assert only(check_batch_backlog(inputs_with(replicas=busy, batch_backlog_lines=500))).severity == OK
    assert check_batch_backlog(inputs_with(replicas=idle)) == []  # backlog not reported
    metrics = Exposition().gauge("ray_llm_lanes_batch_backlog_lines", {"replica": "r1"}, 40).gauge(
        "ray_llm_lanes_batch_backlog_lines", {"replica": "r2"}, 41)
    assert batch_backlog_from_metrics(metrics.snapshot()) == 41  # max over Router replicas, not the sum


def test_breakers():
    findings = {f.subject: f.severity for f in check_breakers(
        inputs_with(breakers={"hot": "open", "cold": "half-open", "x": "closed"}))}
    assert findings == {"hot": PROBLEM, "cold": WARN, "lanes": OK}
    closed = only(check_breakers(inputs_with(breakers={"hot": "closed", "cold": "closed"})))
    assert closed.severity == OK and closed.evidence == "cold closed, hot closed"


# ---- flow 3: long tail ----------------------------------------------------------------------------------------------


def latencies(lane: str, request_class: str, ttft: Sequence[float], e2e: Sequence[float] | None = None) -> Exposition:
    exposition = Exposition().histogram("ray_llm_lanes_ttft_seconds", serve_labels(lane, request_class),
                                        TTFT_BUCKETS_S, ttft)
    if e2e is not None:
        exposition.histogram("ray_llm_lanes_e2e_seconds", serve_labels(lane, request_class), E2E_BUCKETS_S, e2e)
    return exposition


def test_latency_tail_ok():
    finding = only(check_latency_tails(inputs_with(latencies("hot", "interactive", [0.08] * 100,
                                                                     [1.5] * 100))))
    assert finding.severity == OK and finding.subject == "hot/interactive"
    assert "TTFT p50" in finding.evidence and "E2E p50" in finding.evidence


def test_realtime_ttft_above_the_goal_is_a_problem():
    finding = only(check_latency_tails(inputs_with(latencies("hot", "realtime", [0.2] * 90 + [0.7] * 10))))
    assert finding.severity == PROBLEM and "above the 450 ms goal" in finding.summary
    assert finding.data["ttft_p99_s"] == pytest.approx(0.6 + 0.2 * (99 - 90) / 10)


@pytest.mark.parametrize(("slow", "severity"), [(0.7, WARN), (4.0, PROBLEM)])
def test_ttft_tail_ratio(slow, severity):
    ttft = [0.09] * 95 + [slow] * 5
    finding = only(check_latency_tails(inputs_with(latencies("cold", "batch", ttft))))
    assert finding.severity == severity and "TTFT p99 is" in finding.summary


def test_e2e_tail_alone_is_a_warning():
    finding = only(check_latency_tails(inputs_with(latencies("cold", "batch", [0.1] * 100,
                                                                     [1.0] * 95 + [50.0] * 5))))
    assert finding.severity == WARN and "E2E p99 is" in finding.summary


def test_too_few_samples_are_noted_not_judged():
    inputs = inputs_with(latencies("hot", "realtime", [2.0] * 5))
    assert check_latency_tails(inputs) == []
    assert inputs.notes == ["tail of hot/realtime not judged: 5 requests (< 20)"]


def test_tail_breakdown_names_the_dominant_phase():
    phase_bounds = [0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
    metrics = (Exposition()
               .histogram("ray_vllm_request_queue_time_seconds", vllm(HOT), phase_bounds, [0.01] * 90 + [8.0] * 10)
               .histogram("ray_vllm_request_prefill_time_seconds", vllm(HOT), phase_bounds, [0.05] * 100)
               .histogram("ray_vllm_request_decode_time_seconds", vllm(HOT), phase_bounds, [0.9] * 100)
               .histogram("ray_llm_lanes_queue_wait_seconds",
                          {"application": "llm-lanes", "deployment": "Router", "replica": "r",
                           "request_class": "interactive"}, QUEUE_WAIT_BUCKETS_S, [0.001] * 100))
    finding = only(check_tail_breakdown(inputs_with(metrics)))
    assert finding.subject == "hot" and finding.data["dominant"] == "engine queue"
    assert "max_num_seqs or KV cache" in finding.action
    assert set(finding.data["p99_s"]) == {"engine queue", "prefill", "decode", "admission queue"}


def span(trace_id: str, name: str, start_ms: float, end_ms: float, parent: str | None, span_id: str,
         **attributes) -> dict:
    return {"name": name, "trace_id": trace_id, "span_id": span_id, "parent_span_id": parent,
            "start_time_ns": int(start_ms * 1e6), "end_time_ns": int(end_ms * 1e6), "attributes": attributes,
            "component": "Router", "status": "UNSET"}


def trace(trace_id: str, total_ms: float, prefill_ms: float) -> list[dict]:
    return [
        span(trace_id, "request", 0, total_ms, None, trace_id + "01", request_class="interactive"),
        span(trace_id, "queue_wait", 0, 1, trace_id + "01", trace_id + "02"),
        span(trace_id, "lane_generate", 2, total_ms, trace_id + "01", trace_id + "03", lane="hot"),
        span(trace_id, "prefill", 2, 2 + prefill_ms, trace_id + "03", trace_id + "04", lane="hot"),
        span(trace_id, "decode", 2 + prefill_ms, total_ms, trace_id + "03", trace_id + "05", lane="hot"),
    ]


def test_slowest_traces_flag_an_outlier_and_name_its_phase():
    spans = [s for i in range(9) for s in trace(f"t{i}", 200, 20)] + trace("slow", 3000, 2800)
    summaries = summarize_traces(spans)
    assert summaries[0].trace_id == "slow" and summaries[0].duration_s == pytest.approx(3.0)
    assert summaries[0].lane == "hot" and summaries[0].request_class == "interactive"
    assert summaries[0].dominant_phase == "prefill"
    finding = only(check_slowest_traces(inputs_with(spans=spans, slowest_traces=3)))
    assert finding.severity == WARN and "15x the median" in finding.summary
    assert "slow 3.00 s [hot/interactive] prefill 2.80 s" in finding.evidence
    assert "prefill dominates" in finding.action and len(finding.data["slowest"]) == 3


def test_slowest_traces_ok_without_outliers():
    spans = [s for i in range(5) for s in trace(f"t{i}", 200 + i, 20)]
    assert only(check_slowest_traces(inputs_with(spans=spans))).severity == OK
    assert check_slowest_traces(inputs_with()) == []  # no trace file


def test_span_file_lines_skip_torn_writes():
    good = json.dumps(trace("t", 100, 10)[0])
    assert read_span_lines(f"{good}\n{{\"name\": \"torn\n\n[1, 2]\n{good}\n") == [json.loads(good)] * 2


def test_profiling_guidance_spells_out_nsys():
    text = "\n".join(profiling_guidance("serve_configs/prod.yaml"))
    assert ("nsys profile -t cuda,nvtx --trace-fork-before-exec=true --stats=true -o /tmp/llm-lanes-profile "
            "--force-overwrite=true python -m ray.serve.scripts run serve_configs/prod.yaml") in text
    assert "ray_workers_use_nsight" in text


def test_exit_code_is_one_only_with_a_problem():
    finding = Finding(FLOW_OOM, "c", "s", WARN, "x", "y")
    assert exit_code([finding]) == 0
    assert exit_code([finding, Finding(FLOW_OOM, "c", "s", PROBLEM, "x", "y")]) == 1


# ---- the CLI against a fake app -------------------------------------------------------------------------------------


class FakeApp:
    """A thread-run http.server with the three endpoints; `metrics` may be a list served one per scrape."""

    def __init__(self, stats: dict, metrics: str | list[str], models: dict | None = None):
        self.stats, self.models = stats, models or {"object": "list", "data": [
            {"id": "tiny-llama", "object": "model", "max_model_len": 32768}]}
        self.metrics = [metrics] if isinstance(metrics, str) else list(metrics)
        self.scrapes = 0
        app = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path == "/v1/admin/stats":
                    body, kind = json.dumps(app.stats).encode(), "application/json"
                elif self.path == "/v1/models":
                    body, kind = json.dumps(app.models).encode(), "application/json"
                elif self.path == "/metrics":
                    body = app.metrics[min(app.scrapes, len(app.metrics) - 1)].encode()
                    app.scrapes += 1
                    kind = "text/plain; version=0.0.4"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)

    def __enter__(self) -> "FakeApp":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def troubled_metrics() -> str:
    metrics = (prompts(HOT, [400] * 97 + [15000] * 3)
               .gauge("ray_vllm_num_requests_running", vllm(HOT), 0)
               .gauge("ray_vllm_num_requests_waiting", vllm(HOT), 0)
               .gauge("ray_vllm_kv_cache_usage_perc", vllm(HOT), 0.0)
               .counter("ray_vllm_num_preemptions_total", vllm(HOT), 0)
               .gauge("ray_vllm_num_requests_running", vllm(COLD), 2)
               .gauge("ray_vllm_num_requests_waiting", vllm(COLD), 0)
               .gauge("ray_vllm_kv_cache_usage_perc", vllm(COLD), 0.25)
               .counter("ray_vllm_num_preemptions_total", vllm(COLD), 0))
    for family in (latencies("hot", "realtime", [0.2] * 90 + [0.7] * 10, [1.0] * 100),
                   requests_metric("hot", {"success": 100})):
        for name, value in family.families.items():
            metrics.families[name] = value
    return metrics.text()


@pytest.fixture
def fake_app() -> Iterator[FakeApp]:
    with FakeApp(STATS_DOCUMENT, troubled_metrics()) as app:
        yield app


def test_cli_json_against_a_fake_app(fake_app, capsys, tmp_path):
    code = main(["--url", fake_app.url, "--metrics-url", fake_app.url + "/metrics", "--json",
                        "--trace-file", str(tmp_path / "absent.jsonl")])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["exit_code"] == 1
    assert report["max_model_len"] == 32768
    by_check = {(f["check"], f["subject"]): f for f in report["findings"]}
    assert by_check[("long contexts", "hot")]["severity"] == PROBLEM
    assert by_check[("latency tail", "hot/realtime")]["severity"] == PROBLEM
    assert by_check[("KV pressure", "all")]["severity"] == OK
    assert by_check[("engine stats", "all")]["severity"] == OK
    assert by_check[("request outcomes", "hot")]["severity"] == OK
    assert by_check[("circuit breaker", "lanes")]["severity"] == OK
    assert by_check[("admission queue", "router")]["severity"] == OK
    assert any("absent.jsonl not found" in note for note in report["notes"])
    assert any("--serve-config" in note for note in report["notes"])
    assert {r["replica_id"] for r in report["replicas"]} == {HOT, COLD}
    assert any("nsys profile -t cuda,nvtx" in line for line in report["profiling"])


SERVE_CONFIG = """\
applications:
  - name: llm-lanes
    import_path: app.main:build_app
    args:
      device: cpu
      model: {source: models/tiny-llama, served_name: tiny-llama, max_model_len: 32768}
      hot_lane:
        engine: {dtype: float32, max_num_seqs: 32, max_num_batched_tokens: 4096, kv_cache_memory_bytes: 268435456}
      cold_lane:
        engine: {dtype: float32, max_num_seqs: 64, max_num_batched_tokens: 8192, kv_cache_memory_bytes: 268435456}
"""


def test_cli_text_output_with_serve_config(fake_app, capsys, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(SERVE_CONFIG)
    code = main(["--url", fake_app.url, "--metrics-url", fake_app.url + "/metrics",
                        "--serve-config", str(config)])
    out = capsys.readouterr().out
    assert code == 1
    assert out.startswith(f"doctor: {fake_app.url}, metrics {fake_app.url}/metrics, max_model_len 32,768, "
                          "2 engine replicas, counters since start")
    assert "PROBLEM  long contexts [hot]: at least 3 prompts above 8,192 tokens ran on the hot lane" in out
    # The hot lane's max_num_batched_tokens 4096: so the hot p99 prompt (> 10,000) needs 3+ steps.
    assert "WARN     max_num_batched_tokens [hot]" in out
    assert "== long tail: p99 vs p50, where the time goes, slowest traces ==" in out
    assert "how to profile (nsys):" in out
    assert out.rstrip().endswith("(exit 1)")


def test_cli_exit_zero_when_healthy_and_without_metrics(capsys):
    with FakeApp(STATS_DOCUMENT, "") as app:
        code = main(["--url", app.url, "--metrics-url", ""])
    out = capsys.readouterr().out
    assert code == 0 and "no --metrics-url" in out and "OK       engine stats [all]" in out


def test_cli_unreachable_app_is_a_clean_error(capsys):
    with FakeApp(STATS_DOCUMENT, "") as app:
        url = app.url
    code = main(["--url", url])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.startswith(f"doctor: the app at {url} is not reachable: cannot connect to {url}/v1/admin/stats")
    assert "Traceback" not in captured.err


def test_cli_bad_serve_config_is_a_clean_error(fake_app, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications:\n  - name: x\n    args:\n      model: {source: m, served_name: m}\n"
                   "      hot_lane: {engine: {block_size: 48}}\n")
    code = main(["--url", fake_app.url, "--serve-config", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and "cannot read --serve-config" in err and "block_size" in err


def test_window_mode_judges_only_what_happened_between_scrapes():
    before = requests_metric("hot", {"success": 1000, "error": 100}).text()
    after = requests_metric("hot", {"success": 1100, "error": 100}).text()
    with FakeApp(STATS_DOCUMENT, [before, after]) as app:
        slept = []
        inputs = gather_inputs(app.url, app.url + "/metrics", window_s=30, sleep=slept.append)
        assert app.scrapes == 2
    assert slept == [30]
    finding = only(check_request_outcomes(inputs))
    # Cumulative: 100 errors of 1,200 (8 %, PROBLEM); in the window: 0 of 100.
    assert finding.severity == OK and "100 requests in the last 30 s" in finding.evidence


# ---- TTFT by hop (app.observability.ttft_hops) ----------------------------------------------------------------------


def test_ttft_hops_name_the_engine_when_it_is_most_of_the_ttft():
    from tests.unit.test_ttft_breakdown import streamed_request

    spans = streamed_request("a", "realtime") + streamed_request("b", "realtime", t0=1000)
    finding = only(check_ttft_hops(inputs_with(spans=spans)))
    assert (finding.check, finding.subject, finding.severity) == ("TTFT by hop", "realtime", OK)
    assert "engine_first_token is the largest part of the median TTFT (29.5 of 40.0 ms)" == finding.summary
    assert "2 streamed requests" in finding.evidence and "hop_to_lane 5.0" in finding.evidence
    assert "cuda_graph_max_tokens" in finding.action
    assert check_ttft_hops(inputs_with()) == []  # no trace file


def test_ttft_hops_warn_when_the_request_path_is_most_of_it():
    from tests.unit.test_ttft_breakdown import MS, streamed_request

    spans = streamed_request("a", "interactive")
    for span in spans:
        if span["name"] == "prefill":
            span["end_time_ns"] = 10 * MS  # the engine answers in 2.5 ms; the chunk takes 30 ms to reach the Router
    finding = only(check_ttft_hops(inputs_with(spans=spans)))
    assert finding.severity == WARN and finding.subject == "interactive"
    assert finding.summary == "the request path is 92% of the median TTFT (37.0 ms)"
    assert "same Serve settings" in finding.action and finding.data["largest"] == "hop_back"
