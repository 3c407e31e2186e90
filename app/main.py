"""build_app(args) -> the llm-lanes Serve application. A pure builder: nothing happens at import.

Serve configs point here (`import_path: app.main:build_app`) and pass the `args:` block, which is validated once
against app/config/ before anything is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray.serve import Application

from app.config import AppConfig, LaneConfig, load_app_config, placement_group_bundles


def _resolve_local_paths(cfg: AppConfig) -> AppConfig:
    """Relative model paths are relative to where `serve run` starts; replicas run elsewhere, so make them absolute."""
    model = cfg.model
    updates = {}
    for field in ("source", "tokenizer"):
        value = getattr(model, field)
        if value and not Path(value).is_absolute() and Path(value).exists():
            updates[field] = str(Path(value).resolve())
    if updates:
        cfg = cfg.model_copy(update={"model": model.model_copy(update=updates)})
    if not cfg.batch.is_postgres and not Path(cfg.batch.store).is_absolute():
        store = str(Path(cfg.batch.store).resolve())
        cfg = cfg.model_copy(update={"batch": cfg.batch.model_copy(update={"store": store})})
    return cfg


# How often Serve asks each lane replica for its routing stats (KV usage, weighed by the affinity router).
ROUTING_STATS_PERIOD_S = 1.0


def lane_request_router_config(cfg: AppConfig, lane: LaneConfig) -> dict[str, Any]:
    """The lane's `request_router_config`: prefix-affinity routing, or Serve's power-of-two-choices (asked for, or a
    lane of one replica: nothing to choose). Either reports the replicas it can route to, which the Router reads
    to serve a lane's requests on the other lane while it has none (app/prefix_cache/replica_sets.py)."""
    settings = cfg.prefix_cache
    if settings.routing != "affinity" or not cfg.keeps_prefix_index(lane):
        return {"request_router_class": "app.prefix_cache.request_router:LaneRouter"}
    return {
        "request_router_class": "app.prefix_cache.request_router:PrefixAffinityRouter",
        "request_router_kwargs": {
            # The typed prefix_cache settings (the router validates them back into PrefixCacheConfig).
            "settings": settings.model_dump(mode="json"),
            "block_size": lane.engine.block_size,
            # Only the hot lane keeps replicas for realtime requests (the cold lane serves none).
            "realtime_reserved_replicas": cfg.admission.realtime_reserved_hot_replicas if lane is cfg.hot_lane else 0,
        },
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
    }


def lane_deployment_options(lane: LaneConfig, cfg: AppConfig | None = None) -> dict[str, Any]:
    """Ray Serve options of one lane, derived from the schema (placement group from tensor_parallel_size;
    request router, prefix affinity or not, when `cfg` is given)."""
    settings = lane.deployment
    bundles = placement_group_bundles(lane)
    options: dict[str, Any] = {
        "max_ongoing_requests": settings.max_ongoing_requests,
        "health_check_period_s": settings.health_check_period_s,
        "health_check_timeout_s": settings.health_check_timeout_s,
        "graceful_shutdown_timeout_s": settings.graceful_shutdown_timeout_s,
        "ray_actor_options": {"num_cpus": settings.num_cpus, "num_gpus": 0 if bundles else settings.num_gpus},
    }
    if settings.resources:
        options["ray_actor_options"]["resources"] = dict(settings.resources)
    if settings.env_vars:
        options["ray_actor_options"]["runtime_env"] = {"env_vars": dict(settings.env_vars)}
    if bundles:
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = settings.placement_group_strategy
    if settings.autoscaling:
        scaling = settings.autoscaling
        options["num_replicas"] = "auto"
        options["autoscaling_config"] = {
            "min_replicas": scaling.min_replicas,
            "max_replicas": scaling.max_replicas,
            "initial_replicas": scaling.initial_replicas,
            "target_ongoing_requests": scaling.target_ongoing_requests,
            "upscale_delay_s": scaling.upscale_delay_s,
            "downscale_delay_s": scaling.downscale_delay_s,
            "metrics_interval_s": scaling.metrics_interval_s,
            "look_back_period_s": scaling.look_back_period_s,
        }
        if scaling.queue_depth:
            options["autoscaling_config"]["policy"] = {
                "policy_function": "app.batch.autoscaling:ColdLanePolicy",
                "policy_kwargs": scaling.queue_depth.model_dump(),
            }
    else:
        options["num_replicas"] = settings.num_replicas
    if cfg is not None:
        from ray.serve.config import RequestRouterConfig

        options["request_router_config"] = RequestRouterConfig(**lane_request_router_config(cfg, lane))
    return options


def build_app(args: dict[str, Any]) -> Application:
    # Imported here so that importing app.main stays cheap and side-effect free.
    from app.lanes.cold import ColdLane
    from app.lanes.hot import HotLane
    from app.prefix_cache.deployment import PrefixCache
    from app.prefix_cache.replica_feed import ReplicaPrefixFeed
    from app.router.deployment import Router

    cfg = _resolve_local_paths(load_app_config(args))
    app_args = cfg.model_dump(mode="json")
    prefix_cache = PrefixCache.options(
        num_replicas=1, ray_actor_options={"num_cpus": cfg.prefix_cache.num_cpus},
        # Internal and busy (feeds every 50 ms per lane replica, each Router's index pull every 0.1 s): an access
        # log line per call would bury everything else in its log. Errors are still logged.
        logging_config={"enable_access_log": False},
    ).bind(app_args)
    hot = HotLane.options(**lane_deployment_options(cfg.hot_lane, cfg)).bind(app_args, prefix_cache, ReplicaPrefixFeed)
    cold = (ColdLane.options(**lane_deployment_options(cfg.cold_lane, cfg))
            .bind(app_args, prefix_cache, ReplicaPrefixFeed) if cfg.cold_lane is not None else None)
    router = Router.options(
        num_replicas=cfg.router.num_replicas,
        max_ongoing_requests=cfg.router.max_ongoing_requests,
        graceful_shutdown_timeout_s=cfg.router.graceful_shutdown_timeout_s,
        ray_actor_options={"num_cpus": cfg.router.num_cpus},
    ).bind(app_args, hot, cold, prefix_cache)
    return router
