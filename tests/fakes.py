"""Fakes shared by the unit tests (no Ray, no engine)."""

from __future__ import annotations


class FakeClock:
    """A clock the test moves: `clock()` reads it (as time.monotonic / time.time would), `advance(s)` moves it.
    With `tick`, every read first moves it by that much (each read sees a later time, e.g. for LRU order)."""

    def __init__(self, now: float = 1000.0, tick: float = 0.0):
        self.now = now
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
