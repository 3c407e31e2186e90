"""Per-class request deadlines: max(floor, 3 x rolling P99 of the class's end-to-end latency).

The tuning guide asks for request timeouts above 3 x P99: tight enough to abort a stuck sequence and free its KV
blocks, loose enough never to cut the slow tail of healthy traffic. Until a class has `min_samples` recent samples
its P99 means nothing, so the configured floor applies alone.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping

from app.classes import RequestClass

DEFAULT_TIMEOUT_FLOORS_S: dict[RequestClass, float] = {
    RequestClass.REALTIME: 15.0,
    RequestClass.INTERACTIVE: 60.0,
    RequestClass.BATCH: 600.0,
}
DEFAULT_P99_MULTIPLIER = 3.0
DEFAULT_WINDOW = 1000
# A P99 from fewer than 100 samples is the maximum of a handful of requests, not a percentile.
DEFAULT_MIN_SAMPLES = 100


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

    def __init__(
        self,
        floors_s: Mapping[RequestClass, float] | None = None,
        multiplier: float = DEFAULT_P99_MULTIPLIER,
        window: int = DEFAULT_WINDOW,
        min_samples: int = DEFAULT_MIN_SAMPLES,
    ) -> None:
        floors = dict(DEFAULT_TIMEOUT_FLOORS_S)
        floors.update(floors_s or {})
        if any(f <= 0 for f in floors.values()):
            raise ValueError(f"timeout floors must be > 0, got {floors}")
        if multiplier < 1:
            raise ValueError(f"multiplier must be >= 1 (a timeout below P99 cuts healthy requests), got {multiplier}")
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(f"need window >= 1 and 1 <= min_samples <= window, got {window=} {min_samples=}")
        self.floors_s = floors
        self.multiplier = multiplier
        self.min_samples = min_samples
        self._samples: dict[RequestClass, deque[float]] = {c: deque(maxlen=window) for c in RequestClass}
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
