"""What the doctor reasons about: severities and flows, the metric names it reads, the parsed inputs
(metrics snapshot, histograms, replicas, traces, DoctorInputs), a Finding, and the formatting of numbers in them."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from app.classes import CLASS_POLICIES, Lane
from app.observability import metrics as app_metrics
from app.tools.doctor.thresholds import DEFAULT_SLOWEST_TRACES, REALTIME_TTFT_P99_GOAL_S, SCHEMA_LONG_CONTEXT_THRESHOLD

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

