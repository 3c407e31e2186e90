"""Circuit breaker per lane: a pure state machine with an injected clock.

CLOSED --(N consecutive failures within window_s)--> OPEN --(cooldown_s elapsed)--> HALF_OPEN
HALF_OPEN --(M consecutive probe successes)--> CLOSED;  HALF_OPEN --(any probe failure)--> OPEN (cooldown restarts)

While OPEN the router fails fast (503 + Retry-After) or reroutes interactive traffic to the other lane. HALF_OPEN lets
at most `half_open_max_probes` requests through at a time to test the lane.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from enum import Enum

from app.config import BreakerConfig

Clock = Callable[[], float]

# A half-open breaker whose probe slots are taken tells callers to come back shortly: the probe answers soon.
HALF_OPEN_BUSY_RETRY_AFTER_S = 1.0


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, settings: BreakerConfig, clock: Clock = time.monotonic) -> None:
        """`settings` is admission.breaker of the schema, which validates every value."""
        self.failure_threshold = settings.failure_threshold
        self.failure_window_s = settings.failure_window_s
        self.cooldown_s = settings.cooldown_s
        self.half_open_max_probes = settings.half_open_max_probes
        self.success_threshold = settings.success_threshold
        self._clock = clock
        self._state = BreakerState.CLOSED
        # Times of the current streak of consecutive failures (a success clears it).
        self._failure_times: deque[float] = deque()
        self._opened_at = 0.0
        self._probes_in_flight = 0
        self._probe_successes = 0

    @property
    def state(self) -> BreakerState:
        # OPEN turns HALF_OPEN by the passage of time alone, so the state is evaluated when read.
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self._state = BreakerState.HALF_OPEN
            self._probes_in_flight = 0
            self._probe_successes = 0
        return self._state

    def allow_request(self) -> bool:
        """True if a request may go to the lane now. In HALF_OPEN this takes a probe slot: report its outcome."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and self._probes_in_flight < self.half_open_max_probes:
            self._probes_in_flight += 1
            return True
        return False

    def retry_after_s(self) -> float:
        """Seconds until the breaker will let a request through again (0 when it does now)."""
        state = self.state
        if state is BreakerState.OPEN:
            return max(0.0, self.cooldown_s - (self._clock() - self._opened_at))
        if state is BreakerState.HALF_OPEN and self._probes_in_flight >= self.half_open_max_probes:
            return HALF_OPEN_BUSY_RETRY_AFTER_S
        return 0.0

    def retry_after_header(self) -> int:
        """Retry-After as a header wants it: whole seconds, at least 1."""
        return max(1, math.ceil(self.retry_after_s()))

    def record_success(self) -> None:
        state = self.state
        if state is BreakerState.CLOSED:
            self._failure_times.clear()
        elif state is BreakerState.HALF_OPEN:
            self._release_probe()
            self._probe_successes += 1
            if self._probe_successes >= self.success_threshold:
                self._state = BreakerState.CLOSED
                self._failure_times.clear()
        # OPEN: a late success from a request admitted before the breaker opened proves nothing about now.

    def record_failure(self) -> None:
        """A failure or timeout of a request to the lane."""
        state = self.state
        now = self._clock()
        if state is BreakerState.CLOSED:
            self._failure_times.append(now)
            while self._failure_times and now - self._failure_times[0] > self.failure_window_s:
                self._failure_times.popleft()
            if len(self._failure_times) >= self.failure_threshold:
                self._open(now)
        elif state is BreakerState.HALF_OPEN:
            self._open(now)
        # OPEN: late failures of requests sent before opening do not extend the cooldown.

    def record_cancelled(self) -> None:
        """A request that ended without an outcome (client went away): frees its probe slot, counts nothing."""
        if self.state is BreakerState.HALF_OPEN:
            self._release_probe()

    def _release_probe(self) -> None:
        self._probes_in_flight = max(0, self._probes_in_flight - 1)

    def _open(self, now: float) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = now
        self._failure_times.clear()
        self._probes_in_flight = 0
        self._probe_successes = 0
