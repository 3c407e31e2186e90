"""Queue-depth autoscaling of the cold lane: a pure target-replica function plus the thin Ray Serve 2.60 policy
adapters around it.

Signals (per decision):
- pending batch lines (queued + in flight in the durable store) and their estimated token backlog;
- engine waiting requests (requests the vLLM schedulers hold but have not started), summed over cold replicas;
- ongoing requests at the cold replicas (Ray's own count).
Each signal gives a replica count (signal / per-replica target, rounded up); the largest wins, so any one kind of
pressure is enough to scale up, and scaling down needs all of them to be low.

Ray 2.60 wiring (verified against ray/serve/autoscaling_policy.py and _private/autoscaling_state.py):
- a custom policy is `policy(ctx: AutoscalingContext) -> tuple[int | float, dict]`; a *class* is instantiated once
  with `policy_kwargs` and then called per tick, which is how configuration reaches ColdLanePolicy;
- Ray wraps every custom policy with its own upscale_delay_s / downscale_delay_s / downscale_to_zero_delay_s and
  min/max bounds (`_apply_autoscaling_config`), so the adapter returns the undelayed target within the bounds Ray
  hands it (ctx.capacity_adjusted_min_replicas / _max_replicas);
- replicas report custom metrics by defining `record_autoscaling_stats(self) -> dict[str, float]` (sync or async) on
  the deployment class; the controller hands them to the policy as ctx.aggregated_metrics[name][replica_id].
This module imports nothing from Ray, nor from the rest of the app, at run time: Ray pickles the policy's module by
value into the controller. Its targets are the schema's `autoscaling.queue_depth` (app.config.QueueDepthTargets),
passed by app.main as policy_kwargs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # only for annotations; the controller needs no import of ours
    from ray.serve.config import AutoscalingContext

# Custom metric names the cold replicas (or the router) return from record_autoscaling_stats().
METRIC_PENDING_LINES = "llm_lanes_batch_pending_lines"
METRIC_BACKLOG_TOKENS = "llm_lanes_batch_backlog_tokens"
METRIC_ENGINE_WAITING = "llm_lanes_engine_waiting_requests"


@dataclass(frozen=True)
class ColdLaneScalingConfig:
    """The queue-depth targets: the fields of app.config.QueueDepthTargets (their defaults live there)."""

    # One replica per this many pending batch lines (queued + in flight).
    target_lines_per_replica: float
    # One replica per this many backlog tokens (prompt + completion estimates of pending lines).
    target_backlog_tokens_per_replica: float
    # Waiting requests one replica's engine may hold before it counts as saturated.
    target_waiting_per_replica: float
    # Requests in flight per replica (the concurrency window's upper bound).
    target_ongoing_per_replica: float
    # Allow 0 replicas when there is no work at all (Ray also needs min_replicas: 0 in autoscaling_config).
    scale_to_zero: bool

    def __post_init__(self) -> None:
        for name in ("target_lines_per_replica", "target_backlog_tokens_per_replica", "target_waiting_per_replica",
                     "target_ongoing_per_replica"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(frozen=True)
class ColdLaneSignals:
    pending_lines: float = 0.0
    backlog_tokens: float = 0.0
    engine_waiting_requests: float = 0.0  # total over the cold replicas
    ongoing_requests: float = 0.0  # total over the cold replicas

    @property
    def idle(self) -> bool:
        return not (self.pending_lines or self.backlog_tokens or self.engine_waiting_requests or self.ongoing_requests)


def target_replicas(current_replicas: int, signals: ColdLaneSignals, config: ColdLaneScalingConfig,
                    min_replicas: int, max_replicas: int) -> int:
    """Replicas the cold lane needs for these signals right now (no delays), within [min_replicas, max_replicas]."""
    by_lines = math.ceil(signals.pending_lines / config.target_lines_per_replica)
    by_tokens = math.ceil(signals.backlog_tokens / config.target_backlog_tokens_per_replica)
    by_ongoing = math.ceil(signals.ongoing_requests / config.target_ongoing_per_replica)
    # Waiting requests say the replicas there are already full: add capacity for the excess over what they may hold.
    allowed_waiting = max(current_replicas, 1) * config.target_waiting_per_replica
    excess_waiting = max(0.0, signals.engine_waiting_requests - allowed_waiting)
    by_waiting = (current_replicas + math.ceil(excess_waiting / config.target_waiting_per_replica)
                  if excess_waiting > 0 else 0)
    wanted = max(by_lines, by_tokens, by_ongoing, by_waiting)
    floor = 0 if (config.scale_to_zero and signals.idle) else max(min_replicas, 1)
    return min(max(max_replicas, 1), max(floor, wanted))


# --- Ray Serve 2.60 adapters ----------------------------------------------------------------------------------------

def _metric_values(ctx: "AutoscalingContext", name: str) -> list[float]:
    metrics = ctx.aggregated_metrics or {}
    return [float(v) for v in (metrics.get(name) or {}).values() if v is not None]


def signals_from_context(ctx: "AutoscalingContext") -> ColdLaneSignals:
    """Read the cold lane's signals from one deployment's AutoscalingContext.

    Backlog metrics describe the one shared store, so every replica reports the same number: take the max (a sum
    would count the backlog once per replica). Engine waiting requests are per replica: sum them.
    """
    pending = _metric_values(ctx, METRIC_PENDING_LINES)
    tokens = _metric_values(ctx, METRIC_BACKLOG_TOKENS)
    waiting = _metric_values(ctx, METRIC_ENGINE_WAITING)
    return ColdLaneSignals(
        pending_lines=max(pending, default=0.0),
        backlog_tokens=max(tokens, default=0.0),
        engine_waiting_requests=sum(waiting),
        ongoing_requests=float(ctx.total_num_requests or 0.0),
    )


def _config_from_kwargs(kwargs: Mapping[str, Any]) -> ColdLaneScalingConfig:
    # Delays and bounds belong to Ray's autoscaling_config (Ray applies them); ignore copies passed here.
    allowed = {k: v for k, v in kwargs.items() if k in ColdLaneScalingConfig.__dataclass_fields__}
    return ColdLaneScalingConfig(**allowed)


class ColdLanePolicy:
    """Deployment-level Ray Serve policy for ColdLane.

    autoscaling_config:
      min_replicas / max_replicas / upscale_delay_s / downscale_delay_s: Ray's own keys (Ray applies them)
      policy:
        policy_function: "app.batch.autoscaling:ColdLanePolicy"
        policy_kwargs: {target_lines_per_replica: ..., target_backlog_tokens_per_replica: ...,
                        target_waiting_per_replica: ..., target_ongoing_per_replica: ..., scale_to_zero: ...}
    """

    def __init__(self, **policy_kwargs: Any):
        self.config = _config_from_kwargs(policy_kwargs)

    def __call__(self, ctx: "AutoscalingContext") -> tuple[int, dict[str, Any]]:
        signals = signals_from_context(ctx)
        target = target_replicas(ctx.current_num_replicas, signals, self.config, ctx.capacity_adjusted_min_replicas,
                                 ctx.capacity_adjusted_max_replicas)
        # Returned state is kept by Ray between ticks (merged with its own delay bookkeeping); for inspection only.
        return target, {"llm_lanes_cold_target": target, "llm_lanes_cold_pending_lines": signals.pending_lines}


def autoscaling_stats(pending_lines: int, backlog_tokens: int, engine_waiting_requests: int) -> dict[str, float]:
    """What a replica's record_autoscaling_stats() returns (Ray requires dict[str, int | float])."""
    return {
        METRIC_PENDING_LINES: float(pending_lines),
        METRIC_BACKLOG_TOKENS: float(backlog_tokens),
        METRIC_ENGINE_WAITING: float(engine_waiting_requests),
    }
