"""Doctor: the tuning guide's troubleshooting flows, run against a running llm-lanes app.

    python -m app.tools.doctor --url http://127.0.0.1:8000 [--metrics-url http://127.0.0.1:8080/metrics]
        [--serve-config serve_configs/local.yaml] [--trace-file spans.jsonl] [--window-s 30] [--json]

The three flows of the guide's troubleshooting section, each as findings (OK / WARN / PROBLEM) with the numbers
behind them and what to do, never raw dumps:

1. OOM with low GPU use: requests with abnormally long contexts (prompt-length histogram tail vs max_model_len and
   the long-context threshold, long-context degrade counts), max_num_batched_tokens vs the longest prompts, KV usage
   near full with preemptions.
2. Throughput drop: engine stats per replica (running / waiting / KV usage): waiting with a full KV cache or at
   max_num_seqs means a starved scheduler; idle replicas next to a loaded one mean routing imbalance; request
   errors / rejections; a batch backlog that the cold lane is not draining; open circuit breakers.
3. Long tail: p99/p50 of TTFT and E2E per lane and class from the histograms, where the p99 time goes (admission
   queue, engine queue, prefill, decode), the slowest traces and each class's TTFT by hop (Router, Serve hops, engine)
   when a span file is given, and how to profile (nsys).

Inputs: GET /v1/admin/stats and GET /v1/models of the app, the Prometheus text of Ray's metrics export port
(`ray_llm_lanes_*` and vLLM's `ray_vllm_*`), optionally the serve config (engine limits) and a JSON-lines span
file (app.observability.tracing's "file" exporter). Counters and histograms are cumulative since the replicas
started; `--window-s N` scrapes twice N seconds apart and judges the difference (what happens now).

Structure: the checks are pure functions of a `DoctorInputs` record (`run_checks(inputs)`); `gather_inputs()` is
the only code that talks to the network or reads files. Exit code: 0 without PROBLEM findings, 1 with any,
2 when the app cannot be reached or --serve-config cannot be read (nothing was diagnosed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from app.classes import CLASS_POLICIES, Lane, RequestClass
from app.config import AdmissionConfig
from app.observability import metrics as app_metrics
from app.observability.tracing import (
    SPAN_DECODE, SPAN_ENGINE_QUEUE, SPAN_PREFILL, SPAN_PREFIX_LOOKUP, SPAN_QUEUE_WAIT, SPAN_REQUEST, SPAN_ROUTE,
)
from app.router.spill import REASON_LONG_CONTEXT

OK, WARN, PROBLEM = "OK", "WARN", "PROBLEM"
SEVERITY_ORDER = {OK: 0, WARN: 1, PROBLEM: 2}

FLOW_OOM = "oom"
FLOW_THROUGHPUT = "throughput"
FLOW_LONG_TAIL = "long_tail"
FLOW_TITLES = {
    FLOW_OOM: "OOM with low GPU use: long contexts, batched-token budget, KV pressure",
    FLOW_THROUGHPUT: "throughput drop: engine stats per replica, routing, outcomes",
    FLOW_LONG_TAIL: "long tail: p99 vs p50, where the time goes, slowest traces",
}

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_METRICS_URL = "http://127.0.0.1:8080/metrics"

# --- thresholds, named for what they decide ---------------------------------------------------------------------
# A replica whose KV cache is this full cannot admit a new sequence without preempting one.
KV_FULL_FRACTION = 0.95
# Prompts within this fraction of max_model_len leave no room to generate and hold a whole sequence's KV blocks.
NEAR_MAX_MODEL_LEN_FRACTION = 0.9
# p99 prompt this many times the median: a few requests carry contexts far longer than the usual traffic.
PROMPT_TAIL_RATIO_WARN = 8.0
# Long-context degrades above this share of all requests: the cold lane carries real load for them.
LONG_CONTEXT_SHARE_WARN = 0.10
# Routing balance: a lane is imbalanced when one replica's load (running + waiting) is this many times another's
# (+1 so an idle replica compares as 1) and the busy one has at least this much load.
IMBALANCE_LOAD_RATIO = 4.0
IMBALANCE_MIN_LOAD = 8
# Request outcomes: share of error + timeout, and of rejections (429 / 503), among finished requests.
ERROR_SHARE_WARN = 0.01
ERROR_SHARE_PROBLEM = 0.05
REJECTED_SHARE_WARN = 0.05
# Tails: a p99 read from fewer samples than this is just the maximum, not a tail.
MIN_SAMPLES_FOR_TAIL = 20
# TTFT p99/p50: queueing or long prefills in front of some requests. E2E varies with output length by nature, so
# only a large ratio is worth a look and never a PROBLEM on its own.
TTFT_TAIL_RATIO_WARN = 5.0
TTFT_TAIL_RATIO_PROBLEM = 10.0
E2E_TAIL_RATIO_WARN = 10.0
# The tuning guide's realtime goal: P99 < 450 ms.
REALTIME_TTFT_P99_GOAL_S = 0.45
# Slowest traces: WARN when the slowest request took this many times the median traced request.
SLOW_TRACE_RATIO_WARN = 5.0
DEFAULT_SLOWEST_TRACES = 5
# Without a serve config: the schema's admission.long_context_threshold (the tuning guide's 8K).
SCHEMA_LONG_CONTEXT_THRESHOLD = AdmissionConfig.model_fields["long_context_threshold"].default


# --- metric names as scraped from Ray's export port (Ray puts "ray_" before the app's names) ------------------------
def _exported(spec: app_metrics.MetricSpec) -> str:
    return app_metrics.RAY_EXPORT_PREFIX + spec.name


M_TTFT = _exported(app_metrics.TTFT)
M_E2E = _exported(app_metrics.E2E)
M_REQUESTS = _exported(app_metrics.REQUESTS)
M_DEGRADE = _exported(app_metrics.DEGRADE)
M_QUEUE_WAIT = _exported(app_metrics.QUEUE_WAIT)
M_KV_USAGE = _exported(app_metrics.KV_CACHE_USAGE)
M_BATCH_BACKLOG = _exported(app_metrics.BATCH_BACKLOG)
# vLLM's own metrics (its RayPrometheusStatLogger), as exported by Ray.
V_RUNNING = "ray_vllm_num_requests_running"
V_WAITING = "ray_vllm_num_requests_waiting"
V_WAITING_BY_REASON = "ray_vllm_num_requests_waiting_by_reason"
V_KV_USAGE = "ray_vllm_kv_cache_usage_perc"  # a fraction 0-1 despite the name
V_PREEMPTIONS = "ray_vllm_num_preemptions_total"
V_PROMPT_TOKENS = "ray_vllm_request_prompt_tokens"
V_QUEUE_TIME = "ray_vllm_request_queue_time_seconds"
V_PREFILL_TIME = "ray_vllm_request_prefill_time_seconds"
V_DECODE_TIME = "ray_vllm_request_decode_time_seconds"

ERROR_OUTCOMES = (app_metrics.OUTCOME_ERROR, app_metrics.OUTCOME_TIMEOUT)
REJECTED_OUTCOME = app_metrics.OUTCOME_REJECTED
# Request class -> the lane that serves it (app.classes), as label values.
CLASS_HOME_LANE = {request_class.value: policy.lane.value for request_class, policy in CLASS_POLICIES.items()}
LANES = tuple(lane.value for lane in Lane)
# Sample-name endings of cumulative series: --window-s subtracts these; everything else is a gauge.
CUMULATIVE_SUFFIXES = ("_total", "_bucket", "_count", "_sum")

UNKNOWN_LANE = "unknown"


# ==== parsed inputs ================================================================================================


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True)
class MetricsSnapshot:
    """All samples of one scrape, flattened: family naming quirks (counters lose `_total` in the family name,
    untyped series) do not matter when we look samples up by their exposition names."""

    samples: tuple[Sample, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "MetricsSnapshot":
        """Prometheus text exposition -> snapshot. Raises ValueError on text that is not Prometheus format."""
        from prometheus_client.parser import text_string_to_metric_families

        samples = []
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created"):  # creation timestamps, not measurements
                    continue
                samples.append(Sample(s.name, dict(s.labels), float(s.value)))
        return cls(tuple(samples))

    def select(self, name: str, **label_filters: str) -> list[Sample]:
        return [
            s for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in label_filters.items())
        ]

    def has(self, name: str) -> bool:
        return any(s.name == name for s in self.samples)

    def delta_since(self, earlier: "MetricsSnapshot") -> "MetricsSnapshot":
        """Counters and histogram series minus their earlier values (a counter that went down was reset by a
        restart: its later value is the whole delta); gauges keep the later value."""
        before = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in earlier.samples}
        out = []
        for s in self.samples:
            if s.name.endswith(CUMULATIVE_SUFFIXES):
                previous = before.get((s.name, tuple(sorted(s.labels.items()))), 0.0)
                value = s.value - previous if s.value >= previous else s.value
                out.append(Sample(s.name, s.labels, value))
            else:
                out.append(s)
        return MetricsSnapshot(tuple(out))


@dataclass(frozen=True)
class Histogram:
    """Cumulative buckets (upper bound `le`, count of observations <= le), sorted, ending at +Inf."""

    buckets: tuple[tuple[float, float], ...]

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def cumulative_at(self, bound: float) -> float:
        """Observations <= the largest bucket bound that is <= `bound`."""
        below = [c for le, c in self.buckets if le <= bound]
        return below[-1] if below else 0.0

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear interpolation inside the bucket holding the q-th observation;
        a quantile in the +Inf bucket is reported as the largest finite bound (a lower bound of the truth)."""
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        previous_le, previous_count = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank and cumulative > previous_count:
                if math.isinf(le):
                    return previous_le
                in_bucket = cumulative - previous_count
                return previous_le + (le - previous_le) * (rank - previous_count) / in_bucket
            previous_le, previous_count = le, cumulative
        return previous_le

    def quantile_bucket(self, q: float) -> tuple[float, float] | None:
        """(lower, upper] bounds of the bucket holding the q-th observation: exact, where quantile() estimates."""
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        lower = 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank and cumulative > 0:
                return (lower, le)
            lower = le
        return (lower, math.inf)

    def largest_bucket(self) -> tuple[float, float] | None:
        """(lower, upper] of the highest non-empty bucket: where the largest observation lies."""
        lower, found, previous = 0.0, None, 0.0
        for le, cumulative in self.buckets:
            if cumulative > previous:
                found = (lower, le)
            previous, lower = cumulative, le
        return found

    def count_above(self, threshold: float) -> tuple[float, float]:
        """(at least, at most) observations > threshold: exact bounds from the buckets around the threshold."""
        total = self.count
        # Above the bucket that holds the threshold: surely > threshold. From that bucket up: possibly.
        # (When the threshold is a bucket bound both are the same exact count.)
        cumulative_at_or_above = next((c for le, c in self.buckets if le >= threshold), total)
        return (total - cumulative_at_or_above, total - self.cumulative_at(threshold))


def histograms(
    snapshot: MetricsSnapshot, base_name: str, key: Callable[[Mapping[str, str]], Any]
) -> dict[Any, Histogram]:
    """The `<base_name>_bucket` series summed per key(labels) (None: skip the series), one Histogram per key."""
    sums: dict[Any, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for s in snapshot.select(base_name + "_bucket"):
        k = key(s.labels)
        if k is None or "le" not in s.labels:
            continue
        sums[k][float(s.labels["le"])] += s.value
    return {
        k: Histogram(tuple(sorted(buckets.items())))
        for k, buckets in sums.items()
        if buckets and math.isinf(max(buckets))
    }


@dataclass(frozen=True)
class ReplicaStats:
    """One engine replica as the doctor sees it: from /v1/admin/stats, or from vLLM's gauges for replicas the
    stats endpoint did not list. None: not reported."""

    lane: str
    replica_id: str
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    kv_capacity_tokens: int | None = None
    preemptions: float | None = None
    waiting_by_reason: Mapping[str, float] = field(default_factory=dict)
    # Requests a hot replica holds in front of its engine (the realtime in-flight cap), by class.
    gate_waiting_by_class: Mapping[str, float] = field(default_factory=dict)
    max_num_seqs: int | None = None
    error: str | None = None
    source: str = "stats"  # "stats" | "metrics"

    @property
    def load(self) -> float:
        return (self.running or 0) + (self.waiting or 0)

    @property
    def name(self) -> str:
        return f"{self.lane} {self.replica_id}"


@dataclass(frozen=True)
class LaneLimits:
    """Engine settings of a lane that the checks compare against (from the serve config, or the stats document
    once it carries them)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None


@dataclass(frozen=True)
class TraceSummary:
    trace_id: str
    duration_s: float
    root_name: str
    lane: str | None
    request_class: str | None
    phases_s: Mapping[str, float]

    @property
    def dominant_phase(self) -> str | None:
        return max(self.phases_s, key=self.phases_s.get) if self.phases_s else None


@dataclass
class DoctorInputs:
    replicas: list[ReplicaStats] = field(default_factory=list)
    metrics: MetricsSnapshot | None = None
    max_model_len: int | None = None
    lane_limits: dict[str, LaneLimits] = field(default_factory=dict)
    long_context_threshold: int = SCHEMA_LONG_CONTEXT_THRESHOLD
    realtime_ttft_p99_goal_s: float = REALTIME_TTFT_P99_GOAL_S
    batch_backlog_lines: float | None = None
    breakers: dict[str, str] = field(default_factory=dict)  # lane -> closed | open | half_open
    admission_queued: dict[str, float] = field(default_factory=dict)  # request class -> queued at the Router
    batch_window: float | None = None  # the dispatcher's in-flight window per cold replica (adapts, 16-32 by default)
    # The realtime reserve's routings at the Router replica that answered (admission.realtime_reserved_hot_replicas):
    # {"preferred": n, "fallback": n}; empty without a reserve.
    reserve_routing: dict[str, float] = field(default_factory=dict)
    lanes_present: tuple[str, ...] = LANES
    spans: list[dict[str, Any]] | None = None  # None: no trace file
    slowest_traces: int = DEFAULT_SLOWEST_TRACES
    window_s: float = 0.0
    # What could not be read or judged (missing inputs, too few samples): fetching and the checks append here.
    notes: list[str] = field(default_factory=list)

    def replica_lanes(self) -> dict[str, str]:
        return {r.replica_id: r.lane for r in self.replicas if r.lane != UNKNOWN_LANE}


@dataclass(frozen=True)
class Finding:
    flow: str
    check: str
    subject: str  # what it is about: "hot xqqu2fxs", "hot/realtime", "all"
    severity: str
    summary: str
    evidence: str
    action: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)


# ==== formatting helpers ===========================================================================================


def _n(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "+Inf"
    return f"{value:,.0f}" if abs(value - round(value)) < 1e-9 or abs(value) >= 100 else f"{value:,.1f}"


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if math.isinf(seconds):
        return "+Inf"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.0f}%"


def _bucket(bounds: tuple[float, float] | None) -> str:
    if bounds is None:
        return "-"
    lower, upper = bounds
    return f"> {_n(lower)}" if math.isinf(upper) else f"({_n(lower)}, {_n(upper)}]"


def _worst(severities: Iterable[str]) -> str:
    return max(severities, key=SEVERITY_ORDER.__getitem__, default=OK)


def _since(inputs: DoctorInputs) -> str:
    return f"in the last {inputs.window_s:g} s" if inputs.window_s else "since the replicas started"


def _lane_key(inputs: DoctorInputs) -> Callable[[Mapping[str, str]], str]:
    """Labels -> lane: our metrics carry `lane`; vLLM's carry `ReplicaId`, mapped through the replicas we know."""
    lanes = inputs.replica_lanes()

    def key(labels: Mapping[str, str]) -> str:
        if labels.get("lane"):
            return labels["lane"]
        replica = labels.get("ReplicaId") or labels.get("replica") or ""
        return lanes.get(replica, UNKNOWN_LANE)

    return key


def _sum_by(snapshot: MetricsSnapshot, name: str, key: Callable[[Mapping[str, str]], Any]) -> dict[Any, float]:
    out: dict[Any, float] = defaultdict(float)
    for s in snapshot.select(name):
        k = key(s.labels)
        if k is not None:
            out[k] += s.value
    return dict(out)


# ==== flow 1: OOM with low GPU use =================================================================================


def check_prompt_lengths(inputs: DoctorInputs) -> list[Finding]:
    """Abnormally long contexts: the prompt-length histogram's tail vs its median, max_model_len and the
    long-context threshold, per lane."""
    if inputs.metrics is None or not inputs.metrics.has(V_PROMPT_TOKENS + "_bucket"):
        return []
    findings = []
    threshold = inputs.long_context_threshold
    for lane, hist in sorted(histograms(inputs.metrics, V_PROMPT_TOKENS, _lane_key(inputs)).items()):
        if hist.count <= 0:
            continue
        p50, p99 = hist.quantile_bucket(0.5), hist.quantile_bucket(0.99)
        largest = hist.largest_bucket()
        above_least, above_most = hist.count_above(threshold)
        evidence = (
            f"{_n(hist.count)} prompts {_since(inputs)}: p50 in {_bucket(p50)}, p99 in {_bucket(p99)}, "
            f"longest in {_bucket(largest)} tokens"
            + (f" (max_model_len {_n(inputs.max_model_len)})" if inputs.max_model_len else "")
            + f"; above the long-context threshold {_n(threshold)}: "
            + (_n(above_least) if above_least == above_most else f"{_n(above_least)}-{_n(above_most)}")
        )
        data = {"prompts": hist.count, "p50_bucket": p50, "p99_bucket": p99, "longest_bucket": largest,
                "above_long_context_threshold": [above_least, above_most], "max_model_len": inputs.max_model_len}
        severity, summary, action = OK, "prompt lengths look ordinary", ""
        near_least = 0.0
        if inputs.max_model_len:
            near_least, _ = hist.count_above(NEAR_MAX_MODEL_LEN_FRACTION * inputs.max_model_len)
            data["near_max_model_len_at_least"] = near_least
        # Ratio of the p99 bucket's floor to the median bucket's ceiling: a tail at least this long.
        tail_ratio = (p99[0] / p50[1]) if p50 and p99 and p50[1] > 0 and not math.isinf(p50[1]) else 0.0
        data["p99_over_p50_at_least"] = tail_ratio
        cold_lane_exists = Lane.COLD.value in inputs.lanes_present
        if lane == Lane.HOT.value and above_least > 0 and cold_lane_exists:
            severity = PROBLEM
            summary = f"at least {_n(above_least)} prompts above {_n(threshold)} tokens ran on the hot lane"
            action = ("long-context degrade should send these to the cold lane (it keeps them on hot only while the "
                      "cold lane's breaker is open or cannot fit them): check admission.long_context_threshold in "
                      "the serve config and the Router's degrade path (ray_llm_lanes_degrade_total"
                      f"{{reason=\"{REASON_LONG_CONTEXT}\"}}); one long prefill stalls every hot request's TTFT")
        elif near_least > 0:
            severity = WARN
            margin = _pct(1 - NEAR_MAX_MODEL_LEN_FRACTION)
            summary = f"at least {_n(near_least)} prompts within {margin} of max_model_len"
            action = ("each holds a whole max_model_len worth of KV blocks: find the clients sending them (Router "
                      "logs / traces), cap their context, or give them a lane with more KV per sequence "
                      "(python -m app.tools.kv_budget --context N shows how many fit)")
        elif tail_ratio >= PROMPT_TAIL_RATIO_WARN:
            severity = WARN
            summary = f"abnormally long contexts: p99 prompt is at least {tail_ratio:.0f}x the median"
            action = ("a few requests carry far longer contexts than the rest; under memory pressure they are the "
                      "ones that fill the KV cache: lower the long-context threshold so they degrade to the cold "
                      "lane, or cap them at the client")
        findings.append(Finding(FLOW_OOM, "long contexts", lane, severity, summary, evidence, action, data))
    return findings


def check_long_context_degrades(inputs: DoctorInputs) -> list[Finding]:
    """How many requests the Router sent to the cold lane for a long prompt, and their share of all traffic."""
    if inputs.metrics is None or not inputs.metrics.has(M_DEGRADE):
        return []
    by_class = _sum_by(inputs.metrics, M_DEGRADE,
                       lambda labels: labels.get("request_class") if labels.get("reason") == REASON_LONG_CONTEXT
                       else None)
    degraded = sum(by_class.values())
    requests = sum(s.value for s in inputs.metrics.select(M_REQUESTS))
    share = degraded / requests if requests else None
    evidence = (f"{_n(degraded)} long-context degrades {_since(inputs)}"
                + (f" of {_n(requests)} requests ({_pct(share)})" if share is not None else "")
                + (": " + ", ".join(f"{c} {_n(v)}" for c, v in sorted(by_class.items())) if by_class else ""))
    data = {"degraded": degraded, "requests": requests, "share": share, "by_class": by_class}
    if share is not None and share >= LONG_CONTEXT_SHARE_WARN:
        return [Finding(
            FLOW_OOM, "long-context degrade", "all", WARN,
            f"{_pct(share)} of requests have prompts above {_n(inputs.long_context_threshold)} tokens",
            evidence,
            "long contexts are a real share of traffic, not outliers: size the cold lane's KV cache for them "
            "(app.tools.kv_budget --lane cold --context N) and check the cold lane's preemptions below",
            data,
        )]
    return [Finding(FLOW_OOM, "long-context degrade", "all", OK, "long-context degrades are rare", evidence, "", data)]


def check_batched_tokens(inputs: DoctorInputs) -> list[Finding]:
    """max_num_batched_tokens vs the longest prompts: a prompt above it is prefilled in several chunked steps."""
    if inputs.metrics is None or not inputs.metrics.has(V_PROMPT_TOKENS + "_bucket"):
        return []
    findings = []
    for lane, hist in sorted(histograms(inputs.metrics, V_PROMPT_TOKENS, _lane_key(inputs)).items()):
        budget = inputs.lane_limits.get(lane, LaneLimits()).max_num_batched_tokens
        if budget is None or hist.count <= 0:
            continue
        p99, largest = hist.quantile_bucket(0.99), hist.largest_bucket()
        over_least, over_most = hist.count_above(budget)
        evidence = (f"max_num_batched_tokens {_n(budget)}; p99 prompt in {_bucket(p99)}, longest in "
                    f"{_bucket(largest)}; prompts above the budget: "
                    + (_n(over_least) if over_least == over_most else f"{_n(over_least)}-{_n(over_most)}")
                    + f" of {_n(hist.count)}")
        data = {"max_num_batched_tokens": budget, "p99_bucket": p99, "longest_bucket": largest,
                "above_budget": [over_least, over_most]}
        if p99 and p99[0] >= budget:
            steps = math.ceil(p99[0] / budget)
            findings.append(Finding(
                FLOW_OOM, "max_num_batched_tokens", lane, WARN,
                f"the p99 prompt needs at least {steps} prefill steps of {_n(budget)} tokens",
                evidence,
                "long prompts are prefilled in chunks that share each step with decodes: their TTFT grows with the "
                "chunk count and everyone's step time grows with the chunk size. Raise max_num_batched_tokens if "
                "KV headroom allows (vLLM sizes its activation reserve from it at start-up, so the KV pool shrinks), "
                "or lower the long-context threshold so these prompts run on the cold lane",
                data,
            ))
        else:
            findings.append(Finding(
                FLOW_OOM, "max_num_batched_tokens", lane, OK,
                "the p99 prompt fits one prefill step", evidence,
                "" if not over_least else "the few longer prompts are prefilled in chunks (chunked prefill)", data,
            ))
    return findings


def check_kv_pressure(inputs: DoctorInputs) -> list[Finding]:
    """KV usage near full with preemptions: vLLM's form of 'out of memory' (sequences are evicted and recomputed)."""
    findings, fine = [], []
    for r in inputs.replicas:
        if r.error is not None or (r.kv_cache_usage is None and r.preemptions is None):
            continue
        full = r.kv_cache_usage is not None and r.kv_cache_usage >= KV_FULL_FRACTION
        preempted = (r.preemptions or 0) > 0
        evidence = (f"KV {_pct(r.kv_cache_usage)} in use"
                    + (f" of {_n(r.kv_capacity_tokens)} tokens" if r.kv_capacity_tokens else "")
                    + f", {_n(r.preemptions) if r.preemptions is not None else 'unknown'} preemptions {_since(inputs)}"
                    + f", running {_n(r.running)}, waiting {_n(r.waiting)}")
        data = {"kv_cache_usage": r.kv_cache_usage, "kv_capacity_tokens": r.kv_capacity_tokens,
                "preemptions": r.preemptions}
        if full and preempted:
            findings.append(Finding(
                FLOW_OOM, "KV pressure", r.name, PROBLEM, "KV cache full and preempting sequences", evidence,
                "preempted sequences are recomputed from scratch (wasted GPU time, long tails): add replicas, use fp8 "
                "KV (extra_engine_args.kv_cache_dtype), raise gpu_memory_utilization, lower max_num_seqs or "
                "max_model_len, or move long prompts off this lane; then check with nvidia-smi -q -d MEMORY that the "
                "memory is the KV pool and not another process",
                data,
            ))
        elif full:
            findings.append(Finding(
                FLOW_OOM, "KV pressure", r.name, WARN, f"KV cache at least {_pct(KV_FULL_FRACTION)} full", evidence,
                "the next long prompt will preempt running sequences: watch ray_vllm_num_preemptions_total and "
                "consider the actions for KV pressure (more replicas, fp8 KV, lower max_num_seqs)",
                data,
            ))
        elif preempted:
            findings.append(Finding(
                FLOW_OOM, "KV pressure", r.name, WARN, "sequences were preempted for KV space", evidence,
                "the KV cache ran full at some point: look for bursts of long prompts (long contexts above) and "
                "re-run with --window-s to see whether it is still happening",
                data,
            ))
        else:
            fine.append(r)
    if fine:
        worst = max(fine, key=lambda r: r.kv_cache_usage or 0.0)
        findings.append(Finding(
            FLOW_OOM, "KV pressure", "all", OK, "no replica is short of KV cache",
            f"{len(fine)} replicas, highest KV use {_pct(worst.kv_cache_usage)} ({worst.name}), no preemptions "
            f"{_since(inputs)}",
            "", {"replicas": len(fine), "max_kv_cache_usage": worst.kv_cache_usage},
        ))
    return findings


# ==== flow 2: throughput drop ======================================================================================


def check_replica_scheduler(inputs: DoctorInputs) -> list[Finding]:
    """The guide's `stats['scheduler']['running']`, per replica: why requests wait instead of running."""
    findings, fine = [], []
    for r in inputs.replicas:
        if r.error is not None:
            findings.append(Finding(
                FLOW_THROUGHPUT, "engine stats", r.name, PROBLEM, "replica did not answer its stats call",
                f"error: {r.error}",
                "a replica that cannot answer within 5 s is stuck or restarting: check its state and logs in the "
                "Ray dashboard's Serve tab (HotLane / ColdLane) and `serve status`",
                {"error": r.error},
            ))
            continue
        if r.running is None and r.waiting is None:
            continue
        limit = r.max_num_seqs or inputs.lane_limits.get(r.lane, LaneLimits()).max_num_seqs
        gate_held = {c: v for c, v in r.gate_waiting_by_class.items() if v}
        evidence = (f"running {_n(r.running)}"
                    + (f" of max_num_seqs {_n(limit)}" if limit else "")
                    + f", waiting {_n(r.waiting)}, KV {_pct(r.kv_cache_usage)}"
                    + (f" of {_n(r.kv_capacity_tokens)} tokens" if r.kv_capacity_tokens else "")
                    + ("; waiting by reason: "
                       + ", ".join(f"{k} {_n(v)}" for k, v in sorted(r.waiting_by_reason.items()))
                       if r.waiting_by_reason else "")
                    + (f"; held by the replica's gate: {_classes(gate_held)}" if gate_held else ""))
        data = {"running": r.running, "waiting": r.waiting, "kv_cache_usage": r.kv_cache_usage,
                "max_num_seqs": limit, "waiting_by_reason": dict(r.waiting_by_reason), "source": r.source}
        if not (r.waiting or 0) > 0:
            if gate_held:
                findings.append(Finding(
                    FLOW_THROUGHPUT, "engine stats", r.name, WARN,
                    "requests wait in front of the engine, at the replica's realtime gate", evidence,
                    "realtime traffic is above the per-replica in-flight cap (admission.realtime_max_inflight, the "
                    "tuning guide's batch <= 4): add hot replicas, or raise the cap if the realtime TTFT goal holds",
                    {**data, "gate_waiting_by_class": gate_held},
                ))
            else:
                fine.append(r)
            continue
        if r.kv_cache_usage is not None and r.kv_cache_usage >= KV_FULL_FRACTION:
            findings.append(Finding(
                FLOW_THROUGHPUT, "engine stats", r.name, PROBLEM, "scheduler starved by a full KV cache", evidence,
                "waiting requests cannot get KV blocks: more replicas, fp8 KV, a higher gpu_memory_utilization, or "
                "shorter contexts on this lane (see KV pressure above)",
                data,
            ))
        elif limit and (r.running or 0) >= limit:
            findings.append(Finding(
                FLOW_THROUGHPUT, "engine stats", r.name, PROBLEM, "scheduler capped by max_num_seqs", evidence,
                f"KV has room ({_pct(r.kv_cache_usage)}) but all {_n(limit)} sequence slots are busy: raise "
                "max_num_seqs for this lane (python -m app.tools.kv_budget shows how many sequences fit), or add "
                "replicas",
                data,
            ))
        elif limit is None:
            findings.append(Finding(
                FLOW_THROUGHPUT, "engine stats", r.name, WARN, "requests wait while KV has room", evidence,
                "likely the max_num_seqs cap: pass --serve-config to compare running with it; if running is well "
                "below it, the engine is busy with long prefills (see max_num_batched_tokens)",
                data,
            ))
        else:
            findings.append(Finding(
                FLOW_THROUGHPUT, "engine stats", r.name, WARN,
                "requests wait with free KV and free sequence slots", evidence,
                "the engine is held up by something other than capacity: long chunked prefills (check "
                "max_num_batched_tokens), requests deferred by the scheduler (waiting by reason), or an engine step "
                "that is slow (profile it, see the long-tail section)",
                data,
            ))
    if fine:
        findings.append(Finding(
            FLOW_THROUGHPUT, "engine stats", "all", OK, "no requests waiting in any engine",
            "; ".join(f"{r.name}: running {_n(r.running)}, waiting {_n(r.waiting)}, KV {_pct(r.kv_cache_usage)}"
                      for r in fine),
            "", {"replicas": [r.replica_id for r in fine]},
        ))
    return findings


def check_routing_balance(inputs: DoctorInputs) -> list[Finding]:
    """Idle replicas next to an overloaded one in the same lane: the request router is not spreading load."""
    findings = []
    by_lane: dict[str, list[ReplicaStats]] = defaultdict(list)
    for r in inputs.replicas:
        if r.error is None and r.running is not None:
            by_lane[r.lane].append(r)
    for lane, replicas in sorted(by_lane.items()):
        if lane == UNKNOWN_LANE:
            continue
        if len(replicas) < 2:
            inputs.notes.append(f"routing balance of the {lane} lane not checked: 1 replica visible")
            continue
        busiest = max(replicas, key=lambda r: r.load)
        quietest = min(replicas, key=lambda r: r.load)
        evidence = "; ".join(f"{r.replica_id}: running {_n(r.running)}, waiting {_n(r.waiting)}" for r in replicas)
        data = {"loads": {r.replica_id: r.load for r in replicas}}
        idle_next_to_waiting = quietest.load == 0 and (busiest.waiting or 0) > 0
        lopsided = busiest.load >= IMBALANCE_MIN_LOAD and busiest.load >= IMBALANCE_LOAD_RATIO * (quietest.load + 1)
        if idle_next_to_waiting or lopsided:
            findings.append(Finding(
                FLOW_THROUGHPUT, "routing balance", lane, WARN,
                f"{quietest.replica_id} is {'idle' if quietest.load == 0 else 'nearly idle'} while "
                f"{busiest.replica_id} has {_n(busiest.load)} requests",
                evidence,
                "prefix affinity may be pinning a popular prefix to one replica: check the PrefixCache's imbalance "
                "bound and the pinned prefixes (GET /v1/admin/stats prefix_cache), and that every replica passed "
                "its health check (a replica that is not RUNNING gets no traffic)",
                data,
            ))
        else:
            findings.append(Finding(FLOW_THROUGHPUT, "routing balance", lane, OK,
                                    f"load is spread over {len(replicas)} replicas", evidence, "", data))
    return findings


def check_request_outcomes(inputs: DoctorInputs) -> list[Finding]:
    """Errors, timeouts and rejections among finished requests, per lane."""
    if inputs.metrics is None or not inputs.metrics.has(M_REQUESTS):
        return []
    counts = _sum_by(inputs.metrics, M_REQUESTS, lambda labels: (labels.get("lane", UNKNOWN_LANE),
                                                                 labels.get("outcome", "")))
    lanes = sorted({lane for lane, _ in counts})
    findings = []
    for lane in lanes:
        by_outcome = {outcome: v for (l, outcome), v in counts.items() if l == lane}
        total = sum(by_outcome.values())
        if total <= 0:
            continue
        errors = sum(by_outcome.get(o, 0.0) for o in ERROR_OUTCOMES)
        rejected = by_outcome.get(REJECTED_OUTCOME, 0.0)
        evidence = (f"{_n(total)} requests {_since(inputs)}: "
                    + ", ".join(f"{o} {_n(v)}" for o, v in sorted(by_outcome.items())))
        data = {"by_outcome": by_outcome, "error_share": errors / total, "rejected_share": rejected / total}
        subject = "rejected before a lane" if lane == "none" else lane
        if errors / total >= ERROR_SHARE_PROBLEM:
            severity, summary = PROBLEM, f"{_pct(errors / total)} of requests end in error or timeout"
        elif errors / total >= ERROR_SHARE_WARN:
            severity, summary = WARN, f"{_pct(errors / total)} of requests end in error or timeout"
        elif rejected / total >= REJECTED_SHARE_WARN:
            severity, summary = WARN, f"{_pct(rejected / total)} of requests rejected (load shedding)"
        else:
            findings.append(Finding(FLOW_THROUGHPUT, "request outcomes", subject, OK,
                                    "errors and rejections are rare", evidence, "", data))
            continue
        action = ("errors and timeouts: the Router's logs name the cause (engine errors, deadlines); an open breaker "
                  "or a restarting replica shows in the engine-stats findings"
                  if severity == PROBLEM or errors / total >= ERROR_SHARE_WARN else
                  "admission is shedding load (429 / 503): the lane is at capacity; add replicas or raise the "
                  "admission queue bounds if the latency goals allow")
        findings.append(Finding(FLOW_THROUGHPUT, "request outcomes", subject, severity, summary, evidence, action,
                                data))
    return findings


def _classes(counts: Mapping[str, float]) -> str:
    return ", ".join(f"{c} {_n(v)}" for c, v in sorted(counts.items()))


def check_admission_queue(inputs: DoctorInputs) -> list[Finding]:
    """Requests queued at the Router's admission: at capacity (engines busy), or stuck (engines idle)."""
    if not inputs.admission_queued:
        return []
    queued = {c: v for c, v in inputs.admission_queued.items() if v}
    if not queued:
        return [Finding(FLOW_THROUGHPUT, "admission queue", "router", OK, "nothing queued at admission",
                        "queued by class: " + _classes(inputs.admission_queued), "", {"queued": {}})]
    findings = []
    by_lane: dict[str, dict[str, float]] = defaultdict(dict)
    for request_class, count in queued.items():
        by_lane[CLASS_HOME_LANE.get(request_class, UNKNOWN_LANE)][request_class] = count
    for lane, counts in sorted(by_lane.items()):
        engines = [r for r in inputs.replicas if r.lane == lane and r.error is None and r.running is not None]
        load = sum(r.load for r in engines)
        evidence = f"queued at the Router: {_classes(counts)}; {lane} lane engines: {len(engines)}, {_n(load)} requests"
        data = {"queued": counts, "lane_replicas": len(engines), "lane_load": load}
        if engines and load == 0:
            findings.append(Finding(
                FLOW_THROUGHPUT, "admission queue", lane, PROBLEM, "admission holds requests while the engines idle",
                evidence,
                "the Router's queue is not being released: check its logs and the back-pressure state (GET "
                "/v1/admin/stats router); a breaker that is open or half-open also holds traffic",
                data,
            ))
        else:
            findings.append(Finding(
                FLOW_THROUGHPUT, "admission queue", lane, WARN, "requests queue at admission: the lane is at capacity",
                evidence,
                "their queue wait adds to TTFT: add replicas to this lane (or let interactive spill to cold earlier); "
                "the engine-stats findings say what limits each replica",
                data,
            ))
    return findings


def check_batch_backlog(inputs: DoctorInputs) -> list[Finding]:
    """A batch backlog with an idle cold lane: the dispatcher is not draining it into the engines."""
    if inputs.batch_backlog_lines is None:
        return []
    cold = [r for r in inputs.replicas if r.lane == Lane.COLD.value and r.error is None and r.running is not None]
    backlog = inputs.batch_backlog_lines
    cold_load = sum(r.load for r in cold)
    evidence = (f"{_n(backlog)} batch lines not finished; cold lane: {len(cold)} replicas, {_n(cold_load)} requests"
                + (f"; dispatcher window {_n(inputs.batch_window)}" if inputs.batch_window is not None else ""))
    data = {"backlog_lines": backlog, "cold_replicas": len(cold), "cold_load": cold_load,
            "batch_window": inputs.batch_window}
    if backlog > 0 and cold and cold_load == 0:
        return [Finding(
            FLOW_THROUGHPUT, "batch backlog", "cold", PROBLEM, "batch backlog waits while the cold lane is idle",
            evidence,
            "the dispatcher is not claiming lines: check the Router's dispatcher logs, the batch store "
            "(batch.store) and expired leases; a stuck lease returns after batch.lease_s",
            data,
        )]
    return [Finding(FLOW_THROUGHPUT, "batch backlog", "cold", OK,
                    "no backlog" if backlog <= 0 else "the cold lane is working on the backlog", evidence, "", data)]


def check_breakers(inputs: DoctorInputs) -> list[Finding]:
    """Circuit breakers per lane, when the stats document reports them."""
    findings = []
    for lane, state in sorted(inputs.breakers.items()):
        state_key = state.lower().replace("-", "_")
        if state_key == "open":
            findings.append(Finding(
                FLOW_THROUGHPUT, "circuit breaker", lane, PROBLEM, "breaker open: the lane refuses requests",
                f"breaker state {state}",
                "the lane failed repeatedly: its replicas' logs say why; interactive traffic spills to the other "
                "lane meanwhile, realtime and batch get 503 with Retry-After",
                {"state": state},
            ))
        elif state_key == "half_open":
            findings.append(Finding(FLOW_THROUGHPUT, "circuit breaker", lane, WARN,
                                    "breaker half-open: probing after failures", f"breaker state {state}",
                                    "watch whether it closes; if it re-opens the lane is still failing",
                                    {"state": state}))
    closed = {lane: state for lane, state in sorted(inputs.breakers.items())
              if state.lower().replace("-", "_") not in ("open", "half_open")}
    if closed:
        findings.append(Finding(FLOW_THROUGHPUT, "circuit breaker", "lanes", OK, "breakers closed",
                                ", ".join(f"{lane} {state}" for lane, state in closed.items()), "",
                                {"states": closed}))
    return findings


# ==== flow 3: long tail ============================================================================================


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


# TTFT by hop: the Router's own work plus the two Serve hops is "the request path"; WARN when it is at least this
# share of a class's median TTFT (on the H200 it is ~7 of 42 ms with Ray Serve's default replica settings, ~4 of 28
# with gpu-single.yaml's; docs/history.md, round 9).
PATH_SHARE_WARN = 0.5
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


# ==== running the checks ===========================================================================================


CHECKS: tuple[Callable[[DoctorInputs], list[Finding]], ...] = (
    check_prompt_lengths,
    check_long_context_degrades,
    check_batched_tokens,
    check_kv_pressure,
    check_replica_scheduler,
    check_routing_balance,
    check_request_outcomes,
    check_admission_queue,
    check_batch_backlog,
    check_breakers,
    check_latency_tails,
    check_tail_breakdown,
    check_slowest_traces,
    check_realtime_reserve,
    check_ttft_hops,
)


def run_checks(inputs: DoctorInputs) -> list[Finding]:
    findings: list[Finding] = []
    for check in CHECKS:
        findings.extend(check(inputs))
    return findings


def exit_code(findings: Iterable[Finding]) -> int:
    return 1 if any(f.severity == PROBLEM for f in findings) else 0


# ==== turning the app's documents into inputs (pure) ===============================================================


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None else None


def _breaker_state(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("state"), str):
        return value["state"]
    return None


@dataclass
class ParsedStats:
    replicas: list[ReplicaStats]
    breakers: dict[str, str]
    admission_queued: dict[str, float]
    batch_backlog_lines: float | None
    batch_window: float | None
    lanes_present: tuple[str, ...]
    notes: list[str]
    reserve_routing: dict[str, float] = field(default_factory=dict)


def _counts(value: Any) -> dict[str, float]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): n for k, v in value.items() if (n := _number(v)) is not None}


def parse_stats(document: Mapping[str, Any]) -> ParsedStats:
    """GET /v1/admin/stats -> ParsedStats. Tolerant: a lane may be a list of replica dicts, one replica dict, or a
    dict with `replicas` (and `breaker`); a replica entry that is `{"error": ...}` is a replica that did not answer;
    breakers come from `router.breakers` (or a top-level `breakers`), the admission queue from
    `router.queued_by_class`; unknown fields are ignored and missing ones stay None."""
    replicas: list[ReplicaStats] = []
    breakers: dict[str, str] = {}
    notes: list[str] = []
    lanes = document.get("lanes")
    if not isinstance(lanes, Mapping):
        notes.append("stats document has no `lanes`: engine stats not checked")
        lanes = {}
    for lane, entry in lanes.items():
        entries: list[Any]
        if isinstance(entry, list):
            entries = entry
        elif isinstance(entry, Mapping) and isinstance(entry.get("replicas"), list):
            entries = entry["replicas"]
            state = _breaker_state(entry.get("breaker") or entry.get("breaker_state"))
            if state:
                breakers[lane] = state
        elif isinstance(entry, Mapping):
            entries = [entry]
        else:
            continue
        for index, raw in enumerate(entries):
            if not isinstance(raw, Mapping):
                continue
            replica_id = str(raw.get("replica_id") or f"#{index}")
            if "error" in raw and raw.get("running") is None:
                replicas.append(ReplicaStats(lane=lane, replica_id=replica_id, error=str(raw["error"])))
                continue
            state = _breaker_state(raw.get("breaker") or raw.get("breaker_state"))
            if state and lane not in breakers:
                breakers[lane] = state
            replicas.append(ReplicaStats(
                lane=str(raw.get("lane") or lane),
                replica_id=replica_id,
                running=_number(raw.get("running")),
                waiting=_number(raw.get("waiting")),
                kv_cache_usage=_number(raw.get("kv_cache_usage")),
                kv_capacity_tokens=_int(raw.get("kv_capacity_tokens")),
                gate_waiting_by_class=_counts(raw.get("gate_waiting_by_class")),
                max_num_seqs=_int(raw.get("max_num_seqs")),
            ))
    router = document.get("router") if isinstance(document.get("router"), Mapping) else {}
    for source in (document.get("breakers"), document.get("breaker"), router.get("breakers")):
        if isinstance(source, Mapping):
            for lane, value in source.items():
                state = _breaker_state(value)
                if state:
                    breakers[lane] = state
    backlog = document.get("batch_backlog", document.get("batch_backlog_lines"))
    if isinstance(backlog, Mapping):
        backlog = next(
            (backlog[k] for k in ("lines", "pending_lines", "pending") if _number(backlog.get(k)) is not None), None
        )
    routing = router.get("replica_routing")
    hot_routing = routing.get("HotLane") if isinstance(routing, Mapping) else None
    reserve = _counts(hot_routing.get("reserve_routing")) if isinstance(hot_routing, Mapping) else {}
    return ParsedStats(replicas, breakers, _counts(router.get("queued_by_class")), _number(backlog),
                       _number(router.get("batch_window")), tuple(lanes), notes, reserve)


def merge_metric_replicas(replicas: list[ReplicaStats], metrics: MetricsSnapshot) -> list[ReplicaStats]:
    """Add vLLM's per-replica gauges: preemptions and waiting-by-reason for the replicas the stats listed, and
    whole entries for replicas it did not (the stats endpoint asks one replica per lane). Lane of a metrics-only
    replica: our own KV gauge carries both `lane` and `replica`."""
    def per_replica(name: str) -> dict[str, float]:
        return _sum_by(metrics, name, lambda labels: labels.get("ReplicaId") or None)

    running, waiting = per_replica(V_RUNNING), per_replica(V_WAITING)
    # KV usage is a per-engine fraction: average, not sum, over a replica's engines (data-parallel engines).
    kv_sum = per_replica(V_KV_USAGE)
    engine_counts: dict[str, int] = defaultdict(int)
    for s in metrics.select(V_KV_USAGE):
        if s.labels.get("ReplicaId"):
            engine_counts[s.labels["ReplicaId"]] += 1
    kv = {replica: total / engine_counts[replica] for replica, total in kv_sum.items()}
    preemptions = per_replica(V_PREEMPTIONS) or per_replica(V_PREEMPTIONS.removesuffix("_total"))
    by_reason: dict[str, dict[str, float]] = defaultdict(dict)
    for s in metrics.select(V_WAITING_BY_REASON):
        replica, reason = s.labels.get("ReplicaId"), s.labels.get("reason")
        if replica and reason:
            by_reason[replica][reason] = by_reason[replica].get(reason, 0.0) + s.value
    lanes = {s.labels["replica"]: s.labels["lane"] for s in metrics.select(M_KV_USAGE)
             if s.labels.get("replica") and s.labels.get("lane")}

    merged = []
    known = set()
    for r in replicas:
        known.add(r.replica_id)
        merged.append(ReplicaStats(**{
            **asdict(r),
            "preemptions": preemptions.get(r.replica_id, r.preemptions),
            "waiting_by_reason": by_reason.get(r.replica_id, dict(r.waiting_by_reason)),
        }))
    for replica_id in sorted(set(running) | set(waiting) | set(kv)):
        if replica_id in known:
            continue
        merged.append(ReplicaStats(
            lane=lanes.get(replica_id, UNKNOWN_LANE), replica_id=replica_id,
            running=running.get(replica_id), waiting=waiting.get(replica_id), kv_cache_usage=kv.get(replica_id),
            preemptions=preemptions.get(replica_id), waiting_by_reason=by_reason.get(replica_id, {}),
            source="metrics",
        ))
    return merged


def batch_backlog_from_metrics(metrics: MetricsSnapshot) -> float | None:
    # Every Router replica reports the same store-wide number: take the max, never the sum.
    values = [s.value for s in metrics.select(M_BATCH_BACKLOG)]
    return max(values) if values else None


def read_span_lines(text: str) -> list[dict[str, Any]]:
    """JSON-lines spans; a torn or foreign line is skipped (the file is appended by many processes)."""
    spans = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            span = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(span, dict):
            spans.append(span)
    return spans


def lane_limits_from_config(app_config: Any) -> dict[str, LaneLimits]:
    limits = {}
    for lane in LANES:
        lane_config = getattr(app_config, f"{lane}_lane", None)
        if lane_config is not None:
            limits[lane] = LaneLimits(lane_config.engine.max_num_seqs, lane_config.engine.max_num_batched_tokens)
    return limits


def long_context_threshold_from_config(app_config: Any) -> int | None:
    admission = getattr(app_config, "admission", None)
    return getattr(admission, "long_context_threshold", None)


# ==== fetching: the only part that touches the network and files ===================================================


class AppUnreachable(Exception):
    """The app's stats could not be read: nothing to diagnose."""


class ServeConfigUnreadable(Exception):
    """--serve-config was given but cannot be used: better to stop than to judge against wrong limits."""


def _get(client: Any, url: str) -> Any:
    import httpx

    try:
        response = client.get(url)
    except httpx.TimeoutException:
        raise AppUnreachable(f"GET {url} timed out") from None
    except httpx.HTTPError as error:
        raise AppUnreachable(f"cannot connect to {url}: {error}") from None
    if response.status_code != 200:
        raise AppUnreachable(f"GET {url} answered HTTP {response.status_code}: {response.text[:200]}")
    return response


def gather_inputs(
    url: str,
    metrics_url: str | None = DEFAULT_METRICS_URL,
    *,
    serve_config: str | None = None,
    app_name: str | None = None,
    trace_file: str | None = None,
    window_s: float = 0.0,
    timeout_s: float = 10.0,
    long_context_threshold: int | None = None,
    realtime_ttft_p99_goal_s: float = REALTIME_TTFT_P99_GOAL_S,
    slowest_traces: int = DEFAULT_SLOWEST_TRACES,
    sleep: Callable[[float], None] = time.sleep,
) -> DoctorInputs:
    import httpx

    base = url.rstrip("/")
    inputs = DoctorInputs(window_s=window_s, realtime_ttft_p99_goal_s=realtime_ttft_p99_goal_s,
                          slowest_traces=slowest_traces)
    threshold_from_config = None
    if serve_config:
        from app.tools.kv_budget import read_serve_config

        try:
            _, app_config = read_serve_config(serve_config, app_name)
        except (OSError, ValueError) as error:  # missing file, bad YAML, ConfigError (a ValueError)
            raise ServeConfigUnreadable(f"cannot read --serve-config {serve_config}: {error}") from None
        inputs.lane_limits = lane_limits_from_config(app_config)
        threshold_from_config = long_context_threshold_from_config(app_config)
    inputs.long_context_threshold = long_context_threshold or threshold_from_config or SCHEMA_LONG_CONTEXT_THRESHOLD

    with httpx.Client(timeout=timeout_s) as client:
        try:
            stats = _get(client, f"{base}/v1/admin/stats").json()
        except ValueError:
            raise AppUnreachable(
                f"GET {base}/v1/admin/stats did not return JSON: is {base} an llm-lanes app?"
            ) from None
        if not isinstance(stats, Mapping):
            raise AppUnreachable(f"GET {base}/v1/admin/stats returned {type(stats).__name__}, not a JSON object")
        parsed = parse_stats(stats)
        replicas = parsed.replicas
        inputs.breakers, inputs.admission_queued = parsed.breakers, parsed.admission_queued
        inputs.batch_backlog_lines, inputs.lanes_present = parsed.batch_backlog_lines, parsed.lanes_present
        inputs.batch_window, inputs.reserve_routing = parsed.batch_window, parsed.reserve_routing
        inputs.notes.extend(parsed.notes)

        try:
            models = _get(client, f"{base}/v1/models").json().get("data") or []
            inputs.max_model_len = next((_int(m.get("max_model_len")) for m in models if isinstance(m, Mapping)
                                         and _int(m.get("max_model_len"))), None)
        except (AppUnreachable, ValueError, AttributeError) as error:
            inputs.notes.append(f"max_model_len unknown ({error})")

        if metrics_url:
            try:
                earlier = MetricsSnapshot.parse(_get(client, metrics_url).text) if window_s > 0 else None
                if earlier is not None:
                    sleep(window_s)
                snapshot = MetricsSnapshot.parse(_get(client, metrics_url).text)
                inputs.metrics = snapshot.delta_since(earlier) if earlier is not None else snapshot
            except AppUnreachable as error:
                inputs.notes.append(f"metrics not read ({error}): histogram and preemption checks skipped; "
                                    "pass --metrics-url (Ray's metrics export port)")
            except ValueError as error:
                inputs.notes.append(f"metrics at {metrics_url} are not Prometheus text ({error}): skipped")
        else:
            inputs.notes.append("no --metrics-url: histogram and preemption checks skipped")

    if inputs.metrics is not None:
        replicas = merge_metric_replicas(replicas, inputs.metrics)
        if inputs.batch_backlog_lines is None:
            inputs.batch_backlog_lines = batch_backlog_from_metrics(inputs.metrics)
        if not inputs.metrics.has(V_RUNNING):
            inputs.notes.append("no ray_vllm_* metrics on the export port: vLLM's RayPrometheusStatLogger is not "
                                "installed, so prompt lengths, preemptions and engine phase times are not checked")
    inputs.replicas = replicas
    if not any(limits.max_num_batched_tokens for limits in inputs.lane_limits.values()):
        inputs.notes.append("engine limits unknown: pass --serve-config to compare with max_num_seqs and "
                            "max_num_batched_tokens")

    if trace_file:
        if os.path.exists(trace_file):
            with open(trace_file, encoding="utf-8", errors="replace") as f:
                inputs.spans = read_span_lines(f.read())
        else:
            inputs.notes.append(f"trace file {trace_file} not found: slowest traces skipped")
    return inputs


# ==== output =======================================================================================================


def render_text(findings: list[Finding], inputs: DoctorInputs, header: str, profiling: list[str]) -> str:
    lines = [header]
    if inputs.notes:
        lines += ["not checked / notes:"] + [f"  - {note}" for note in inputs.notes]
    for flow in (FLOW_OOM, FLOW_THROUGHPUT, FLOW_LONG_TAIL):
        in_flow = [f for f in findings if f.flow == flow]
        lines += ["", f"== {FLOW_TITLES[flow]} =="]
        if not in_flow:
            lines.append("  (no data for this flow)")
        for f in in_flow:
            lines.append(f"{f.severity:<8} {f.check} [{f.subject}]: {f.summary}")
            lines.append(f"{'':<9}evidence: {f.evidence}")
            if f.action:
                lines.append(f"{'':<9}action:   {f.action}")
        if flow == FLOW_LONG_TAIL:
            lines += ["", "how to profile (nsys):"] + [f"  {line}" for line in profiling]
    counts = {s: sum(f.severity == s for f in findings) for s in (PROBLEM, WARN, OK)}
    lines += ["", f"summary: {counts[PROBLEM]} PROBLEM, {counts[WARN]} WARN, {counts[OK]} OK "
                  f"(exit {exit_code(findings)})"]
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "+Inf"
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def render_json(findings: list[Finding], inputs: DoctorInputs, url: str, metrics_url: str | None,
                profiling: list[str]) -> str:
    return json.dumps(_json_safe({
        "url": url,
        "metrics_url": metrics_url,
        "window_s": inputs.window_s,
        "max_model_len": inputs.max_model_len,
        "exit_code": exit_code(findings),
        "findings": [asdict(f) for f in findings],
        "notes": inputs.notes,
        "replicas": [asdict(r) for r in inputs.replicas],
        "profiling": profiling,
    }), indent=2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app.tools.doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the app's HTTP base URL (default {DEFAULT_URL})")
    parser.add_argument("--metrics-url", default=DEFAULT_METRICS_URL,
                        help=f"Ray's metrics export endpoint (default {DEFAULT_METRICS_URL}); '' to skip")
    parser.add_argument("--serve-config", default=None,
                        help="serve config of the running app: engine limits (max_num_seqs, max_num_batched_tokens) "
                             "and the long-context threshold")
    parser.add_argument("--app-name", default=None, help="application in the serve config (default: the first)")
    parser.add_argument("--trace-file", default=None,
                        help="JSON-lines span file (tracing exporter 'file'); skipped if absent")
    parser.add_argument("--window-s", type=float, default=0.0,
                        help="scrape metrics twice this many seconds apart and judge the difference (default: "
                             "cumulative since start)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="HTTP timeout per call")
    parser.add_argument("--long-context-threshold", type=int, default=None,
                        help=f"prompt tokens above which a request should run on the cold lane (default: the serve "
                             f"config's, else {SCHEMA_LONG_CONTEXT_THRESHOLD})")
    parser.add_argument("--realtime-ttft-p99-s", type=float, default=REALTIME_TTFT_P99_GOAL_S,
                        help=f"realtime TTFT p99 goal (default {REALTIME_TTFT_P99_GOAL_S}, the tuning guide's)")
    parser.add_argument("--slowest", type=int, default=DEFAULT_SLOWEST_TRACES, help="slowest traces to list")
    parser.add_argument("--json", action="store_true", help="print findings as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    metrics_url = args.metrics_url or None
    try:
        inputs = gather_inputs(
            args.url, metrics_url, serve_config=args.serve_config, app_name=args.app_name,
            trace_file=args.trace_file, window_s=args.window_s, timeout_s=args.timeout_s,
            long_context_threshold=args.long_context_threshold, realtime_ttft_p99_goal_s=args.realtime_ttft_p99_s,
            slowest_traces=args.slowest,
        )
    except AppUnreachable as error:
        print(f"doctor: the app at {args.url} is not reachable: {error}\n"
              "Is it running (serve run serve_configs/...), and is --url its HTTP address?", file=sys.stderr)
        return 2
    except ServeConfigUnreadable as error:
        print(f"doctor: {error}", file=sys.stderr)
        return 2
    findings = run_checks(inputs)
    profiling = profiling_guidance(args.serve_config)
    if args.json:
        print(render_json(findings, inputs, args.url, metrics_url, profiling))
    else:
        header = (f"doctor: {args.url}" + (f", metrics {metrics_url}" if inputs.metrics is not None else "")
                  + (f", max_model_len {_n(inputs.max_model_len)}" if inputs.max_model_len else "")
                  + f", {len(inputs.replicas)} engine replicas"
                  + (f", window {inputs.window_s:g} s" if inputs.window_s else ", counters since start"))
        print(render_text(findings, inputs, header, profiling))
    return exit_code(findings)


if __name__ == "__main__":
    sys.exit(main())
