"""Which long prompt prefixes are reused most: the pinned prefixes that warm every new replica. Pure Python.

Every prompt of at least `min_prefix_tokens` tokens is a set of candidate prefixes: its first k full blocks for each
k whose length is >= `min_prefix_tokens`. A candidate is keyed by its last block's chained hash (which identifies the
whole prefix, see index.py) and counted with exponential decay, so a prefix that stopped being used fades out within
a few half-lives. A shared system prompt followed by unique questions thus scores high at every block boundary up to
the end of the shared part, and 1 beyond it.

`pinned()` returns the top `max_pinned_prefixes` candidates that were seen at least twice recently, most reused
first, preferring the longest prefix among equally reused ones and dropping a prefix that a chosen longer one
already contains (warming the longer one warms it too).

Memory is bounded: at most `max_tracked_prefixes` candidates; the token ids of all candidates cut from one prompt
share one compact array (4 bytes a token) of that prompt's prefix-relevant part.
"""

from __future__ import annotations

import math
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.prefix_cache.index import BlockHash, block_hashes

# Candidate prefixes tracked at most (the most popular stay); not a setting: it only bounds memory.
MAX_TRACKED_PREFIXES = 2048
# A decayed count at or above this means "seen at least twice recently" (two hits within about one half-life score
# above 1.5; a single hit never exceeds 1.0).
MIN_REUSE_SCORE = 1.5
# Prune only when the table has grown this much past its bound, so pruning (a sort) is amortised over many records.
PRUNE_SLACK = 1.25


@dataclass
class _Candidate:
    score: float
    updated_at: float
    tokens: array  # shared with the other candidates cut from the same prompt
    length: int  # this prefix is tokens[:length]


class PrefixPopularity:
    def __init__(
        self,
        block_size: int,
        min_prefix_tokens: int,
        max_pinned_prefixes: int,
        half_life_s: float,
        max_tracked_prefixes: int = MAX_TRACKED_PREFIXES,
        clock: Callable[[], float] = time.monotonic,
    ):
        """min_prefix_tokens, half_life_s: prefix_cache.min_prefix_tokens / popularity_half_life_s; max_pinned_prefixes:
        AppConfig.pinned_prefix_limit."""
        if block_size < 1 or min_prefix_tokens < 1 or max_pinned_prefixes < 0 or half_life_s <= 0:
            raise ValueError("block_size and min_prefix_tokens must be >= 1, max_pinned_prefixes >= 0, half_life_s > 0")
        if max_tracked_prefixes < max(1, max_pinned_prefixes):
            raise ValueError("max_tracked_prefixes must be >= max_pinned_prefixes and >= 1")
        self.block_size = block_size
        self.min_prefix_tokens = min_prefix_tokens
        self.max_pinned_prefixes = max_pinned_prefixes
        self.max_tracked_prefixes = max_tracked_prefixes
        self.half_life_s = half_life_s
        self._clock = clock
        self._candidates: dict[BlockHash, _Candidate] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._candidates)

    def _decayed(self, candidate: _Candidate, now: float) -> float:
        return candidate.score * math.pow(0.5, max(0.0, now - candidate.updated_at) / self.half_life_s)

    def record(self, token_ids: Sequence[int], hashes: Sequence[BlockHash] | None = None) -> None:
        """Count one use of every long prefix of this prompt. `hashes` (its block_hashes) saves re-hashing."""
        if len(token_ids) < self.min_prefix_tokens:
            return
        if hashes is None:
            hashes = block_hashes(token_ids, self.block_size)
        first_block = -(-self.min_prefix_tokens // self.block_size)  # blocks needed to reach min_prefix_tokens
        if len(hashes) < first_block:
            return
        now = self._clock()
        shared_tokens: array | None = None
        with self._lock:
            for depth in range(first_block, len(hashes) + 1):
                key = hashes[depth - 1]
                candidate = self._candidates.get(key)
                if candidate is None:
                    if shared_tokens is None:
                        shared_tokens = array("I", token_ids[: len(hashes) * self.block_size])
                    self._candidates[key] = _Candidate(1.0, now, shared_tokens, depth * self.block_size)
                else:
                    candidate.score = self._decayed(candidate, now) + 1.0
                    candidate.updated_at = now
            if len(self._candidates) > self.max_tracked_prefixes * PRUNE_SLACK:
                self._prune(now)

    def _prune(self, now: float) -> None:
        ranked = sorted(self._candidates.items(), key=lambda kv: self._decayed(kv[1], now), reverse=True)
        self._candidates = dict(ranked[: self.max_tracked_prefixes])

    def pinned(self) -> list[list[int]]:
        """Token ids of the most reused long prefixes, most reused first (at most max_pinned_prefixes)."""
        now = self._clock()
        with self._lock:
            scored = [
                (self._decayed(c, now), c.length, c)
                for c in self._candidates.values()
                if self._decayed(c, now) >= MIN_REUSE_SCORE
            ]
        scored.sort(key=lambda item: (item[0], item[1]), reverse=True)
        chosen: list[list[int]] = []
        covered: set[BlockHash] = set()  # chained hashes of every block of every chosen prefix
        for _, length, candidate in scored:
            if len(chosen) >= self.max_pinned_prefixes:
                break
            prefix = candidate.tokens[:length].tolist()
            chain = block_hashes(prefix, self.block_size)
            if chain[-1] in covered:
                continue  # a longer chosen prefix already contains this one
            covered.update(chain)
            chosen.append(prefix)
        return chosen
