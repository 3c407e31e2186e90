"""The Router deployment: wiring only. It builds the request pipeline and the batch dispatcher, reads replica counts
from Serve, and carries the three surfaces (HTTP, gRPC, Files/Batches), whose methods become its routes and RPCs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from ray import serve
from ray.exceptions import RayActorError
from ray.serve import context as serve_context
from ray.serve._private.utils import generate_request_id

from app.batch.store import BatchStoreError
from app.classes import Lane
from app.config import load_app_config
from app.heap import freeze_startup_heap
from app.observability.memory import start_memory_snapshots
from app.lanes.replica_stats import merge_replica_stats
from app.lanes.types import LaneReplicaLost, LaneRequest
from app.prefix_cache.decision_stats import add_decision_observer, all_decision_stats
from app.prefix_cache.mirror import mirror_stats
from app.prefix_cache.replica_sets import routable_replicas
from app.router.auth import KeyRing
from app.router.adapter_api import ADAPTER_ROUTES, AdapterApi
from app.router.batch_api import BATCH_ROUTES, BatchApi, execute_batch_line, openai_error_from_store
from app.router.control import TrafficControl
from app.router.body_limit import BodyLimits
from app.router.body_limit import set_limits as set_body_limits
from app.router.grpc_api import GrpcApi
from app.router.http_api import HTTP_ROUTES, HttpApi, make_http_app
from app.router.pipeline import RequestPipeline
from app.router.openai_surface import OpenAISurface
from app.router.rate_limits import RateLimiter
from app.router.replica_counts import LANE_DEPLOYMENTS, ROUTER_DEPLOYMENT, running_replicas

logger = logging.getLogger(__name__)
LANE_OF_DEPLOYMENT = {deployment: lane for lane, deployment in LANE_DEPLOYMENTS.items()}
# How often each Router replica publishes the batch backlog and its admission queue depths, and re-reads the
# running replica counts its shares follow.
BACKLOG_METRICS_INTERVAL_S = 5.0
# How often each Router replica gives back the rate-limit allowances it holds unused.
RATE_LIMIT_RETURN_INTERVAL_S = 1.0
# An admin stats call to a lane or the PrefixCache that takes longer than this is reported as an error.
ADMIN_CALL_TIMEOUT_S = 5.0


async def publish_router_gauges(batch_store, control: TrafficControl, metrics) -> None:
    """The batch backlog (read from the shared store) and this Router's admission queue depths, as gauges."""
    backlog = await asyncio.to_thread(batch_store.backlog_stats)
    metrics.set_batch_backlog(backlog.pending_lines)
    for request_class, depth in control.queue_depths().items():
        metrics.set_queue_depth(depth, request_class=request_class)


async def admin_document(lane_handles: dict[Lane, Any], prefix_cache, pipeline: RequestPipeline,
                         dispatcher, router_replica_id: str | None = None) -> dict[str, Any]:
    """GET /v1/admin/stats and gRPC GetStats: every lane replica's stats, the PrefixCache's, and this Router's."""
    async def ask(handle, method: str):
        try:
            return await asyncio.wait_for(getattr(handle, method).remote(), timeout=ADMIN_CALL_TIMEOUT_S)
        except Exception as error:
            return {"error": str(error)}

    control = pipeline.control
    lanes = list(lane_handles)
    *live, prefix, registry = await asyncio.gather(
        *(ask(lane_handles[lane], "stats") for lane in lanes), ask(prefix_cache, "stats"),
        ask(prefix_cache, "replica_stats"))
    return {
        "lanes": {lane.value: merge_replica_stats(answer, registry.get(lane.value, [])
                                                  if "error" not in registry else [])
                  for lane, answer in zip(lanes, live)},
        "prefix_cache": prefix,
        # This Router replica's id, as its answers' x-llm-lanes-router header says it.
        "router": {"replica": router_replica_id,
                   "breakers": control.breaker_states(), "queued_by_class": control.queue_depths(),
                   # Lane replicas this Router's handles can send a request to now (None: not known yet); a lane
                   # at 0 is served around (spill.py, rule 6) until one runs again.
                   "routable_replicas": {lane.value: control.routable_replicas(lane) for lane in lanes},
                   # This Router's share of the hot engines' slots for interactive requests, and of the cold
                   # lane's room for spilled ones: limit, in flight, waiting, peak, hold time.
                   **control.slot_stats(),
                   # TTFT of this Router's recent streamed requests (body in hand to first chunk), per class and lane.
                   "ttft_ms": pipeline.recent_ttft.summary(),
                   # The window is per cold replica; this Router keeps its share of window x cold replicas.
                   "batch_window": dispatcher.window.size,
                   "batch_in_flight_limit": dispatcher.capacity,
                   "batch_in_flight": dispatcher.in_flight,
                   "replicas_seen": {"cold": dispatcher.cold_replicas, "router": dispatcher.router_replicas},
                   # This Router replica's choices of lane replica (prefix-affinity router), per deployment.
                   "replica_routing": all_decision_stats(),
                   # Its copy of the prefix index (prefix_cache.lookup: local_mirror): size, age, syncs.
                   "prefix_index_mirror": mirror_stats(),
                   # The API keys' rate limits at this Router: allowances held, exchanges with the shared buckets.
                   "rate_limits": pipeline.rate_limits.stats() if pipeline.rate_limits else None},
    }


class ServeLaneStream:
    """A lane call's DeploymentResponseGenerator, with Ray's "the replica is gone" errors raised as LaneReplicaLost
    (the request path has no Ray: app/router/lane_call.py retries a request its replica lost before it started)."""

    def __init__(self, generator):
        self._generator = generator

    async def __anext__(self):
        try:
            return await self._generator.__anext__()
        except Exception as error:
            # Directly, or as the cause of a RayTaskError (an error that crossed another actor first).
            if isinstance(error, RayActorError) or isinstance(getattr(error, "cause", None), RayActorError):
                raise LaneReplicaLost(f"the lane replica is gone: {type(error).__name__}") from error
            # The replica outlived its engine for a moment and said so (app/lanes/engine.py).
            cause = getattr(error, "cause", None)
            if isinstance(cause, LaneReplicaLost) and not isinstance(error, LaneReplicaLost):
                raise LaneReplicaLost(str(cause)) from error
            raise

    def cancel(self) -> None:
        self._generator.cancel()


class ServeLaneClients:
    """The lanes' Serve handles as the pipeline's LaneClients: one streaming `generate` call per open()."""

    def __init__(self, handles: dict[Lane, Any]):
        self.handles = handles

    def open(self, lane: Lane, request: LaneRequest):
        # Each lane call under an internal request id of its own. A handle call inherits the id of the request being
        # served, and Serve's request router keeps its pending requests by that id: of two calls of one client
        # request waiting for a replica at once (a completion with several prompts), the second is never assigned
        # and waits forever. The client's request id (Serve's logs) stays the same.
        context = serve_context._get_serve_request_context()
        token = serve_context._serve_request_context.set(
            dataclasses.replace(context, _internal_request_id=generate_request_id()))
        try:
            return ServeLaneStream(self.handles[lane].options(stream=True).generate.remote(request))
        finally:
            serve_context._serve_request_context.reset(token)


async def serve_details() -> dict[str, Any]:
    """The Serve controller's details of every application, as the plain dictionary it sends, awaited on the event
    loop. serve.status() asks for the same dictionary, then parses it into pydantic models whose deployment configs
    cloudpickle the lanes' request router class by value: ~0.1 s of CPU holding the GIL per call, a stall of
    every request on this replica each time the counts are read."""
    from ray.serve.context import _get_global_client

    client = await asyncio.to_thread(_get_global_client)  # connects on the first call (blocking), cached after
    return await client._controller.get_serve_instance_details.remote()


class RouterReplica(HttpApi, BatchApi, AdapterApi, GrpcApi):
    async def __init__(self, app_args: dict[str, Any], hot_lane, cold_lane, prefix_cache):

        from app.batch.dispatcher import BatchDispatcher
        from app.batch.open_store import open_batch_store
        from app.observability.metrics import LlmLanesMetrics
        from app.observability.tracing import setup_tracing

        cfg = self.cfg = load_app_config(app_args)
        # First: a Router without the keys its config names does not start (auth.mode none: a warning).
        self.keyring = KeyRing.from_config(cfg.auth)
        set_body_limits(BodyLimits(cfg.router.max_request_bytes, cfg.batch.max_file_bytes))
        # Built here, not at import: Serve's metrics pick up the replica's tags when they are created.
        self.metrics = LlmLanesMetrics()
        self.tracing = setup_tracing(cfg.observability.tracing.model_dump(), component="Router")
        handles = {Lane.HOT: hot_lane} if cold_lane is None else {Lane.HOT: hot_lane, Lane.COLD: cold_lane}
        self.lane_handles = handles
        self.router_replica_id = serve.get_replica_context().replica_id.unique_id
        # Running replicas per lane, read from the Serve controller every few seconds; None until the first read.
        self.lane_replicas: dict[str, int | None] = {lane.value: None for lane in handles}
        # Lanes whose handle has no replica to send a request to are routed around (spill.py, rule 6).
        self.control = TrafficControl(cfg, routable_replicas=self._routable_replicas)
        if len(self.keyring.tenants) > 1:
            # Tenants share each class's queue: one tenant's flood leaves room for the others' requests.
            self.control.back_pressure.share_between_tenants(cfg.admission.tenant_queue_share)
        self.prefix_cache = prefix_cache
        # The lanes' request routers run in this process (they route this Router's handle calls): their decision
        # times become the llm_lanes_replica_routing_seconds histogram.
        add_decision_observer(self._observe_replica_routing)
        # vLLM's OpenAI serving code for this model (its renderer loads the tokenizer and chat template).
        surface = await asyncio.to_thread(OpenAISurface, cfg)
        await surface.load_static_adapters()
        # The keys' rate-limit buckets live in the PrefixCache, shared by every Router replica.
        self.rate_limits = (RateLimiter(lambda orders: prefix_cache.rate_limit_exchange.remote(list(orders)))
                            if self.keyring.has_rate_limits else None)
        self.pipeline = RequestPipeline(cfg, surface, self.control, ServeLaneClients(handles), self.metrics,
                                        self.tracing, rate_limits=self.rate_limits)
        batch = cfg.batch
        self.batch_store = await asyncio.to_thread(open_batch_store, batch.store)
        # Every Router replica drains the durable queue; the store's leases keep two from running the same line.
        self.dispatcher = BatchDispatcher(
            self.batch_store,
            lambda line: execute_batch_line(self.pipeline, line, self.keyring.tenant_adapters(line.tenant)), batch)
        self._dispatcher_task = asyncio.create_task(self.dispatcher.run())
        # LoRA adapters loaded at run time (adapter_api.py): the store's set now, then re-read every second.
        self._adapter_sync_task = None
        if cfg.serves_lora:
            await self.sync_adapters()
            self._adapter_sync_task = asyncio.create_task(self.sync_adapters_forever())
        self._backlog_metrics_task = asyncio.create_task(self._publish_backlog_metrics_forever())
        self._rate_limit_task = asyncio.create_task(self._return_idle_allowances_forever())
        freeze_startup_heap()
        self.memory_snapshots = start_memory_snapshots(cfg.observability.memory_snapshots, "Router")

    def _routable_replicas(self, lane: Lane) -> int | None:
        """The lane's replicas this Router's handle can send a call to; before its handle has made any call, the
        RUNNING replicas the controller last listed (None before the first read)."""
        count = routable_replicas(LANE_DEPLOYMENTS[lane.value])
        return count if count is not None else self.lane_replicas.get(lane.value)

    async def _return_idle_allowances_forever(self) -> None:
        """Rate-limit allowances this Router holds but does not use go back to the shared buckets."""
        while self.rate_limits is not None:
            await asyncio.sleep(RATE_LIMIT_RETURN_INTERVAL_S)
            try:
                await self.rate_limits.return_idle()
            except Exception as error:  # limits must never take the Router down
                logger.warning("could not return idle rate-limit allowances: %s", error)

    def _observe_replica_routing(self, deployment: str, decision, elapsed_s: float) -> None:
        lane = LANE_OF_DEPLOYMENT.get(deployment, deployment)
        self.metrics.observe_replica_routing(elapsed_s, lane=lane, reason=decision.reason.value)

    async def _publish_backlog_metrics_forever(self) -> None:
        """Batch backlog (read from the shared store) and this replica's admission queue depths, as gauges; and the
        replica counts that this Router's shares (batch window, hot slots, spill room) follow."""
        while True:
            try:
                await publish_router_gauges(self.batch_store, self.control, self.metrics)
            except Exception as error:  # metrics must never take the Router down
                logger.warning("could not publish the batch backlog metric: %s", error)
            await self.refresh_replica_counts()
            await asyncio.sleep(BACKLOG_METRICS_INTERVAL_S)

    async def refresh_replica_counts(self) -> None:
        """Running replicas per lane (GET /health, the shares) from the Serve controller. On failure the last counts
        stay (the configured ones at start), so neither health nor the shares flap on a failed read."""
        try:
            app_name = serve.get_replica_context().app_name
            details = await serve_details()
        except Exception as error:
            logger.warning("could not read replica counts from the Serve controller: %s", error)
            return
        for lane in self.lane_handles:
            count = running_replicas(details, app_name, LANE_DEPLOYMENTS[lane.value])
            if count is not None:
                self.lane_replicas[lane.value] = count
        routers = running_replicas(details, app_name, ROUTER_DEPLOYMENT) or self.dispatcher.router_replicas
        hot = self.lane_replicas.get(Lane.HOT.value)
        cold = self.lane_replicas.get(Lane.COLD.value)
        if Lane.COLD in self.lane_handles:
            self.dispatcher.set_replica_counts(cold if cold is not None else self.dispatcher.cold_replicas, routers)
        if hot:
            # No running hot replica (starting, or all down) leaves the shares as they were: requests sent to the
            # hot lane then wait in Serve's handle for a replica, the breaker answers a lane that fails, and the
            # shares are right again the moment a replica runs instead of one refresh later.
            self.control.set_replica_counts(hot=hot, cold=cold or 0, routers=routers)

    async def admin_stats(self) -> dict[str, Any]:
        return await admin_document(self.lane_handles, self.prefix_cache, self.pipeline, self.dispatcher,
                                    self.router_replica_id)

    async def __del__(self):
        # Graceful shutdown (serve run stopped, serve deploy, scale-down): in-flight batch lines get half the
        # replica's shutdown time to be recorded; the leases of the rest are released, not left to run out.
        if not hasattr(self, "_rate_limit_task"):
            return  # stopped while __init__ ran (the app shut down as it started): nothing of it runs yet
        self._backlog_metrics_task.cancel()
        self._rate_limit_task.cancel()
        if self._adapter_sync_task is not None:
            self._adapter_sync_task.cancel()
        self.tracing.shutdown()
        if getattr(self, "memory_snapshots", None) is not None:
            self.memory_snapshots.stop()
        try:
            await self.dispatcher.shutdown(self._dispatcher_task, self.cfg.router.graceful_shutdown_timeout_s / 2)
        except Exception as error:  # the store is gone too: the leases then run out after lease_s
            logger.warning("batch dispatcher did not shut down cleanly: %r", error)
        self.pipeline.shutdown()


def with_routes(cls: type, fastapi_app, routes: dict) -> type:
    """A subclass of `cls` whose methods named in `routes` are FastAPI routes of `fastapi_app` (the plain class
    stays plain: Ray Serve LLM attaches its ingress routes the same way)."""
    decorated = {name: route(fastapi_app)(getattr(cls, name)) for name, route in routes.items()}
    routed = type(cls.__name__, (cls,), decorated)
    routed.__qualname__ = cls.__qualname__
    return routed


http_app = make_http_app({BatchStoreError: openai_error_from_store})
Router = serve.deployment(name=ROUTER_DEPLOYMENT)(
    serve.ingress(http_app)(with_routes(RouterReplica, http_app, {**HTTP_ROUTES, **BATCH_ROUTES, **ADAPTER_ROUTES})))
