"""Router-side back-pressure: bounded per-class queues of admitted requests that have not started yet, and the
Retry-After of the requests turned away.

A request is queued from admission until its first token (waiting in the Router for a hot-lane slot, or inside an
engine before its prefill). Over its class's bound it is refused with 429 and a Retry-After the caller computes from
the lane's expected drain. Batch is never refused for load. Pure: no Ray, no vLLM.

With several tenants (API keys of more than one), one tenant may hold at most `tenant_share` of a class's bound:
while it floods, the rest of the queue stays open to the others.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping

from app.batch.store import DEFAULT_TENANT
from app.classes import RequestClass
from app.lanes.admission import AdmissionResult, Decision


class BackPressure:
    def __init__(self, bounds: Mapping[RequestClass, int | None]):
        for request_class, bound in bounds.items():
            if bound is not None and bound < 0:
                raise ValueError(f"queue bound for {request_class.value} must be >= 0 or None, got {bound}")
        self.bounds = dict(bounds)
        self._queued: dict[RequestClass, int] = {c: 0 for c in RequestClass}
        self._by_tenant: Counter[tuple[RequestClass, str]] = Counter()
        self.tenant_share = 1.0

    def share_between_tenants(self, share: float) -> None:
        """Several tenants send requests: each may hold at most `share` of a bound (1: no cap)."""
        self.tenant_share = share

    def queued(self, request_class: RequestClass) -> int:
        return self._queued[request_class]

    def try_enqueue(self, request_class: RequestClass, retry_after_s: Callable[[], int],
                    tenant: str = DEFAULT_TENANT) -> AdmissionResult:
        """Admit into the class's queue, or refuse with `retry_after_s()` (worked out only then) when the queue is
        at its bound, or the tenant at its share of it."""
        refusal = self.refusal(request_class, retry_after_s, tenant)
        if refusal is not None:
            return refusal
        self._queued[request_class] += 1
        self._by_tenant[request_class, tenant] += 1
        return AdmissionResult(Decision.ADMIT, "batch_waits" if request_class is RequestClass.BATCH else "queued")

    def refusal(self, request_class: RequestClass, retry_after_s: Callable[[], int],
                tenant: str = DEFAULT_TENANT) -> AdmissionResult | None:
        """What try_enqueue() would refuse now (nothing is taken), or None."""
        queued = self._queued[request_class]
        bound = None if request_class is RequestClass.BATCH else self.bounds.get(request_class)
        if bound is not None and queued >= bound:
            return AdmissionResult(Decision.REJECT, f"queue_full ({queued} >= {bound})", retry_after_s())
        if bound is not None and self.tenant_share < 1:
            own, cap = self._by_tenant[request_class, tenant], max(1, math.floor(bound * self.tenant_share))
            if own >= cap:
                return AdmissionResult(Decision.REJECT, f"queue_full (tenant's share {own} >= {cap})",
                                       retry_after_s())
        return None

    def dequeue(self, request_class: RequestClass, tenant: str = DEFAULT_TENANT) -> None:
        if self._queued[request_class] <= 0:
            raise RuntimeError(f"dequeue() without try_enqueue() for {request_class.value}")
        self._queued[request_class] -= 1
        self._by_tenant[request_class, tenant] -= 1
        if self._by_tenant[request_class, tenant] <= 0:
            del self._by_tenant[request_class, tenant]


class RetrySchedule:
    """Spreads the retries of refused clients over the time the lanes take to admit them.

    Every refused client that honours its Retry-After comes back at the time it was given. Were they all told the
    same "1 s", they would come back together, most to be refused again: the Router would spend its time answering
    429s, the burst of admitted ones would start together, and the waves would repeat. Instead each refusal gets the
    next free time in a schedule that advances by the lanes' admission interval (the time between two freed slots),
    starting no earlier than when the refused request could first be admitted: the k-th client refused in a backlog
    comes back about k admission intervals later, about when there is room for it. Once the schedule's last time has
    passed, it starts again from the present.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, min_s: int = 1, max_s: int = 60):
        if not 1 <= min_s <= max_s:
            raise ValueError(f"need 1 <= min_s <= max_s, got {min_s}, {max_s}")
        self.clock = clock
        self.min_s = min_s
        self.max_s = max_s
        self._next_at = 0.0

    def retry_after_s(self, earliest_s: float, admit_interval_s: float) -> int:
        """Retry-After (whole seconds, within [min_s, max_s]) for one more refused client, which cannot be admitted
        before `earliest_s` from now and of which the lanes admit one every `admit_interval_s`."""
        now = self.clock()
        if not math.isfinite(earliest_s):
            return self.max_s
        at = max(now + max(earliest_s, 0.0), self._next_at)
        if math.isfinite(admit_interval_s) and admit_interval_s > 0:
            # Never past the largest Retry-After: a client told max_s comes back then, whatever the schedule says.
            self._next_at = min(at + admit_interval_s, now + self.max_s)
        return int(min(max(math.ceil(at - now), self.min_s), self.max_s))
