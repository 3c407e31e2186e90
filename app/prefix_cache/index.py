"""The prefix index: which replica holds which prompt prefix in its KV cache. Pure Python, no Ray.

Keys are chained hashes of token-id blocks in llm-lanes' own hash space (blake2b of parent hash + the block's token
ids), never vLLM's internal block hash, so a vLLM upgrade cannot silently break routing. Only full blocks are hashed:
that is what an engine can reuse.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

BlockHash = int
ROOT_HASH: BlockHash = 0


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    payload = struct.pack(f"<Q{len(token_ids)}I", parent, *token_ids)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids`: hash i covers tokens [0, (i + 1) * block_size)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class _Entry:
    replicas: set[str] = field(default_factory=set)
    last_used: float = 0.0


@dataclass(frozen=True)
class Match:
    replica_id: str
    matched_tokens: int


class PrefixIndex:
    """Block hash -> replicas holding it, bounded by `max_entries` with least-recently-used eviction.

    Thread-safe: the PrefixCache deployment serves lookups and engine feeds concurrently.
    """

    def __init__(self, max_entries: int, clock=time.monotonic,
                 on_drop: Callable[[list[BlockHash]], None] | None = None):
        """`max_entries`: prefix_cache.max_entries (the PrefixCache's bound; a Router's mirror holds more).
        `on_drop` is told which entries the index removed on its own (evicted, expired), so a change log can pass
        that on to mirrors."""
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries} must be >= 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._clock = clock
        self._on_drop = on_drop
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, replica_id: str, hashes: Iterable[BlockHash]) -> None:
        now = self._clock()
        hashes = list(hashes)
        with self._lock:
            for block in hashes:
                entry = self._entries.get(block)
                if entry is None:
                    entry = self._entries[block] = _Entry()
                entry.replicas.add(replica_id)
                entry.last_used = now
            self._touch_parents_last(hashes)
            evicted = []
            while len(self._entries) > self.max_entries:
                evicted.append(self._entries.popitem(last=False)[0])
            self.evictions += len(evicted)
        if evicted and self._on_drop is not None:
            self._on_drop(evicted)

    def remove(self, replica_id: str, hashes: Iterable[BlockHash]) -> None:
        with self._lock:
            for block in hashes:
                entry = self._entries.get(block)
                if entry is None:
                    continue
                entry.replicas.discard(replica_id)
                if not entry.replicas:
                    del self._entries[block]

    def remove_replica(self, replica_id: str) -> None:
        """A replica died or its engine cleared its cache: forget everything it held."""
        with self._lock:
            for block in [b for b, e in self._entries.items() if replica_id in e.replicas]:
                entry = self._entries[block]
                entry.replicas.discard(replica_id)
                if not entry.replicas:
                    del self._entries[block]

    def expire_unused(self, max_idle_s: float) -> int:
        """Drop entries neither added nor looked up for `max_idle_s` (the approximate feed's TTL); how many."""
        cutoff = self._clock() - max_idle_s
        with self._lock:
            stale = [block for block, entry in self._entries.items() if entry.last_used < cutoff]
            for block in stale:
                del self._entries[block]
        if stale and self._on_drop is not None:
            self._on_drop(stale)
        return len(stale)

    def drop(self, hashes: Iterable[BlockHash]) -> None:
        """Remove these entries for every replica (a mirror applying its source's evictions)."""
        with self._lock:
            for block in hashes:
                self._entries.pop(block, None)

    def snapshot(self) -> list[tuple[BlockHash, list[str]]]:
        """Every entry with its replicas, least recently used first (load_snapshot keeps that order)."""
        with self._lock:
            return [(block, sorted(entry.replicas)) for block, entry in self._entries.items()]

    def load_snapshot(self, entries: Iterable[tuple[BlockHash, Sequence[str]]]) -> None:
        now = self._clock()
        with self._lock:
            for block, replicas in entries:
                self._entries[block] = _Entry(set(replicas), now)
                self._entries.move_to_end(block)

    def blocks_by_replica(self) -> dict[str, int]:
        with self._lock:
            counts: dict[str, int] = {}
            for entry in self._entries.values():
                for replica in entry.replicas:
                    counts[replica] = counts.get(replica, 0) + 1
            return counts

    def longest_matches(self, hashes: Sequence[BlockHash], block_size: int) -> list[Match]:
        """Matched prefix length per replica, longest first. A replica matches block i only if it matched 0..i-1."""
        now = self._clock()
        matched: dict[str, int] = {}
        touched: list[BlockHash] = []
        with self._lock:
            alive: set[str] | None = None
            for depth, block in enumerate(hashes, start=1):
                entry = self._entries.get(block)
                if entry is None:
                    break
                alive = set(entry.replicas) if alive is None else alive & entry.replicas
                if not alive:
                    break
                entry.last_used = now
                touched.append(block)
                for replica in alive:
                    matched[replica] = depth * block_size
            self._touch_parents_last(touched)
        return sorted((Match(r, n) for r, n in matched.items()), key=lambda m: (-m.matched_tokens, m.replica_id))

    def _touch_parents_last(self, chain: Sequence[BlockHash]) -> None:
        """Mark a root-first chain most recently used so that parents end up newer than their children.

        Eviction then takes the deepest blocks of a chain first. Evicting a parent first would leave its
        descendants unreachable (a lookup stops at the first missing block) while they still use memory.
        Caller holds the lock.
        """
        for block in reversed(chain):
            if block in self._entries:
                self._entries.move_to_end(block)

    def replicas(self) -> set[str]:
        with self._lock:
            return set().union(*(e.replicas for e in self._entries.values())) if self._entries else set()
