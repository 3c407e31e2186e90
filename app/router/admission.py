"""Router-side back-pressure: bounded per-class queues of admitted requests that have not started yet.

A request is queued from admission until its first token (waiting in the Router for a hot-lane slot, or inside an
engine before its prefill). Over its class's bound it is refused with 429 and a Retry-After the caller computes from
the lane's expected drain. Batch is never refused for load. Pure: no Ray, no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from app.classes import RequestClass
from app.lanes.admission import AdmissionResult, Decision


class BackPressure:
    def __init__(self, bounds: Mapping[RequestClass, int | None]):
        for request_class, bound in bounds.items():
            if bound is not None and bound < 0:
                raise ValueError(f"queue bound for {request_class.value} must be >= 0 or None, got {bound}")
        self.bounds = dict(bounds)
        self._queued: dict[RequestClass, int] = {c: 0 for c in RequestClass}

    def queued(self, request_class: RequestClass) -> int:
        return self._queued[request_class]

    def try_enqueue(self, request_class: RequestClass, retry_after_s: Callable[[], int]) -> AdmissionResult:
        """Admit into the class's queue, or refuse with `retry_after_s()` (worked out only then) when the queue is
        at its bound."""
        queued = self._queued[request_class]
        bound = None if request_class is RequestClass.BATCH else self.bounds.get(request_class)
        if bound is not None and queued >= bound:
            return AdmissionResult(Decision.REJECT, f"queue_full ({queued} >= {bound})", retry_after_s())
        self._queued[request_class] += 1
        return AdmissionResult(Decision.ADMIT, "batch_waits" if request_class is RequestClass.BATCH else "queued")

    def dequeue(self, request_class: RequestClass) -> None:
        if self._queued[request_class] <= 0:
            raise RuntimeError(f"dequeue() without try_enqueue() for {request_class.value}")
        self._queued[request_class] -= 1
