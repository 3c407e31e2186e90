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
from app.lanes.types import LaneChunk, LaneRequest
from app.prefix_cache.index import block_hashes

logger = logging.getLogger(__name__)


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
        self.inflight_by_class: Counter[str] = Counter()
        self.served_by_class: Counter[str] = Counter()
        self._background: set[asyncio.Task] = set()

    async def generate(self, request: LaneRequest) -> AsyncIterator[LaneChunk]:
        self.inflight_by_class[request.request_class] += 1
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
        }

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
