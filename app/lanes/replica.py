"""The body of a lane replica (HotLane and ColdLane): thin glue between Ray Serve and the engine adapter.

The engine is injected (`engine_factory`) so tests and other engines can swap it; the default is vLLM.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

from app.config import AppConfig, load_app_config
from app.lanes.types import LaneChunk, LaneRequest, LaneSaturated
from app.prefix_cache.index import block_hashes
from app.router.admission import Decision, PriorityGate, kv_headroom_decision
from app.router.classes import RequestClass

logger = logging.getLogger(__name__)

# How often a request held back for KV headroom re-reads the engine's usage.
KV_HEADROOM_POLL_S = 0.02


def vllm_engine_factory(cfg: AppConfig, lane: str, replica_id: str):
    from app.lanes.engine import VllmEngine

    return VllmEngine(cfg, cfg.lane(lane).engine, lane, replica_id)


class LaneReplica:
    lane: str = ""

    async def __init__(self, app_args: dict[str, Any], prefix_cache=None, engine_factory: Callable | None = None):
        from ray import serve

        self.cfg = load_app_config(app_args)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.block_size = self.cfg.lane(self.lane).engine.block_size
        self.engine = (engine_factory or vllm_engine_factory)(self.cfg, self.lane, self.replica_id)
        await self.engine.start()
        self.prefix_cache = prefix_cache
        admission = self.cfg.admission
        # Hot replicas keep the tuning guide's small high-priority queue (realtime <= 4 in flight) and KV reserve.
        self.gate = (PriorityGate.for_hot_replica(admission.realtime_max_inflight)
                     if self.lane == "hot" and admission.enabled else None)
        self.inflight_by_class: Counter[str] = Counter()
        self.served_by_class: Counter[str] = Counter()
        self.held_for_kv = 0
        # High-water marks: lets an operator (and a test) see the realtime cap hold under load.
        self.max_inflight_by_class: Counter[str] = Counter()
        self._background: set[asyncio.Task] = set()

    async def generate(self, request: LaneRequest) -> AsyncIterator[LaneChunk]:
        if self.gate is None:
            async for chunk in self._run(request):
                yield chunk
            return
        request_class = RequestClass(request.request_class)
        await self._wait_for_kv_headroom(request, request_class)
        # Realtime beyond its in-flight cap waits here, in front of the engine, not inside it.
        async with self.gate.slot(request_class, request.priority):
            async for chunk in self._run(request):
                yield chunk

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

    async def _run(self, request: LaneRequest) -> AsyncIterator[LaneChunk]:
        self.inflight_by_class[request.request_class] += 1
        self.max_inflight_by_class[request.request_class] = max(
            self.max_inflight_by_class[request.request_class], self.inflight_by_class[request.request_class])
        finished = False
        try:
            async for chunk in self.engine.generate(request):
                if chunk.finish_reason is not None:
                    finished = True
                yield chunk
            self.served_by_class[request.request_class] += 1
            self._record_prefix(request.prompt_token_ids)
        finally:
            self.inflight_by_class[request.request_class] -= 1
            if not finished:
                # Cancelled (client gone, deadline) or failed: make sure the engine drops the sequence.
                await asyncio.shield(self.engine.abort(request.request_id))

    def _record_prefix(self, prompt_token_ids: list[int]) -> None:
        """Tell the shared index which prompt blocks this replica now holds (routing-time feed)."""
        if self.prefix_cache is None:
            return
        hashes = block_hashes(prompt_token_ids, self.block_size)
        if not hashes:
            return
        task = asyncio.ensure_future(self._send_prefix(hashes))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_prefix(self, hashes: list[int]) -> None:
        try:
            await self.prefix_cache.record.remote(self.replica_id, self.lane, hashes)
        except Exception as error:  # the index is advisory: never fail a request for it
            logger.warning("prefix index update failed: %s", error)

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def stats(self) -> dict[str, Any]:
        engine_stats = self.engine.stats()
        return {
            "lane": self.lane,
            "replica_id": self.replica_id,
            **asdict(engine_stats),
            "prefix_cache_hit_rate": engine_stats.prefix_cache_hit_rate,
            "inflight_by_class": {k: v for k, v in self.inflight_by_class.items() if v},
            "served_by_class": dict(self.served_by_class),
            "gate_waiting_by_class": {c.value: self.gate.waiting(c) for c in RequestClass} if self.gate else {},
            "max_inflight_by_class": dict(self.max_inflight_by_class),
            "held_for_kv_headroom": self.held_for_kv,
        }

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
