"""Queue-depth autoscaling: the pure target function and the Ray Serve 2.60 adapter (driven through Ray's own policy
loading and wrapping code, which applies the delays and bounds, without starting Ray)."""

from __future__ import annotations

import pytest

from app.batch.autoscaling import (
    METRIC_BACKLOG_TOKENS, METRIC_ENGINE_WAITING, METRIC_PENDING_LINES, ColdLanePolicy, ColdLaneScalingConfig,
    ColdLaneSignals, autoscaling_stats, target_replicas,
)
from app.config import QueueDepthTargets

TARGETS = {"target_lines_per_replica": 100, "target_backlog_tokens_per_replica": 10_000,
           "target_waiting_per_replica": 8, "target_ongoing_per_replica": 32}
CONFIG = ColdLaneScalingConfig(**TARGETS, scale_to_zero=False)


@pytest.mark.parametrize("signals, current, expected", [
    (ColdLaneSignals(), 1, 1),                                    # idle: min_replicas
    (ColdLaneSignals(pending_lines=100), 1, 1),                    # exactly one replica's worth
    (ColdLaneSignals(pending_lines=101), 1, 2),
    (ColdLaneSignals(pending_lines=250), 1, 3),
    (ColdLaneSignals(pending_lines=10, backlog_tokens=25_000), 1, 3),   # long requests: tokens dominate
    (ColdLaneSignals(pending_lines=10_000), 1, 4),                 # capped at max
    (ColdLaneSignals(ongoing_requests=64), 1, 2),
    (ColdLaneSignals(engine_waiting_requests=8), 1, 1),            # within what one engine may hold
    (ColdLaneSignals(engine_waiting_requests=20), 1, 3),           # 12 over -> +2 replicas
    (ColdLaneSignals(engine_waiting_requests=20), 2, 3),           # 2 x 8 allowed, 4 over -> +1
    (ColdLaneSignals(pending_lines=50), 3, 1),                     # backlog drained: scale down
])
def test_target_replicas(signals, current, expected):
    assert target_replicas(current, signals, CONFIG, 1, 4) == expected


def test_scale_to_zero_only_when_idle_and_enabled():
    zero = ColdLaneScalingConfig(**TARGETS, scale_to_zero=True)
    assert target_replicas(1, ColdLaneSignals(), zero, 0, 2) == 0
    assert target_replicas(0, ColdLaneSignals(pending_lines=1), zero, 0, 2) == 1
    assert target_replicas(1, ColdLaneSignals(ongoing_requests=1), zero, 0, 2) == 1
    assert target_replicas(1, ColdLaneSignals(), CONFIG, 0, 2) == 1


def test_config_validation():
    with pytest.raises(ValueError):
        ColdLaneScalingConfig(**{**TARGETS, "target_lines_per_replica": 0}, scale_to_zero=False)


def test_the_schema_targets_are_the_policy_kwargs():
    """app.main passes autoscaling.queue_depth's dump as policy_kwargs: every field must be one of the policy's."""
    policy = ColdLanePolicy(**QueueDepthTargets().model_dump())
    assert policy.config.target_lines_per_replica == QueueDepthTargets.model_fields["target_lines_per_replica"].default


# --- Ray Serve 2.60 adapter ---------------------------------------------------------------------------------------

ray_config = pytest.importorskip("ray.serve.config")
from ray.serve._private.autoscaling_state import _resolve_policy_callable  # noqa: E402
from ray.serve._private.common import DeploymentID, ReplicaID  # noqa: E402
from ray.serve.autoscaling_policy import _apply_autoscaling_config  # noqa: E402

POLICY_PATH = "app.batch.autoscaling:ColdLanePolicy"
POLICY_KWARGS = {**TARGETS, "scale_to_zero": False}


def make_context(deployment: DeploymentID, per_replica_metrics: list[dict[str, float]], *, total_requests=0.0,
                 target=None, policy_state=None, config=None, min_replicas=1, max_replicas=4, now=1000.0):
    replicas = [ReplicaID(f"r{i}", deployment) for i in range(len(per_replica_metrics))]
    aggregated: dict[str, dict] = {}
    for replica, metrics in zip(replicas, per_replica_metrics):
        for name, value in metrics.items():
            aggregated.setdefault(name, {})[replica] = value
    return ray_config.AutoscalingContext(
        deployment_id=deployment, deployment_name=deployment.name, app_name=deployment.app_name,
        current_num_replicas=len(replicas), target_num_replicas=len(replicas) if target is None else target,
        running_replicas=replicas, total_num_requests=total_requests, total_queued_requests=0.0,
        aggregated_metrics=lambda: aggregated, raw_metrics={}, capacity_adjusted_min_replicas=min_replicas,
        capacity_adjusted_max_replicas=max_replicas, policy_state=policy_state or {}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=now, config=config,
    )


def stats(pending=0, tokens=0, waiting=0) -> dict[str, float]:
    return autoscaling_stats(pending, tokens, waiting)


def test_policy_reads_custom_metrics_from_context():
    policy = ColdLanePolicy(**POLICY_KWARGS)
    cold = DeploymentID(name="ColdLane", app_name="llm-lanes")
    # Both replicas report the one shared store's backlog (max, not sum) and their own engine queue (sum).
    ctx = make_context(cold, [stats(250, 1000, 2), stats(250, 1000, 3)])
    target, state = policy(ctx)
    assert target == 3 and state["llm_lanes_cold_target"] == 3
    ctx = make_context(cold, [stats(0, 0, 14), stats(0, 0, 14)])
    assert policy(ctx)[0] == 4  # 28 waiting vs 16 allowed -> 2 + ceil(12 / 8)
    assert policy(make_context(cold, [stats(), stats()]))[0] == 1


def test_policy_loads_from_import_path_with_kwargs_and_runs_under_rays_wrapper():
    config = ray_config.AutoscalingConfig(
        min_replicas=1, max_replicas=3, upscale_delay_s=0, downscale_delay_s=0,
        policy={"policy_function": POLICY_PATH, "policy_kwargs": POLICY_KWARGS},
    )
    assert config.policy.policy_function == POLICY_PATH
    instance = _resolve_policy_callable(config.policy)  # what the Serve controller does
    assert isinstance(instance, ColdLanePolicy) and instance.config.target_lines_per_replica == 100
    wrapped = _apply_autoscaling_config(instance)
    cold = DeploymentID(name="ColdLane", app_name="llm-lanes")
    replicas, state = wrapped(make_context(cold, [stats(pending=1000)], config=config, max_replicas=3))
    assert replicas == 3  # bounded by max_replicas
    assert state["llm_lanes_cold_target"] == 3
    replicas, _ = wrapped(make_context(cold, [stats(pending=0), stats(pending=0), stats(pending=0)],
                                       config=config, max_replicas=3))
    assert replicas == 1


def test_rays_wrapper_applies_the_upscale_delay_itself():
    config = ray_config.AutoscalingConfig(
        min_replicas=1, max_replicas=3, upscale_delay_s=30, downscale_delay_s=600,
        policy={"policy_function": POLICY_PATH, "policy_kwargs": POLICY_KWARGS},
    )
    wrapped = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    cold = DeploymentID(name="ColdLane", app_name="llm-lanes")
    replicas, state = wrapped(make_context(cold, [stats(pending=300)], config=config, max_replicas=3))
    assert replicas == 1  # Ray holds the scale-up for upscale_delay_s: the adapter must not delay again
    assert state["llm_lanes_cold_target"] == 3


def test_autoscaling_stats_shape():
    assert autoscaling_stats(3, 40, 2) == {METRIC_PENDING_LINES: 3.0, METRIC_BACKLOG_TOKENS: 40.0,
                                           METRIC_ENGINE_WAITING: 2.0}
