"""llm-lanes metrics, defined once as data and built lazily inside a Serve replica with ray.serve.metrics.

Why lazily: ray.serve.metrics objects pick up the replica context (deployment, replica, application tags) when they
are constructed, so they must be created in the replica's __init__, not at import. This module imports no Ray at
import time; `LlmLanesMetrics()` imports ray.serve.metrics when a replica builds it.

Labels Serve adds by itself inside a replica: deployment, replica (the replica's unique id: the same value vLLM's
own metrics carry as ReplicaId) and application. They are reserved: tag_keys here must not use them, so the
per-replica metrics (KV usage, prefix hit rate) are set by the lane replica itself and get `replica` from Serve.

On Ray's metrics export port every name gets Ray's "ray_" prefix: llm_lanes_ttft_seconds is scraped as
ray_llm_lanes_ttft_seconds_bucket/_sum/_count, llm_lanes_requests_total as ray_llm_lanes_requests_total.

Inter-token latency per token is not re-measured here: vLLM's own histogram (ray_vllm_inter_token_latency_seconds,
exported through RayPrometheusStatLogger) has it; we keep one TPOT observation per request.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

METRIC_PREFIX = "llm_lanes_"
RAY_EXPORT_PREFIX = "ray_"  # what Ray puts in front of every application metric on its export port
SERVE_RESERVED_TAGS = frozenset({"deployment", "replica", "application"})

# Label values used across the app (label *values* are free strings; these keep dashboards and code in step).
LANE_NONE = "none"  # a request rejected before a lane was picked
OUTCOME_SUCCESS, OUTCOME_ERROR, OUTCOME_REJECTED, OUTCOME_CANCELLED, OUTCOME_TIMEOUT = (
    "success", "error", "rejected", "cancelled", "timeout")
OUTCOMES = (OUTCOME_SUCCESS, OUTCOME_ERROR, OUTCOME_REJECTED, OUTCOME_CANCELLED, OUTCOME_TIMEOUT)
ADMISSION_DECISIONS = ("admit", "queue", "reject")
TOKEN_KINDS = ("prompt", "output")  # the `kind` label of llm_lanes_model_tokens_total

# Bucket boundaries (seconds). Each list includes the numbers we make claims about, so a quantile near a goal
# is read off a boundary instead of interpolated across a wide bucket.
# TTFT: realtime goal P99 < 450 ms (0.45); batch-class requests can wait minutes in the cold lane.
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0, 300.0,
)  # fmt: skip
# TPOT: per-token decode time; ~10-50 ms on a GPU, slower on CPU.
TPOT_BUCKETS_S: tuple[float, ...] = (
    0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
)  # fmt: skip
# E2E: from Router arrival to last byte; long generations and queued batch work run to many minutes.
E2E_BUCKETS_S: tuple[float, ...] = (
    0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip
# Router decision time (classify + admit + pick lane/replica, no queue wait): goal p50 <= 2 ms.
ROUTER_DECISION_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1,
)  # fmt: skip
# Admission queue wait: realtime should see ~0; interactive waits under load until its deadline.
QUEUE_WAIT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] | None = None

    def exported_names(self) -> tuple[str, ...]:
        """The sample names Prometheus scrapes from Ray's metrics export port."""
        base = RAY_EXPORT_PREFIX + self.name
        if self.kind == "histogram":
            return (base + "_bucket", base + "_sum", base + "_count")
        return (base,)


TTFT = MetricSpec(
    "llm_lanes_ttft_seconds",
    "histogram",
    "Time to first token, from Router arrival to the first streamed token.",
    ("lane", "request_class"),
    TTFT_BUCKETS_S,
)
TPOT = MetricSpec(
    "llm_lanes_tpot_seconds",
    "histogram",
    "Time per output token after the first: (e2e - ttft) / (output tokens - 1), one observation per request.",
    ("lane", "request_class"),
    TPOT_BUCKETS_S,
)
E2E = MetricSpec(
    "llm_lanes_e2e_seconds",
    "histogram",
    "End-to-end request latency at the Router, arrival to last token.",
    ("lane", "request_class"),
    E2E_BUCKETS_S,
)
REQUESTS = MetricSpec(
    "llm_lanes_requests_total",
    "counter",
    "Finished requests by lane, class, outcome (success|error|rejected|cancelled|timeout) and HTTP status.",
    ("lane", "request_class", "outcome", "status"),
)
OUTPUT_TOKENS = MetricSpec(
    "llm_lanes_output_tokens_total",
    "counter",
    "Generated tokens by lane and class (from each finished request's usage): the throughput panels' source.",
    ("lane", "request_class"),
)
# Per model: the name a request was served under (the base model's served name or an adapter's), from the bounded set
# of app/observability/model_labels.py.
MODEL_REQUESTS = MetricSpec(
    "llm_lanes_model_requests_total",
    "counter",
    "Finished generation requests by the model they were served under and outcome "
    "(success|error|rejected|cancelled|timeout).",
    ("model", "outcome"),
)
MODEL_TOKENS = MetricSpec(
    "llm_lanes_model_tokens_total",
    "counter",
    "Tokens by the model they were served under and kind: prompt (requests the lane answered) or output.",
    ("model", "kind"),
)
MODEL_TTFT = MetricSpec(
    "llm_lanes_model_ttft_seconds",
    "histogram",
    "Time to first token by the model the request was served under (streamed requests).",
    ("model",),
    TTFT_BUCKETS_S,
)
QUEUE_DEPTH = MetricSpec(
    "llm_lanes_queue_depth",
    "gauge",
    "Requests waiting in this Router replica's admission queue, per class.",
    ("request_class",),
)
QUEUE_WAIT = MetricSpec(
    "llm_lanes_queue_wait_seconds",
    "histogram",
    "Time a request waited in the admission queue before it was admitted.",
    ("request_class",),
    QUEUE_WAIT_BUCKETS_S,
)
ADMISSION_DECISIONS_TOTAL = MetricSpec(
    "llm_lanes_admission_decisions_total",
    "counter",
    "Admission decisions (admit|queue|reject) and the reason for each.",
    ("decision", "reason", "request_class"),
)
DEGRADE = MetricSpec(
    "llm_lanes_degrade_total",
    "counter",
    "Requests sent off their class's normal path (long-prompt degrade, hot-lane spill) by reason.",
    ("reason", "request_class"),
)
ROUTER_DECISION = MetricSpec(
    "llm_lanes_router_decision_seconds",
    "histogram",
    "Router overhead per request: classify + admit + lane/replica choice, without queue wait.",
    ("request_class",),
    ROUTER_DECISION_BUCKETS_S,
)
REQUEST_RECEIVE = MetricSpec(
    "llm_lanes_request_receive_seconds",
    "histogram",
    "Arrival (the HTTP proxy's stamp, else the Router's) to the request's body in hand: Serve's HTTP proxy queues "
    "requests and hands the body over when the Router asks for it, so a busy proxy shows here. The Router's TTFT "
    "and E2E start after it; its admission counts it.",
    (),
    TTFT_BUCKETS_S,
)
REPLICA_ROUTING = MetricSpec(
    "llm_lanes_replica_routing_seconds",
    "histogram",
    "Choosing a lane replica (prefix-index lookup + load), per decision, by the policy's reason.",
    ("lane", "reason"),
    ROUTER_DECISION_BUCKETS_S,
)
KV_CACHE_USAGE = MetricSpec(
    "llm_lanes_kv_cache_usage",
    "gauge",
    "Fraction (0-1) of this lane replica's KV cache blocks in use; `replica` comes from Serve.",
    ("lane",),
)
PREFIX_CACHE_HIT_RATE = MetricSpec(
    "llm_lanes_prefix_cache_hit_rate",
    "gauge",
    "Fraction (0-1) of prompt tokens served from this lane replica's prefix cache over the recent window.",
    ("lane",),
)
BATCH_BACKLOG = MetricSpec(
    "llm_lanes_batch_backlog_lines",
    "gauge",
    "Batch-API request lines not yet finished (queued + running), read from the shared batch store.",
)

METRIC_SPECS: tuple[MetricSpec, ...] = (
    TTFT,
    TPOT,
    E2E,
    REQUESTS,
    OUTPUT_TOKENS,
    MODEL_REQUESTS,
    MODEL_TOKENS,
    MODEL_TTFT,
    QUEUE_DEPTH,
    QUEUE_WAIT,
    ADMISSION_DECISIONS_TOTAL,
    DEGRADE,
    ROUTER_DECISION,
    REQUEST_RECEIVE,
    KV_CACHE_USAGE,
    PREFIX_CACHE_HIT_RATE,
    BATCH_BACKLOG,
    REPLICA_ROUTING,
)
METRICS_BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in METRIC_SPECS}


def _enum_value(value: Any) -> str:
    """Tag values must be str: RequestClass/Lane enums give their .value, status codes their digits."""
    return str(getattr(value, "value", value))


def build_metric(spec: MetricSpec, metrics_module: ModuleType) -> Any:
    if spec.kind == "counter":
        return metrics_module.Counter(spec.name, description=spec.description, tag_keys=spec.tag_keys)
    if spec.kind == "gauge":
        return metrics_module.Gauge(spec.name, description=spec.description, tag_keys=spec.tag_keys)
    if spec.kind == "histogram":
        return metrics_module.Histogram(
            spec.name, description=spec.description, boundaries=list(spec.boundaries or ()), tag_keys=spec.tag_keys
        )
    raise ValueError(f"unknown metric kind {spec.kind!r} for {spec.name}")


class LlmLanesMetrics:
    """All llm-lanes metrics of one replica. Create it in the replica's __init__ (each deployment uses the
    methods that concern it; unused metrics cost nothing until recorded)."""

    def __init__(self, metrics_module: ModuleType | None = None):
        module = metrics_module if metrics_module is not None else importlib.import_module("ray.serve.metrics")
        self._metrics: dict[str, Any] = {spec.name: build_metric(spec, module) for spec in METRIC_SPECS}

    def _tags(self, spec: MetricSpec, values: Mapping[str, Any]) -> dict[str, str]:
        return {key: _enum_value(values[key]) for key in spec.tag_keys}

    def _observe(self, spec: MetricSpec, value: float, **tags: Any) -> None:
        self._metrics[spec.name].observe(float(value), tags=self._tags(spec, tags))

    def _inc(self, spec: MetricSpec, **tags: Any) -> None:
        self._metrics[spec.name].inc(1.0, tags=self._tags(spec, tags))

    def _set(self, spec: MetricSpec, value: float, **tags: Any) -> None:
        self._metrics[spec.name].set(float(value), tags=self._tags(spec, tags))

    # Router: per-request latencies (lane = where it was served).
    def observe_ttft(self, seconds: float, *, lane: Any, request_class: Any) -> None:
        self._observe(TTFT, seconds, lane=lane, request_class=request_class)

    def observe_tpot(self, seconds: float, *, lane: Any, request_class: Any) -> None:
        self._observe(TPOT, seconds, lane=lane, request_class=request_class)

    def observe_e2e(self, seconds: float, *, lane: Any, request_class: Any) -> None:
        self._observe(E2E, seconds, lane=lane, request_class=request_class)

    def count_request(self, *, lane: Any, request_class: Any, outcome: str, status: int | str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome {outcome!r} is not one of {OUTCOMES}")
        self._inc(REQUESTS, lane=lane, request_class=request_class, outcome=outcome, status=status)

    def count_output_tokens(self, tokens: int, *, lane: Any, request_class: Any) -> None:
        if tokens > 0:  # Ray counters reject increments <= 0
            self._metrics[OUTPUT_TOKENS.name].inc(
                float(tokens), tags=self._tags(OUTPUT_TOKENS, {"lane": lane, "request_class": request_class})
            )

    # Router: per model (`model` from app/observability/model_labels.py).
    def count_model_request(self, *, model: str, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome {outcome!r} is not one of {OUTCOMES}")
        self._inc(MODEL_REQUESTS, model=model, outcome=outcome)

    def count_model_tokens(self, tokens: int, *, model: str, kind: str) -> None:
        if kind not in TOKEN_KINDS:
            raise ValueError(f"token kind {kind!r} is not one of {TOKEN_KINDS}")
        if tokens > 0:  # Ray counters reject increments <= 0
            self._metrics[MODEL_TOKENS.name].inc(float(tokens),
                                                 tags=self._tags(MODEL_TOKENS, {"model": model, "kind": kind}))

    def observe_model_ttft(self, seconds: float, *, model: str) -> None:
        self._observe(MODEL_TTFT, seconds, model=model)

    # Router: admission.
    def set_queue_depth(self, depth: int, *, request_class: Any) -> None:
        self._set(QUEUE_DEPTH, depth, request_class=request_class)

    def observe_queue_wait(self, seconds: float, *, request_class: Any) -> None:
        self._observe(QUEUE_WAIT, seconds, request_class=request_class)

    def count_admission(self, *, decision: str, reason: str, request_class: Any) -> None:
        if decision not in ADMISSION_DECISIONS:
            raise ValueError(f"decision {decision!r} is not one of {ADMISSION_DECISIONS}")
        self._inc(ADMISSION_DECISIONS_TOTAL, decision=decision, reason=reason, request_class=request_class)

    def count_degrade(self, *, reason: str, request_class: Any) -> None:
        self._inc(DEGRADE, reason=reason, request_class=request_class)

    def observe_router_decision(self, seconds: float, *, request_class: Any) -> None:
        self._observe(ROUTER_DECISION, seconds, request_class=request_class)

    def observe_request_receive(self, seconds: float) -> None:
        self._observe(REQUEST_RECEIVE, seconds)

    def observe_replica_routing(self, seconds: float, *, lane: str, reason: str) -> None:
        self._observe(REPLICA_ROUTING, seconds, lane=lane, reason=reason)

    # Lane replicas: engine state (replica label from Serve).
    def set_kv_cache_usage(self, fraction: float, *, lane: Any) -> None:
        self._set(KV_CACHE_USAGE, fraction, lane=lane)

    def set_prefix_cache_hit_rate(self, rate: float, *, lane: Any) -> None:
        self._set(PREFIX_CACHE_HIT_RATE, rate, lane=lane)

    # Batch dispatcher.
    def set_batch_backlog(self, lines: int) -> None:
        self._set(BATCH_BACKLOG, lines)


def tpot_seconds(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """TPOT as vLLM and most benchmarks define it; None when there is no second token to time."""
    if output_tokens < 2:
        return None
    return max(e2e_s - ttft_s, 0.0) / (output_tokens - 1)
