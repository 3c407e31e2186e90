"""Router-side back-pressure: bounded per-class queues; over the bound a request is refused with a Retry-After.
Pure: no Ray, no vLLM; clocks are injected so tests are deterministic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from app.classes import RequestClass
from app.lanes.admission import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, AdmissionResult, Decision

Clock = Callable[[], float]

# --------------------------------------------------------------------------------------------------------------------
# Back-pressure
# --------------------------------------------------------------------------------------------------------------------


class DrainRateEstimator:
    """Completions per second, exponentially weighted in continuous time.

    Each completion adds 1/tau to the rate; the rate decays by exp(-dt/tau) between events (and when read), so a
    steady stream of r completions/s converges to r and a stalled queue drifts toward 0. Unlike a fixed-window count
    it needs no buckets and reacts smoothly.
    """

    def __init__(self, time_constant_s: float, clock: Clock = time.monotonic):
        if time_constant_s <= 0:
            raise ValueError(f"time_constant_s must be > 0, got {time_constant_s}")
        self._tau = time_constant_s
        self._clock = clock
        self._rate = 0.0
        self._last: float | None = None

    def _decayed(self, now: float) -> float:
        if self._last is None:
            return 0.0
        return self._rate * math.exp(-max(0.0, now - self._last) / self._tau)

    def record_completion(self, count: int = 1) -> None:
        now = self._clock()
        self._rate = self._decayed(now) + count / self._tau
        self._last = now

    def rate_per_s(self) -> float:
        return self._decayed(self._clock())


def retry_after_seconds(queue_len: int, drain_rate_per_s: float) -> int:
    """How long until the queue ahead of a retrying client has drained: queue_len / rate, clamped to [1, 60] s.

    With no observed drain (rate 0) the queue is stuck as far as we know: the maximum.
    """
    if drain_rate_per_s <= 0:
        return RETRY_AFTER_MAX_S
    seconds = math.ceil(queue_len / drain_rate_per_s)
    return int(min(max(seconds, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S))


@dataclass
class BackPressure:
    """Bounded per-class queues in the router.

    Call `try_enqueue` when a request arrives; if admitted, call `dequeue` when it leaves the queue (starts on an
    engine, or is cancelled while waiting) and `record_completion` when it finishes, which feeds the drain rate.
    """

    bounds: Mapping[RequestClass, int | None]
    clock: Clock = time.monotonic
    drain_time_constant_s: float = 10.0

    def __post_init__(self) -> None:
        for request_class, bound in self.bounds.items():
            if bound is not None and bound < 0:
                raise ValueError(f"queue bound for {request_class.value} must be >= 0 or None, got {bound}")
        self._queued: dict[RequestClass, int] = {c: 0 for c in RequestClass}
        self._drain = {c: DrainRateEstimator(self.drain_time_constant_s, self.clock) for c in RequestClass}

    def queued(self, request_class: RequestClass) -> int:
        return self._queued[request_class]

    def drain_rate_per_s(self, request_class: RequestClass) -> float:
        return self._drain[request_class].rate_per_s()

    def try_enqueue(self, request_class: RequestClass, lane_up: bool = True) -> AdmissionResult:
        queued = self._queued[request_class]
        if request_class is RequestClass.BATCH:
            # Batch is durable work: it waits for capacity however long the queue, unless its lane is gone.
            if not lane_up:
                return AdmissionResult(
                    Decision.REJECT, "lane_down", retry_after_seconds(queued, self.drain_rate_per_s(request_class))
                )
            self._queued[request_class] += 1
            return AdmissionResult(Decision.ADMIT, "batch_waits")
        bound = self.bounds.get(request_class)
        if bound is not None and queued >= bound:
            retry_after = retry_after_seconds(queued, self.drain_rate_per_s(request_class))
            return AdmissionResult(Decision.REJECT, f"queue_full ({queued} >= {bound})", retry_after)
        self._queued[request_class] += 1
        return AdmissionResult(Decision.ADMIT, "queued")

    def dequeue(self, request_class: RequestClass) -> None:
        if self._queued[request_class] <= 0:
            raise RuntimeError(f"dequeue() without try_enqueue() for {request_class.value}")
        self._queued[request_class] -= 1

    def record_completion(self, request_class: RequestClass) -> None:
        self._drain[request_class].record_completion()
