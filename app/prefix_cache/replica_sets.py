"""The replicas of each lane that this process's handles can route to, as Serve's request routers see them. No Ray.

Serve's request router of a deployment learns the RUNNING replicas from the controller (a killed replica leaves that
list after its health check, `health_check_period_s`) and drops a replica at once when a call to it fails because
its actor died. A lane with no replica left is one whose requests would wait in the handle for a replacement: the
Router reads it here (`routable_replicas`) and serves them on the other lane meanwhile (app/router/spill.py, rule 6).

The lanes' request routers (request_router.py) report here. That module is pickled by value into every process
that routes; this one is imported by reference, so each process has one registry, shared by all of its routers of a
deployment (a handle and the handles made from it with `.options()` may each have one). Routers may run on an event
loop of their own (RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP): the registry is guarded by a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class _ReplicaSet:
    # The controller's last list of RUNNING replicas (full replica ids), as a router received it.
    listed: frozenset[str] = frozenset()
    # Listed replicas a router saw die (a call failed with the actor dead) before the controller took them off.
    died: set[str] = field(default_factory=set)

    def routable(self) -> int:
        return len(self.listed - self.died)


_SETS: dict[str, _ReplicaSet] = {}
_LOCK = threading.Lock()


def replicas_listed(deployment: str, replica_ids: Iterable[str]) -> None:
    """A router of `deployment` received the controller's list of its running replicas."""
    listed = frozenset(replica_ids)
    with _LOCK:
        replica_set = _SETS.setdefault(deployment, _ReplicaSet())
        replica_set.listed = listed
        replica_set.died &= listed  # a replica off the list needs no more remembering


def replica_died(deployment: str, replica_id: str) -> None:
    """A router of `deployment` saw a call to `replica_id` fail because its actor died."""
    with _LOCK:
        replica_set = _SETS.setdefault(deployment, _ReplicaSet())
        if replica_id in replica_set.listed:
            replica_set.died.add(replica_id)


def routable_replicas(deployment: str) -> int | None:
    """Replicas of `deployment` a handle in this process can send a call to now; None before any router of it has
    received a list (no call made yet: nothing known, so nothing is assumed down)."""
    with _LOCK:
        replica_set = _SETS.get(deployment)
        return replica_set.routable() if replica_set is not None else None


def forget_all() -> None:
    """Tests: start from an empty registry."""
    with _LOCK:
        _SETS.clear()
