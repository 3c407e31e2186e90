"""What the PrefixCache deployment holds, without Ray: the prefix index, prefix popularity and the lane replicas'
latest stats. The deployment (deployment.py) is thin glue around one SharedPrefixState.

Replicas are known by what they report (KV-event updates, observed prompts, stats). A replica that has not
reported stats for `replica_stale_s` is gone (died, scaled down, restarted under a new id): its index entries are
dropped so lookups stop naming it.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from app.config import AppConfig
from app.prefix_cache.index import BlockHash, PrefixIndex, block_hashes
from app.prefix_cache.mirror import IndexChangeLog
from app.prefix_cache.popularity import PrefixPopularity

# Replicas report stats every couple of seconds (ENGINE_METRICS_INTERVAL_S); this many seconds of silence = gone.
REPLICA_STALE_S = 15.0


class SharedPrefixState:
    def __init__(self, cfg: AppConfig, clock: Callable[[], float] = time.monotonic,
                 replica_stale_s: float = REPLICA_STALE_S):
        settings = cfg.prefix_cache
        self.settings = settings
        # A fresh id per instance: a replica whose update is answered with a new epoch knows this PrefixCache
        # restarted empty and resends everything its engine holds.
        self.epoch = uuid.uuid4().hex
        self.clock = clock
        self.replica_stale_s = replica_stale_s
        # Every change to the index, numbered, for the Routers' mirrors (mirror.py). Index changes are applied first
        # and logged second: a snapshot taken in between already holds the change, and replaying it is harmless.
        self.changes = IndexChangeLog(self.epoch)
        self.index = PrefixIndex(max_entries=settings.max_entries, clock=clock,
                                 on_drop=lambda blocks: self.changes.append(("drop", blocks)))
        # Pinned prefixes are token ids, so one block size (the hot lane's) is enough to find them.
        self.popularity = PrefixPopularity(
            block_size=cfg.hot_lane.engine.block_size, min_prefix_tokens=settings.min_prefix_tokens,
            max_pinned_prefixes=cfg.pinned_prefix_limit, half_life_s=settings.popularity_half_life_s, clock=clock)
        self.replica_lanes: dict[str, str] = {}
        self.blocks_added: Counter[str] = Counter()
        self.blocks_removed: Counter[str] = Counter()
        self.prompts_observed: Counter[str] = Counter()
        self.lookups = 0
        self.lookups_matched = 0
        self.expired_entries = 0
        self._replica_stats: dict[str, tuple[float, dict[str, Any]]] = {}

    # --- feeds ---------------------------------------------------------------------------------------------------
    def apply_update(self, replica_id: str, lane: str, adds: list[BlockHash], removes: list[BlockHash],
                     cleared: bool) -> str:
        """The exact feed: net changes from one replica's KV events (cleared = full resync follows in adds).
        Returns this instance's epoch."""
        self.replica_lanes[replica_id] = lane
        if cleared:
            self.index.remove_replica(replica_id)
            self.changes.append(("remove_replica", replica_id))
        if removes:
            self.index.remove(replica_id, removes)
            self.changes.append(("remove", replica_id, list(removes)))
            self.blocks_removed[replica_id] += len(removes)
        if adds:
            self.index.add(replica_id, adds)
            self.changes.append(("add", replica_id, list(adds)))
            self.blocks_added[replica_id] += len(adds)
        return self.epoch

    def observe_prompt(self, replica_id: str, lane: str, token_ids: list[int], block_size: int,
                       record_blocks: bool) -> None:
        """A long prompt a replica admitted: count it for popularity; approximate feed: index it for the replica."""
        self.replica_lanes[replica_id] = lane
        self.prompts_observed[replica_id] += 1
        hashes = block_hashes(token_ids, block_size)
        self.popularity.record(token_ids, hashes if block_size == self.popularity.block_size else None)
        if record_blocks and hashes:
            self.index.add(replica_id, hashes)
            self.changes.append(("add", replica_id, hashes))
            self.blocks_added[replica_id] += len(hashes)

    def expire_approximate(self) -> int:
        """Approximate feed only: forget what nobody added or looked up within approximate_ttl_s."""
        if self.settings.feed != "approximate":
            return 0
        expired = self.index.expire_unused(self.settings.approximate_ttl_s)
        self.expired_entries += expired
        return expired

    # --- queries -------------------------------------------------------------------------------------------------
    def lookup(self, hashes: list[BlockHash], block_size: int) -> list[tuple[str, int]]:
        matches = [(m.replica_id, m.matched_tokens) for m in self.index.longest_matches(hashes, block_size)]
        self.lookups += 1
        self.lookups_matched += bool(matches)
        return matches

    def changes_since(self, epoch: str | None, seq: int) -> dict[str, Any]:
        """For a Router's mirror at (epoch, seq): the ops it lacks, or a snapshot (mirror.IndexChangeLog)."""
        return self.changes.changes_since(epoch, seq, self.index)

    def pinned_prefixes(self) -> list[list[int]]:
        return self.popularity.pinned()

    # --- replica stats registry ----------------------------------------------------------------------------------
    def report_replica_stats(self, replica_id: str, lane: str, stats: dict[str, Any]) -> str:
        """Record a replica's latest stats. Returns this instance's epoch (the replica's restart heartbeat)."""
        self.replica_lanes[replica_id] = lane
        self._replica_stats[replica_id] = (self.clock(), stats)
        return self.epoch

    def forget_stale_replicas(self) -> list[str]:
        """Replicas silent for replica_stale_s: drop their stats and index entries."""
        cutoff = self.clock() - self.replica_stale_s
        gone = [replica for replica, (at, _) in self._replica_stats.items() if at < cutoff]
        for replica in gone:
            del self._replica_stats[replica]
            self.index.remove_replica(replica)
            self.changes.append(("remove_replica", replica))
            self.replica_lanes.pop(replica, None)
        return gone

    def replica_stats(self) -> dict[str, list[dict[str, Any]]]:
        """lane -> the latest stats of each live replica, with their age in seconds."""
        now = self.clock()
        by_lane: dict[str, list[dict[str, Any]]] = {}
        for replica_id, (at, stats) in sorted(self._replica_stats.items()):
            if now - at <= self.replica_stale_s:
                lane = self.replica_lanes.get(replica_id, stats.get("lane", "?"))
                by_lane.setdefault(lane, []).append({**stats, "stats_age_s": round(now - at, 3)})
        return by_lane

    def stats(self) -> dict[str, Any]:
        blocks = self.index.blocks_by_replica()
        replicas = sorted(set(self.replica_lanes) | set(blocks))
        return {
            "epoch": self.epoch,
            "routing": self.settings.routing,
            "feed": self.settings.feed,
            "entries": len(self.index),
            "max_entries": self.index.max_entries,
            "evictions": self.index.evictions,
            "expired_entries": self.expired_entries,
            "lookups": self.lookups,
            "lookups_matched": self.lookups_matched,
            "change_seq": self.changes.seq,
            "pinned_prefixes": [len(prefix) for prefix in self.pinned_prefixes()],
            "replicas": {replica: {"lane": self.replica_lanes.get(replica), "blocks": blocks.get(replica, 0),
                                   "blocks_added": self.blocks_added[replica],
                                   "blocks_removed": self.blocks_removed[replica],
                                   "prompts_observed": self.prompts_observed[replica]}
                         for replica in replicas},
        }
