"""PrefixCache: the one prefix index shared by both lanes. Advisory state: losing it never fails a request."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ray import serve

from app.config import load_app_config
from app.prefix_cache.index import PrefixIndex


@serve.deployment(name="PrefixCache")
class PrefixCache:
    def __init__(self, app_args: dict[str, Any]):
        cfg = load_app_config(app_args)
        self.index = PrefixIndex(max_entries=cfg.prefix_cache.max_entries)
        self.replica_lanes: dict[str, str] = {}
        self.blocks_recorded: Counter[str] = Counter()

    def record(self, replica_id: str, lane: str, hashes: list[int]) -> None:
        self.replica_lanes[replica_id] = lane
        self.blocks_recorded[replica_id] += len(hashes)
        self.index.add(replica_id, hashes)

    def remove(self, replica_id: str, hashes: list[int]) -> None:
        self.index.remove(replica_id, hashes)

    def forget_replica(self, replica_id: str) -> None:
        self.index.remove_replica(replica_id)
        self.replica_lanes.pop(replica_id, None)

    def lookup(self, hashes: list[int], block_size: int) -> list[tuple[str, int]]:
        return [(m.replica_id, m.matched_tokens) for m in self.index.longest_matches(hashes, block_size)]

    def stats(self) -> dict[str, Any]:
        return {
            "entries": len(self.index),
            "evictions": self.index.evictions,
            "replicas": {r: {"lane": lane, "blocks_recorded": self.blocks_recorded[r]}
                         for r, lane in self.replica_lanes.items()},
        }
