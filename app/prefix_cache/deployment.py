"""PrefixCache: the one prefix index shared by both lanes, and the API keys' rate-limit buckets (rate_ledger.py).
Advisory state: losing it never fails a request.

Thin glue around SharedPrefixState (shared_state.py); a background task expires approximate-feed entries and
forgets replicas that stopped reporting.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve

from app.config import load_app_config
from app.observability.memory import start_memory_snapshots
from app.prefix_cache.rate_ledger import Order, RateLedger
from app.prefix_cache.shared_state import SharedPrefixState

HOUSEKEEPING_INTERVAL_S = 5.0


@serve.deployment(name="PrefixCache")
class PrefixCache:
    def __init__(self, app_args: dict[str, Any]):
        cfg = load_app_config(app_args)
        self.state = SharedPrefixState(cfg)
        # The API keys' rate-limit buckets, shared by every Router replica (app/router/rate_limits.py).
        self.rate_ledger = RateLedger()
        self._housekeeping = asyncio.get_event_loop().create_task(self._housekeep_forever())
        self.memory_snapshots = start_memory_snapshots(cfg.observability.memory_snapshots, "PrefixCache")

    async def _housekeep_forever(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
            self.state.expire_approximate()
            self.state.forget_stale_replicas()

    def apply_update(self, replica_id: str, lane: str, adds: list[int], removes: list[int], cleared: bool) -> str:
        return self.state.apply_update(replica_id, lane, adds, removes, cleared)

    def observe_prompt(self, replica_id: str, lane: str, token_ids: list[int], block_size: int,
                       record_blocks: bool) -> None:
        self.state.observe_prompt(replica_id, lane, token_ids, block_size, record_blocks)

    def lookup(self, hashes: list[int], block_size: int) -> list[tuple[str, int]]:
        return self.state.lookup(hashes, block_size)

    def changes_since(self, epoch: str | None, seq: int) -> dict[str, Any]:
        return self.state.changes_since(epoch, seq)

    def pinned_prefixes(self) -> list[list[int]]:
        return self.state.pinned_prefixes()

    def report_replica_stats(self, replica_id: str, lane: str, stats: dict[str, Any]) -> str:
        return self.state.report_replica_stats(replica_id, lane, stats)

    def replica_stats(self) -> dict[str, list[dict[str, Any]]]:
        return self.state.replica_stats()

    def rate_limit_exchange(self, orders: list[Order]) -> list[tuple[int, float]]:
        return self.rate_ledger.exchange(orders)

    def stats(self) -> dict[str, Any]:
        return {**self.state.stats(), "rate_limit_buckets": self.rate_ledger.stats()}
