"""The app-wide side of the per-key rate limits: one token bucket per key and kind, held by the PrefixCache (the
app's one shared-state deployment), from which every Router replica takes allowances. Pure, no Ray.

A bucket holds up to its per-minute limit and refills at limit / 60 per second (OpenAI's limits are per minute and
refill continuously). Routers do not ask per request: each takes a small allowance ahead and spends it locally
(app/router/rate_limits.py), so what all replicas admit together never exceeds the bucket.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

REFILL_WINDOW_S = 60.0

# One order: (bucket id, limit per minute, need, want, give back). The answer: (granted, level after).
Order = tuple[str, int, int, int, int]


class RateLedger:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._levels: dict[str, tuple[float, float]] = {}  # bucket id -> (level, when)

    def level(self, bucket: str, limit: int) -> float:
        now = self.clock()
        level, at = self._levels.get(bucket, (float(limit), now))
        # Rounded: clock differences in floating point would leave 0.999... where a whole request's worth is due.
        return min(float(limit), round(level + (now - at) * limit / REFILL_WINDOW_S, 6))

    def exchange(self, orders: Sequence[Order]) -> list[tuple[int, float]]:
        """Each order first gives back what a Router holds unspent, then takes `want` if the bucket holds it, else
        all it holds if that covers `need`, else nothing (a Router never holds a part that cannot serve a request)."""
        answers = []
        for bucket, limit, need, want, give_back in orders:
            level = min(float(limit), self.level(bucket, limit) + max(give_back, 0))
            if want > 0 and level >= want:
                granted = want
            elif need > 0 and level >= need:
                granted = int(level)
            else:
                granted = 0
            level -= granted
            self._levels[bucket] = (level, self.clock())
            answers.append((granted, level))
        return answers

    def stats(self) -> dict[str, float]:
        return {bucket: round(level, 1) for bucket, (level, _) in sorted(self._levels.items())}
