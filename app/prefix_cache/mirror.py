"""A copy of the prefix index in every process that routes, kept current by pulling the PrefixCache's changes.

Why: a lookup through a deployment handle is an RPC whose answer has to win the GIL back in a busy Router process
(one that streams tokens and, with direct ingress, serves HTTP itself). On the H200 at 14-27 req/s, 55-81 % of such
lookups missed their 5 ms budget and affinity fell back to load-only routing (docs/benchmarks.md). A local copy turns
the per-request lookup into a dictionary walk of microseconds; what is left remote is one small pull every
`sync_interval_s`, off the request path.

Two pure halves, no Ray:
- `IndexChangeLog` (in the PrefixCache, fed by SharedPrefixState): every change to the index as a numbered op, a
  bounded history of them, and `changes_since(epoch, seq)` answering with the ops a mirror lacks, or with a full
  snapshot when the mirror is new, too far behind, or from another PrefixCache instance (epoch).
- `IndexMirror` (in the Router process): applies those answers to its own PrefixIndex and answers lookups while it
  is fresh. A stale mirror (PrefixCache down or slow) answers nothing, so routing goes load-only, as with a failed
  lookup.

Ops are tuples so they pickle small: ("add", replica, hashes), ("remove", replica, hashes),
("remove_replica", replica), ("drop", hashes) (entries the PrefixCache evicted or expired, for every replica).

This module is imported by reference (not cloudpickled with the request router), so `shared_mirror` can keep one
mirror per process and PrefixCache for every lane deployment's router.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from app.prefix_cache.index import BlockHash, Match, PrefixIndex

Op = tuple
# History kept for mirrors that are behind; one farther behind gets a snapshot. Ops, not blocks.
MAX_LOGGED_OPS = 20_000
# A mirror's own bound is the PrefixCache's times this: it must never evict on its own before the PrefixCache's
# "drop" op for that block arrives (its least-recently-used order differs, as lookups touch only the mirror).
MIRROR_HEADROOM = 2


class IndexChangeLog:
    def __init__(self, epoch: str, max_ops: int = MAX_LOGGED_OPS):
        self.epoch = epoch
        self.seq = 0  # number of the last op appended
        self._ops: deque[tuple[int, Op]] = deque(maxlen=max_ops)
        self._lock = threading.Lock()

    def append(self, op: Op) -> None:
        with self._lock:
            self.seq += 1
            self._ops.append((self.seq, op))

    def changes_since(self, epoch: str | None, seq: int, index: PrefixIndex) -> dict[str, Any]:
        """What a mirror at (epoch, seq) needs: {"epoch", "seq", "ops": [...]} or {"epoch", "seq", "snapshot"}."""
        with self._lock:
            oldest = self._ops[0][0] if self._ops else self.seq + 1
            if epoch == self.epoch and seq == self.seq:
                return {"epoch": self.epoch, "seq": self.seq, "ops": []}
            if epoch == self.epoch and oldest <= seq + 1 <= self.seq + 1:
                return {"epoch": self.epoch, "seq": self.seq, "ops": [op for n, op in self._ops if n > seq]}
            # Taken under the log's lock: no op can slip in between the snapshot and its seq.
            return {"epoch": self.epoch, "seq": self.seq, "snapshot": index.snapshot()}


class IndexMirror:
    def __init__(self, max_entries: int, max_staleness_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries * MIRROR_HEADROOM
        self.max_staleness_s = max_staleness_s
        self.clock = clock
        self.index = PrefixIndex(max_entries=self.max_entries, clock=clock)
        self.epoch: str | None = None
        self.seq = 0
        self.synced_at: float | None = None
        self.snapshots = 0
        self.ops_applied = 0
        self.sync_errors = 0
        self.sync_task = None  # the process's sync loop (request_router.sync_mirror_forever), held here

    def cursor(self) -> tuple[str | None, int]:
        return self.epoch, self.seq

    def apply(self, changes: dict[str, Any]) -> None:
        """Apply one answer of IndexChangeLog.changes_since."""
        if "snapshot" in changes:
            self.index = PrefixIndex(max_entries=self.max_entries, clock=self.clock)
            self.index.load_snapshot(changes["snapshot"])
            self.snapshots += 1
        else:
            if changes["epoch"] != self.epoch:
                raise ValueError("changes from another PrefixCache instance: ask for a snapshot")
            for op in changes["ops"]:
                apply_op(self.index, op)
            self.ops_applied += len(changes["ops"])
        self.epoch, self.seq = changes["epoch"], changes["seq"]
        self.synced_at = self.clock()

    def sync_failed(self) -> None:
        self.sync_errors += 1

    def resync(self) -> None:
        """Ask for a snapshot at the next pull (forget the cursor); the entries answer lookups until it comes."""
        self.epoch, self.seq = None, 0

    def is_fresh(self) -> bool:
        return self.synced_at is not None and self.clock() - self.synced_at <= self.max_staleness_s

    def lookup(self, hashes: Sequence[BlockHash], block_size: int) -> list[Match] | None:
        """Longest matches per replica, or None while the mirror is stale (route on load)."""
        if not self.is_fresh():
            return None
        return self.index.longest_matches(hashes, block_size)

    def stats(self) -> dict[str, Any]:
        age = None if self.synced_at is None else round(self.clock() - self.synced_at, 3)
        return {"entries": len(self.index), "seq": self.seq, "age_s": age, "fresh": self.is_fresh(),
                "snapshots": self.snapshots, "ops_applied": self.ops_applied, "sync_errors": self.sync_errors}


def apply_op(index: PrefixIndex, op: Op) -> None:
    kind = op[0]
    if kind == "add":
        index.add(op[1], op[2])
    elif kind == "remove":
        index.remove(op[1], op[2])
    elif kind == "remove_replica":
        index.remove_replica(op[1])
    elif kind == "drop":
        index.drop(op[1])
    else:
        raise ValueError(f"unknown index op {kind!r}")


# --- one mirror per process and PrefixCache ------------------------------------------------------------------------
_mirrors: dict[tuple[str, str], IndexMirror] = {}
_mirrors_lock = threading.Lock()


def shared_mirror(app_name: str, deployment: str, max_entries: int, max_staleness_s: float) -> tuple[IndexMirror, bool]:
    """The process's mirror of this PrefixCache, and whether the caller created it (and so must keep it synced)."""
    with _mirrors_lock:
        key = (app_name, deployment)
        mirror = _mirrors.get(key)
        if mirror is not None:
            return mirror, False
        mirror = _mirrors[key] = IndexMirror(max_entries, max_staleness_s)
        return mirror, True


def mirror_stats() -> dict[str, dict[str, Any]]:
    """For the Router's admin stats: "app/deployment" -> the mirror's sync state."""
    with _mirrors_lock:
        return {f"{app}/{deployment}": mirror.stats() for (app, deployment), mirror in _mirrors.items()}
