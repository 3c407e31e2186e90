"""The doctor's inputs: turning the app's documents into a DoctorInputs record (pure), and fetching them (the only
part that touches the network and files)."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from app.tools.doctor.model import (
    LANES, M_BATCH_BACKLOG, M_KV_USAGE, UNKNOWN_LANE, V_KV_USAGE, V_PREEMPTIONS, V_RUNNING, V_WAITING,
    V_WAITING_BY_REASON, DoctorInputs, LaneLimits, MetricsSnapshot, ReplicaStats, _sum_by,
)
from app.tools.doctor.thresholds import DEFAULT_SLOWEST_TRACES, REALTIME_TTFT_P99_GOAL_S, SCHEMA_LONG_CONTEXT_THRESHOLD

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_METRICS_URL = "http://127.0.0.1:8080/metrics"


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
        from app.tools.kv_budget.inputs import read_serve_config

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

