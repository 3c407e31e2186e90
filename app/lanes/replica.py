"""The body of a lane replica (HotLane and ColdLane): thin glue between Ray Serve and the engine adapter.

The engine is injected (`engine_factory`) so tests and other engines can swap it; the default is vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

from app.config import AppConfig, load_app_config
from app.heap import freeze_startup_heap
from app.observability.memory import start_memory_snapshots
from app.lanes.adapter_residency import lane_adapter_residency
from app.lanes.engine import configure_vllm_logging
from app.lanes.engine_reaper import start_engine_reaper
from app.lanes.replica_stats import ADAPTER_RESIDENCY_STAT, ADAPTERS_STAT, KV_USAGE_STAT
from app.lanes.types import AdapterRef, EngineStats, LaneChunk, LaneRequest, LaneSaturated
from app.observability.tracing import SPAN_LANE_GENERATE, Tracing
from app.lanes.admission import Decision, PriorityGate, kv_headroom_decision
from app.classes import RequestClass

logger = logging.getLogger(__name__)
configure_vllm_logging()  # before Ray Serve sets up this replica's log handlers (engine.py says why)

# How often a request held back for KV headroom re-reads the engine's usage.
KV_HEADROOM_POLL_S = 0.02
# How often a lane replica publishes its engine's KV usage and prefix-cache hit rate as gauges.
ENGINE_METRICS_INTERVAL_S = 2.0
# The prefix-cache hit-rate gauge covers about this much recent traffic.
HIT_RATE_WINDOW_S = 60.0


class PrefixHitRateWindow:
    """Prefix-cache hit rate over the recent window, from the engine's cumulative (queries, hits) token counters.

    Readings may come at any cadence (the periodic publisher and stats() calls); the rate is taken between the
    newest reading and the newest one at least `window_s` older (or the oldest kept). Counters that go down mean
    the engine reset them: the window starts again from zero.
    """

    def __init__(self, window_s: float = HIT_RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._readings: deque[tuple[float, int, int]] = deque()

    def update(self, queries: int, hits: int) -> float | None:
        """Add a reading; the hit rate over the window, or None when the window saw no queries."""
        now = self.clock()
        if self._readings and (queries < self._readings[-1][1] or hits < self._readings[-1][2]):
            self._readings.clear()
        self._readings.append((now, queries, hits))
        # Keep one reading at or beyond the window's start as its baseline.
        while len(self._readings) > 2 and now - self._readings[1][0] >= self.window_s:
            self._readings.popleft()
        if len(self._readings) == 1:
            window_queries, window_hits = queries, hits  # first reading: everything since the (re)start
        else:
            _, base_queries, base_hits = self._readings[0]
            window_queries, window_hits = queries - base_queries, hits - base_hits
        return window_hits / window_queries if window_queries > 0 else None


class LaneTrace:
    """The lane_generate span of one request, child of the Router's trace (LaneRequest.trace_carrier), and its
    phases: engine_queue (arrival here -> handed to the engine, i.e. the realtime gate and KV-headroom waits),
    prefill (-> first chunk) and decode (first chunk -> last). A non-streamed request gets one chunk at the end,
    so only engine_queue is recorded for it: its prefill/decode split is not observable here."""

    def __init__(self, tracing: Tracing, request: LaneRequest, lane: str, replica_id: str):
        self.tracing = tracing
        self.streamed = request.stream
        self.arrival_ns = time.time_ns()
        self.engine_ns: int | None = None
        self.first_chunk_ns: int | None = None
        self.span = tracing.start_span(
            SPAN_LANE_GENERATE, context=tracing.extract(request.trace_carrier), start_time_ns=self.arrival_ns,
            attributes={"llm_lanes.lane": lane, "llm_lanes.replica_id": replica_id,
                        "llm_lanes.request_id": request.request_id,
                        "llm_lanes.request_class": request.request_class.value,
                        "llm_lanes.prompt_tokens": len(request.prompt_token_ids), "llm_lanes.streamed": request.stream})

    def entered_engine(self) -> None:
        self.engine_ns = time.time_ns()

    def chunk(self, chunk: LaneChunk) -> None:
        if self.first_chunk_ns is None:
            self.first_chunk_ns = time.time_ns()
        if chunk.finish_reason is not None:
            self.span.set_attributes({"llm_lanes.completion_tokens": chunk.completion_tokens,
                                      "llm_lanes.cached_prompt_tokens": chunk.cached_prompt_tokens,
                                      "llm_lanes.finish_reason": chunk.finish_reason})

    def end(self, error: BaseException | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        finished_ns = time.time_ns()
        self.tracing.record_engine_phases(
            arrival_ns=self.arrival_ns, scheduled_ns=self.engine_ns,
            first_token_ns=self.first_chunk_ns if self.streamed else None, finished_ns=finished_ns,
            context=Tracing.context_with(self.span))
        if isinstance(error, LaneSaturated):
            self.span.set_attribute("llm_lanes.spilled", error.reason)
        elif isinstance(error, (asyncio.CancelledError, GeneratorExit)):
            self.span.set_attribute("llm_lanes.cancelled", True)
        elif error is not None:
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        self.span.end(end_time=finished_ns)


def vllm_engine_factory(cfg: AppConfig, lane: str, replica_id: str, kv_events_config: dict | None = None):
    from app.lanes.engine import VllmEngine

    return VllmEngine(cfg, cfg.lane(lane).engine, lane, replica_id, kv_events_config=kv_events_config)


class LaneReplica:
    lane: str = ""

    async def __init__(self, app_args: dict[str, Any], prefix_cache, prefix_feed_factory: Callable,
                       engine_factory: Callable | None = None):
        """`prefix_feed_factory(cfg, lane, replica_id, block_size, prefix_cache)` builds this replica's side of the
        shared prefix index (app.prefix_cache.replica_feed.ReplicaPrefixFeed, injected by app.main: the prefix cache
        sits above the lanes)."""
        from ray import serve

        self.cfg = load_app_config(app_args)
        # The full id (app#deployment#unique) is how the prefix-affinity request router names replicas.
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        self.block_size = self.cfg.lane(self.lane).engine.block_size
        self.prefix_cache = prefix_cache
        self.prefix_feed = prefix_feed_factory(self.cfg, self.lane, self.replica_id, self.block_size, prefix_cache)
        await self.prefix_feed.start()
        self.engine = (engine_factory or vllm_engine_factory)(
            self.cfg, self.lane, self.replica_id, kv_events_config=self.prefix_feed.engine_kv_events_config())
        await self.engine.start()
        # vLLM's engine processes outlive a SIGKILLed replica; a watcher kills them then (engine_reaper.py). Only for
        # the real engine: an injected one (tests) runs in this process.
        self._engine_reaper = start_engine_reaper() if engine_factory is None else None
        from app.observability.metrics import LlmLanesMetrics
        from app.observability.tracing import setup_tracing

        # Built in the replica: Serve's metrics take the replica's tags (replica, deployment) when created.
        self.metrics = LlmLanesMetrics()
        self.tracing = setup_tracing(self.cfg.observability.tracing.model_dump(),
                                     component=f"{self.lane.capitalize()}Lane")
        self._hit_rate = PrefixHitRateWindow()
        admission = self.cfg.admission
        # Hot replicas keep the tuning guide's small high-priority queue (realtime <= 4 in flight) and KV reserve.
        self.gate = (PriorityGate.for_hot_replica(admission.realtime_max_inflight)
                     if self.lane == "hot" and admission.enabled else None)
        self.inflight_by_class: Counter[str] = Counter()
        self.served_by_class: Counter[str] = Counter()
        # Engine requests this replica aborted before they finished: the client went away, a deadline passed, or the
        # stream failed. An operator sees disconnects here; a test sees the abort without racing the engine.
        self.aborted_by_class: Counter[str] = Counter()
        self.held_for_kv = 0
        # LoRA adapters: requests running per adapter, and what the engine held at its last reading.
        self.running_by_adapter: Counter[str] = Counter()
        self.held_adapters: frozenset[str] = frozenset()
        # Whether each adapter's request found it in the engine's host-memory cache (adapter_residency.py).
        self.adapter_residency = lane_adapter_residency(self.cfg, self.lane)
        # High-water marks: lets an operator (and a test) see the realtime cap hold under load.
        self.max_inflight_by_class: Counter[str] = Counter()
        self.gate_waits_by_class: Counter[str] = Counter()
        # Before Serve marks this replica ready (the constructor returning): prefill the pinned prefixes.
        await self.prefix_feed.warm_up(self.engine.generate)
        self._metrics_task = asyncio.create_task(self._publish_engine_metrics_forever())
        freeze_startup_heap()
        self.memory_snapshots = start_memory_snapshots(self.cfg.observability.memory_snapshots,
                                                       f"{self.lane.capitalize()}Lane")

    async def generate(self, request: LaneRequest) -> AsyncIterator[LaneChunk]:
        # Tracing off: no LaneTrace, and each step below pays one `is None` test.
        trace = LaneTrace(self.tracing, request, self.lane, self.replica_id) if self.tracing.enabled else None
        error: BaseException | None = None
        try:
            if self.gate is None:
                async with contextlib.aclosing(self._run(request, trace)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            request_class = request.request_class
            await self._wait_for_kv_headroom(request, request_class)
            # Realtime beyond its in-flight cap waits here, in front of the engine, not inside it.
            waited = self.gate.waiting(request_class) > 0 or not self.gate.has_room(request_class)
            async with self.gate.slot(request_class, request.priority):
                if waited:
                    self.gate_waits_by_class[request.request_class.value] += 1
                # Closed before the slot is given back: when the caller stops reading (a finished or abandoned
                # stream), the engine request ends (or is aborted) now, not when the event loop finalizes the
                # abandoned generator later, by which time the slot's next request is in the engine beside it.
                async with contextlib.aclosing(self._run(request, trace)) as chunks:
                    async for chunk in chunks:
                        yield chunk
        except BaseException as caught:
            error = caught
            raise
        finally:
            if trace is not None:
                trace.end(error)

    async def _wait_for_kv_headroom(self, request: LaneRequest, request_class: RequestClass) -> None:
        reserve = self.cfg.admission.realtime_kv_reserve
        held = False
        while True:
            decision = kv_headroom_decision(request_class, self.engine.stats().kv_cache_usage, reserve,
                                            can_spill=request.may_spill)
            if decision.decision is Decision.ADMIT:
                return
            if decision.decision is Decision.SPILL:
                raise LaneSaturated(decision.reason)
            if not held:
                held = True
                self.held_for_kv += 1
            await asyncio.sleep(KV_HEADROOM_POLL_S)

    async def _run(self, request: LaneRequest, trace: LaneTrace | None = None) -> AsyncIterator[LaneChunk]:
        if trace is not None:
            trace.entered_engine()
        adapter = request.adapter.name if request.adapter is not None else None
        if adapter is None:
            # Prefix popularity and the approximate index are the base model's: an adapter's KV blocks are its own.
            self.prefix_feed.observe(request.prompt_token_ids)
        else:
            self.running_by_adapter[adapter] += 1
            self.held_adapters |= {adapter}  # the engine loads it for this request, if it did not hold it
        residency = self.adapter_residency
        if residency is not None:
            residency.started(adapter)
        name = request.request_class.value
        self.inflight_by_class[name] += 1
        self.max_inflight_by_class[name] = max(self.max_inflight_by_class[name], self.inflight_by_class[name])
        finished = False
        try:
            async for chunk in self.engine.generate(request):
                if chunk.finish_reason is not None and not finished:
                    # The engine is done with the sequence: it is counted served and out of flight before its last
                    # chunk goes out, since the Router gives the request's slot to the next one on that chunk and
                    # the client may read these counts as soon as it has that chunk.
                    finished = True
                    self.inflight_by_class[name] -= 1
                    self.served_by_class[name] += 1
                if trace is not None:
                    trace.chunk(chunk)
                yield chunk
        finally:
            if residency is not None:
                residency.finished(adapter)
            if adapter is not None:
                self.running_by_adapter[adapter] -= 1
                if not self.running_by_adapter[adapter]:
                    del self.running_by_adapter[adapter]
            if not finished:
                self.inflight_by_class[name] -= 1
                # Cancelled (client gone, deadline) or failed: make sure the engine drops the sequence.
                self.aborted_by_class[name] += 1
                try:
                    await asyncio.shield(self.engine.abort(request.request_id))
                except Exception as error:
                    # An engine that died cannot abort (the sequence went with it); the request's own error, not
                    # this one, is what the Router must see.
                    logger.warning("could not abort %s in the engine: %r", request.request_id, error)

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def try_adapter(self, adapter: AdapterRef) -> str | None:
        """Load LoRA adapter `adapter` into this replica's engine (a run-time load is tried on each lane before it
        is served): None, or why the engine refuses it. A refusal leaves the engine and its adapters as they were."""
        try:
            await self.engine.load_adapter(adapter)
        except ValueError as error:
            return str(error)
        self.held_adapters |= {adapter.name}
        if self.adapter_residency is not None:
            self.adapter_residency.loaded(adapter.name)
        return None

    def _publish_engine_metrics(self, engine_stats: EngineStats) -> None:
        self.metrics.set_kv_cache_usage(engine_stats.kv_cache_usage, lane=self.lane)
        rate = self._hit_rate.update(engine_stats.prefix_cache_queries, engine_stats.prefix_cache_hits)
        if rate is not None:
            self.metrics.set_prefix_cache_hit_rate(rate, lane=self.lane)

    async def _publish_engine_metrics_forever(self) -> None:
        while True:
            try:
                if self.cfg.serves_lora:
                    self.held_adapters = await self.engine.held_adapters()
                stats = await self.stats()
                # Every replica's stats reach the admin endpoint through the PrefixCache's registry (a handle call
                # reaches one replica only). Not awaited: a slow PrefixCache must not stall this loop.
                self.prefix_feed.report_replica_stats(stats)
            except Exception as error:  # metrics must never take the replica down
                logger.warning("could not publish engine metrics: %s", error)
            await asyncio.sleep(ENGINE_METRICS_INTERVAL_S)

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve asks each replica for these periodically; the prefix-affinity request router weighs KV usage
        and, for a request naming a LoRA adapter, which adapters the engine holds (with their running requests)."""
        stats: dict[str, Any] = {KV_USAGE_STAT: self.engine.stats().kv_cache_usage}
        if self.cfg.serves_lora:
            stats[ADAPTERS_STAT] = {adapter: self.running_by_adapter.get(adapter, 0)
                                    for adapter in self.held_adapters | set(self.running_by_adapter)}
        return stats

    async def stats(self) -> dict[str, Any]:
        engine_stats = self.engine.stats()
        self._publish_engine_metrics(engine_stats)
        return {
            "lane": self.lane,
            "replica_id": self.replica_id,
            **asdict(engine_stats),
            "prefix_cache_hit_rate": engine_stats.prefix_cache_hit_rate,
            "spec_acceptance_rate": engine_stats.spec_acceptance_rate,
            "inflight_by_class": {k: v for k, v in self.inflight_by_class.items() if v},
            "served_by_class": dict(self.served_by_class),
            "aborted_by_class": dict(self.aborted_by_class),
            "gate_waiting_by_class": {c.value: self.gate.waiting(c) for c in RequestClass} if self.gate else {},
            "max_inflight_by_class": dict(self.max_inflight_by_class),
            "held_for_kv_headroom": self.held_for_kv,
            "gate_waits_by_class": dict(self.gate_waits_by_class),
            "prefix_feed": self.prefix_feed.stats(),
            **({"adapters_held": sorted(self.held_adapters), "running_by_adapter": dict(self.running_by_adapter),
                ADAPTER_RESIDENCY_STAT: self.adapter_residency.stats()}
               if self.cfg.serves_lora else {}),
        }

    def __del__(self):
        task = getattr(self, "_metrics_task", None)
        if task is not None:
            task.cancel()
        snapshots = getattr(self, "memory_snapshots", None)
        if snapshots is not None:
            snapshots.stop()
        feed = getattr(self, "prefix_feed", None)
        if feed is not None:
            feed.close()
        tracing = getattr(self, "tracing", None)
        if tracing is not None:
            tracing.shutdown()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
