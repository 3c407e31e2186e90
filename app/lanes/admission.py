"""Lane-side admission: what a hot replica lets into its engine. Pure (no Ray, no vLLM).

- `PriorityGate`: an asyncio semaphore with per-class in-flight limits and a priority-ordered wait queue in front of
  the engine. A hot replica gets one with `realtime_max_inflight` (the tuning guide's "batch <= 4" real-time queue).
- `kv_headroom_decision`: keeps `realtime_kv_reserve` of a hot replica's KV cache free for realtime requests.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from app.classes import RequestClass, policy_for

Clock = Callable[[], float]

# Retry-After is clamped: under 1 s clients hammer us, over 60 s they give up on a service that may recover sooner.
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60


class Decision(str, Enum):
    ADMIT = "admit"
    WAIT = "wait"
    SPILL = "spill"
    REJECT = "reject"


@dataclass(frozen=True)
class AdmissionResult:
    decision: Decision
    reason: str
    # Set on REJECT: seconds the client should wait before retrying (the Retry-After header).
    retry_after_s: int | None = None

    @property
    def admitted(self) -> bool:
        return self.decision is Decision.ADMIT


# --------------------------------------------------------------------------------------------------------------------
# Real-time gate: a priority semaphore in front of the engine
# --------------------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Waiter:
    priority: int
    seq: int
    request_class: RequestClass
    future: asyncio.Future[None]

    @property
    def order(self) -> tuple[int, int]:
        return (self.priority, self.seq)


class PriorityGate:
    """Limits requests in flight per class (and optionally in total); waiters are served best priority first.

    Lower priority numbers go first (realtime < interactive < batch, as vLLM's priority scheduler orders them), FIFO
    within one priority. A waiter whose own class is at its limit does not block waiters of other classes behind it:
    a fifth realtime request waiting for a realtime slot must not hold back interactive requests that have room.
    A waiting task that is cancelled (client disconnect, deadline) leaves the queue and takes no slot.
    """

    def __init__(
        self,
        class_limits: Mapping[RequestClass, int] | None = None,
        total_limit: int | None = None,
    ) -> None:
        limits = dict(class_limits or {})
        for request_class, limit in limits.items():
            if limit < 1:
                raise ValueError(f"in-flight limit for {request_class.value} must be >= 1, got {limit}")
        if total_limit is not None and total_limit < 1:
            raise ValueError(f"total_limit must be >= 1 or None, got {total_limit}")
        self._class_limits = limits
        self._total_limit = total_limit
        self._inflight: dict[RequestClass, int] = {c: 0 for c in RequestClass}
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    @classmethod
    def for_hot_replica(
        cls, realtime_max_inflight: int, total_limit: int | None = None
    ) -> "PriorityGate":
        return cls({RequestClass.REALTIME: realtime_max_inflight}, total_limit)

    def inflight(self, request_class: RequestClass | None = None) -> int:
        if request_class is None:
            return sum(self._inflight.values())
        return self._inflight[request_class]

    def waiting(self, request_class: RequestClass | None = None) -> int:
        return sum(1 for w in self._waiters if request_class is None or w.request_class is request_class)

    def has_room(self, request_class: RequestClass) -> bool:
        """Would a request of this class be granted a slot right now?"""
        return self._has_room(request_class)

    def _has_room(self, request_class: RequestClass) -> bool:
        if self._total_limit is not None and self.inflight() >= self._total_limit:
            return False
        limit = self._class_limits.get(request_class)
        return limit is None or self._inflight[request_class] < limit

    def _grant_waiters(self) -> None:
        for waiter in sorted(self._waiters, key=lambda w: w.order):
            if self._total_limit is not None and self.inflight() >= self._total_limit:
                return
            if waiter.future.done() or not self._has_room(waiter.request_class):
                continue
            self._waiters.remove(waiter)
            self._inflight[waiter.request_class] += 1
            waiter.future.set_result(None)

    async def acquire(self, request_class: RequestClass, priority: int | None = None) -> None:
        """Wait for a slot. `priority` defaults to the class's vLLM priority (a spilled request may carry another)."""
        waiter = _Waiter(
            priority=policy_for(request_class).priority if priority is None else priority,
            seq=next(self._seq),
            request_class=request_class,
            future=asyncio.get_running_loop().create_future(),
        )
        self._waiters.append(waiter)
        self._grant_waiters()
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                # The slot was granted just before the cancellation landed: hand it on, or it leaks.
                self.release(request_class)
            else:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                self._grant_waiters()
            raise

    def release(self, request_class: RequestClass) -> None:
        if self._inflight[request_class] <= 0:
            raise RuntimeError(f"release() without acquire() for {request_class.value}")
        self._inflight[request_class] -= 1
        self._grant_waiters()

    def slot(self, request_class: RequestClass, priority: int | None = None) -> "_GateSlot":
        """`async with gate.slot(RequestClass.REALTIME): ...` holds one slot for the body."""
        return _GateSlot(self, request_class, priority)


@dataclass
class _GateSlot:
    gate: PriorityGate
    request_class: RequestClass
    priority: int | None

    async def __aenter__(self) -> None:
        await self.gate.acquire(self.request_class, self.priority)

    async def __aexit__(self, *exc_info: object) -> None:
        self.gate.release(self.request_class)


# --------------------------------------------------------------------------------------------------------------------
# KV headroom
# --------------------------------------------------------------------------------------------------------------------


def kv_headroom_decision(
    request_class: RequestClass,
    kv_usage: float,
    realtime_kv_reserve: float,
    *,
    can_spill: bool = False,
    can_wait: bool = True,
) -> AdmissionResult:
    """May a new request of this class start on a hot replica whose KV cache is `kv_usage` full (0..1)?

    Realtime is admitted until the cache is full; everyone else only while usage <= 1 - reserve, so the reserve is
    there when a realtime request arrives. A refused interactive request spills to the cold lane if it may, else waits
    if it may, else is rejected (429). Batch on a hot replica (only after a degrade) never gets REJECT: it waits.
    """
    if not 0.0 <= realtime_kv_reserve < 1.0:
        raise ValueError(f"realtime_kv_reserve={realtime_kv_reserve} must be in [0, 1)")
    if math.isnan(kv_usage):
        raise ValueError("kv_usage is NaN: pass a fresh reading from the engine")
    usage = min(max(kv_usage, 0.0), 1.0)
    if request_class is RequestClass.REALTIME:
        if usage < 1.0:
            return AdmissionResult(Decision.ADMIT, "realtime_within_kv")
        return AdmissionResult(Decision.WAIT, "kv_full")
    limit = 1.0 - realtime_kv_reserve
    if usage <= limit:
        return AdmissionResult(Decision.ADMIT, "within_kv_headroom")
    reason = f"kv_reserve_for_realtime (usage {usage:.2f} > {limit:.2f})"
    if request_class is RequestClass.INTERACTIVE and can_spill:
        return AdmissionResult(Decision.SPILL, reason)
    if can_wait or request_class is RequestClass.BATCH:
        return AdmissionResult(Decision.WAIT, reason)
    return AdmissionResult(Decision.REJECT, reason, retry_after_s=RETRY_AFTER_MIN_S)
