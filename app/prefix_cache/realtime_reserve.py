"""Realtime reserve: some hot-lane replicas are kept for realtime requests. Pure, no Ray, no I/O.

Why: an engine step cannot be preempted. A realtime prompt that reaches a hot engine while it prefills interactive
prompts waits for that step, then shares the next one with them; on the H200 that is what made realtime TTFT p99
miss 50 ms while its median was ~30 ms (docs/history.md, round 9). A replica that takes no interactive work
has no interactive step to wait for.

The rule (`admission.realtime_reserved_hot_replicas: N`):
- The first N hot replicas, by replica id, are reserved. Every Router process sorts the same ids, so all agree on
  which they are without talking to each other.
- A realtime request prefers the reserved replicas; every other request (interactive, a batch loan, a stats call)
  prefers the rest. Each falls back to the other set only when none of its own can take it (all full or gone),
  so a reserve never refuses work that another replica could serve.
- With N or fewer replicas alive there is no reserve: every replica serves everything, as if N were 0.
"""

from __future__ import annotations

from collections.abc import Sequence

RESERVED_FOR_CLASS = "realtime"


def reserved_replica_ids(replica_ids: Sequence[str], reserved: int) -> list[str]:
    """The replicas kept for realtime requests: the first `reserved` ids in sorted order, or none when that would
    leave no replica for the rest."""
    if reserved <= 0 or len(set(replica_ids)) <= reserved:
        return []
    return sorted(set(replica_ids))[:reserved]


def split_by_reserve(replica_ids: Sequence[str], request_class: str | None,
                     reserved: int) -> tuple[list[str], list[str]]:
    """(preferred, fallback) replica ids for a request of `request_class`, each in the order given."""
    kept = set(reserved_replica_ids(replica_ids, reserved))
    in_reserve = [r for r in replica_ids if r in kept]
    shared = [r for r in replica_ids if r not in kept]
    if request_class == RESERVED_FOR_CLASS and in_reserve:
        return in_reserve, shared
    return shared, in_reserve
