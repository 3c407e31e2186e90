"""A lane replica's side of the shared prefix index: feed it, and warm a new replica with the pinned prefixes.

Two feeds (`prefix_cache.feed`):
- `kv_events` (exact): the replica's own engine publishes vLLM KV-cache events on a unix socket private to this
  replica; a KVEventSubscriber translates them into llm-lanes' hash space and reports batched adds/removes to the
  PrefixCache deployment. What the index says is what the engine holds, evictions included.
- `approximate`: the replica records each long prompt it admits; the PrefixCache forgets entries unused for
  `approximate_ttl_s` (an engine's LRU eviction is not observable without events).
Either way every long prompt is also counted for popularity (which prefixes get pinned). A lane that can run only
one replica feeds neither (`AppConfig.keeps_prefix_index`); its long prompts still count for popularity.

Everything here is advisory: a slow or dead PrefixCache costs routing quality, never a request. Reports are fire and
forget (observe) or retried as a full resync by the subscriber (exact feed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from app.config import AppConfig
from app.lanes.types import LaneChunk, LaneRequest, SamplingOptions
from app.prefix_cache.kv_events import (
    IndexUpdate,
    KVEventSubscriber,
    KVEventTranslator,
    ipc_endpoint,
    kv_events_config,
)
from app.classes import CLASS_POLICIES, RequestClass

logger = logging.getLogger(__name__)

# A report or observation the PrefixCache does not take within this long is dropped (the feed resyncs later).
PREFIX_CACHE_CALL_TIMEOUT_S = 5.0
# After the warm-up prefills, wait this long for their KV events to reach the subscriber before the final flush.
WARMUP_EVENTS_SETTLE_S = 0.2

GenerateFn = Callable[[LaneRequest], AsyncIterator[LaneChunk]]


class ReplicaPrefixFeed:
    def __init__(self, cfg: AppConfig, lane: str, replica_id: str, block_size: int, prefix_cache: Any | None):
        self.settings = cfg.prefix_cache
        self.lane = lane
        self.replica_id = replica_id
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        # A lane of one replica keeps no index (AppConfig.keeps_prefix_index): its engine publishes no KV events and
        # its prompts record no blocks. Popularity, warm-up and the stats push stay: they serve the other lane too.
        self.indexing = prefix_cache is not None and cfg.keeps_prefix_index(cfg.lane(lane))
        self.exact = self.indexing and self.settings.feed == "kv_events"
        self._endpoint = ipc_endpoint() if self.exact else None
        self.subscriber: KVEventSubscriber | None = None
        self._prefix_cache_epoch: str | None = None
        self._stats_report: asyncio.Future | None = None
        self._background: set[asyncio.Task] = set()
        self.observe_errors = 0
        self.warmup: dict[str, Any] = {"prefixes": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0,
                                       "seconds": 0.0, "error": None}

    # --- engine wiring -----------------------------------------------------------------------------------------
    def engine_kv_events_config(self) -> dict[str, Any] | None:
        """The engine's `kv_events_config` argument (None: no events)."""
        return kv_events_config(self._endpoint) if self._endpoint else None

    async def start(self) -> None:
        """Before the engine starts: subscribe, so no event of the warm-up is missed."""
        if not self.exact:
            return
        self.subscriber = KVEventSubscriber(self._endpoint, KVEventTranslator(self.block_size), self._report)
        self.subscriber.start()
        await self.subscriber.ready()

    async def _report(self, update: IndexUpdate) -> None:
        """Send one batched update. A PrefixCache that restarted (new epoch) lost what we sent before: ask the
        subscriber for a full resync. A failure or timeout raises, and the subscriber resyncs on its next flush."""
        epoch = await asyncio.wait_for(
            self.prefix_cache.apply_update.remote(self.replica_id, self.lane, update.adds, update.removes,
                                                  update.cleared),
            timeout=PREFIX_CACHE_CALL_TIMEOUT_S)
        self._note_epoch(epoch, resynced=update.cleared)

    def _note_epoch(self, epoch: str, *, resynced: bool = False) -> None:
        """A new epoch means the PrefixCache restarted empty: unless this update was a full resync, send one."""
        if (self.subscriber is not None and self._prefix_cache_epoch is not None
                and epoch != self._prefix_cache_epoch and not resynced):
            self.subscriber.request_resync()
        self._prefix_cache_epoch = epoch

    def report_replica_stats(self, stats: dict[str, Any]) -> None:
        """Push this replica's stats to the PrefixCache's registry, without waiting. The answer is the PrefixCache's
        epoch, so this periodic push is also the heartbeat that notices a restarted PrefixCache while no KV event
        flows (an idle replica would otherwise leave the new, empty index empty until its next request)."""
        if self.prefix_cache is None or self._stats_report is not None:
            return  # the previous push has not been answered yet: skip this one rather than pile them up
        self._stats_report = asyncio.ensure_future(self._send_replica_stats(stats))

    async def _send_replica_stats(self, stats: dict[str, Any]) -> None:
        try:
            epoch = await asyncio.wait_for(
                self.prefix_cache.report_replica_stats.remote(self.replica_id, self.lane, stats),
                timeout=PREFIX_CACHE_CALL_TIMEOUT_S)
            self._note_epoch(epoch)
        except Exception as error:  # advisory: the admin endpoint shows older stats, routing is unaffected
            logger.debug("replica stats push failed: %r", error)
        finally:
            self._stats_report = None

    # --- per request -------------------------------------------------------------------------------------------
    def observe(self, prompt_token_ids: list[int]) -> None:
        """Count a long prompt for popularity (and, approximate feed, record it for this replica). No waiting."""
        if self.prefix_cache is None or len(prompt_token_ids) < self.settings.min_prefix_tokens:
            return
        task = asyncio.ensure_future(self._send_observation(prompt_token_ids))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_observation(self, prompt_token_ids: list[int]) -> None:
        try:
            await asyncio.wait_for(
                self.prefix_cache.observe_prompt.remote(self.replica_id, self.lane, prompt_token_ids,
                                                        self.block_size, self.indexing and not self.exact),
                timeout=PREFIX_CACHE_CALL_TIMEOUT_S)
        except Exception as error:  # advisory state: never fail or slow a request for it
            self.observe_errors += 1
            logger.debug("prefix observation failed: %r", error)

    # --- warm-up -----------------------------------------------------------------------------------------------
    async def warm_up(self, generate: GenerateFn) -> None:
        """Prefill every pinned prefix (max_tokens=1) so this replica's first matching request hits its cache.

        Called before the replica reports ready. Bounded by warmup_timeout_s; a failure is logged and recorded in
        stats, and the replica starts anyway (a cold cache is slower, not wrong)."""
        if self.prefix_cache is None or not self.settings.warmup:
            return
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._warm_up(generate), timeout=self.settings.warmup_timeout_s)
        except Exception as error:
            self.warmup["error"] = repr(error)
            logger.warning("warm-up with pinned prefixes did not finish: %r", error)
        self.warmup["seconds"] = round(time.monotonic() - started, 3)

    async def _warm_up(self, generate: GenerateFn) -> None:
        prefixes: list[list[int]] = await self.prefix_cache.pinned_prefixes.remote()
        if not prefixes:
            return

        async def prefill(index: int, token_ids: list[int]) -> int:
            request = LaneRequest(
                request_id=f"warmup-{self.replica_id}-{index}", prompt_token_ids=token_ids,
                sampling=SamplingOptions(max_tokens=1), request_class=RequestClass.BATCH,
                priority=CLASS_POLICIES[RequestClass.BATCH].priority, stream=False)
            cached = 0
            async for chunk in generate(request):
                cached = chunk.cached_prompt_tokens
            return cached

        cached = await asyncio.gather(*(prefill(i, p) for i, p in enumerate(prefixes)))
        self.warmup.update(prefixes=len(prefixes), prompt_tokens=sum(map(len, prefixes)),
                           cached_prompt_tokens=sum(cached))
        if self.subscriber is not None:
            # Let the prefills' BlockStored events arrive, then report them now: the index knows this replica
            # holds the pinned prefixes before the first request is routed to it.
            await asyncio.sleep(WARMUP_EVENTS_SETTLE_S)
            await self.subscriber.flush()

    # --- stats and teardown ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        feed: dict[str, Any] = {"mode": self.settings.feed if self.indexing else "off",
                                "observe_errors": self.observe_errors, "warmup": dict(self.warmup)}
        if self.subscriber is not None:
            feed["events"] = {**vars(self.subscriber.stats), **{
                "tracked_blocks": len(self.subscriber.translator),
                "stored_blocks": self.subscriber.translator.stats.stored_blocks,
                "removed_blocks": self.subscriber.translator.stats.removed_blocks,
                "skipped_unknown_parent": self.subscriber.translator.stats.skipped_unknown_parent,
            }}
        return feed

    def close(self) -> None:
        """Synchronous teardown (the replica's __del__): cancel the subscriber and pending observations."""
        if self.subscriber is not None:
            self.subscriber.cancel()
        for task in list(self._background):
            task.cancel()
        if self._stats_report is not None:
            self._stats_report.cancel()
