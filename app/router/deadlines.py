"""Per-class request deadlines: max(floor, 3 x rolling P99 of the class's end-to-end latency).

The tuning guide asks for request timeouts above 3 x P99: tight enough to abort a stuck sequence and free its KV
blocks, loose enough never to cut the slow tail of healthy traffic. Until a class has `min_samples` recent samples
its P99 means nothing, so the configured floor applies alone.
"""

from __future__ import annotations

import math
from collections import deque

from app.classes import RequestClass
from app.config import DeadlineConfig



def percentile_nearest_rank(values: list[float], q: float) -> float:
    """The q-th percentile (0 < q <= 100) by nearest rank: the smallest sample with at least q % at or below it."""
    if not values:
        raise ValueError("percentile of no samples")
    if not 0 < q <= 100:
        raise ValueError(f"q must be in (0, 100], got {q}")
    ordered = sorted(values)
    rank = math.ceil(q / 100 * len(ordered))
    return ordered[max(rank, 1) - 1]


class DeadlinePolicy:
    """Record the E2E latency of requests that completed normally; ask for the timeout of the next request.

    Only normal completions are recorded: a request cut by its own deadline would pull the P99 up to the deadline and
    ratchet the timeout upward.
    """

    def __init__(self, settings: DeadlineConfig) -> None:
        """`settings` is admission.deadlines of the schema, which validates every value (a P99 from fewer than
        min_samples samples is the maximum of a handful of requests, not a percentile)."""
        self.floors_s = {RequestClass.REALTIME: settings.realtime_timeout_floor_s,
                         RequestClass.INTERACTIVE: settings.interactive_timeout_floor_s,
                         RequestClass.BATCH: settings.batch_timeout_floor_s}
        self.multiplier = settings.p99_multiplier
        self.min_samples = settings.min_samples
        self._samples: dict[RequestClass, deque[float]] = {c: deque(maxlen=settings.window) for c in RequestClass}
        # P99 is recomputed lazily, once per change, not once per request.
        self._p99_cache: dict[RequestClass, float | None] = {}

    def record(self, request_class: RequestClass, e2e_s: float) -> None:
        if e2e_s < 0 or math.isnan(e2e_s):
            raise ValueError(f"e2e latency must be a non-negative number, got {e2e_s}")
        self._samples[request_class].append(e2e_s)
        self._p99_cache.pop(request_class, None)

    def sample_count(self, request_class: RequestClass) -> int:
        return len(self._samples[request_class])

    def p99_s(self, request_class: RequestClass) -> float | None:
        """Rolling P99 over the window, or None before `min_samples` samples."""
        if request_class not in self._p99_cache:
            samples = self._samples[request_class]
            self._p99_cache[request_class] = (
                percentile_nearest_rank(list(samples), 99) if len(samples) >= self.min_samples else None
            )
        return self._p99_cache[request_class]

    def timeout_s(self, request_class: RequestClass) -> float:
        floor = self.floors_s[request_class]
        p99 = self.p99_s(request_class)
        return floor if p99 is None else max(floor, self.multiplier * p99)
