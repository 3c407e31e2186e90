import pytest

from app.config import BreakerConfig
from app.router.breaker import HALF_OPEN_BUSY_RETRY_AFTER_S, BreakerState, CircuitBreaker
from tests.fakes import FakeClock


def make(clock, **kwargs) -> CircuitBreaker:
    params = dict(failure_threshold=3, failure_window_s=10, cooldown_s=5, half_open_max_probes=1, success_threshold=2)
    params.update(kwargs)
    return CircuitBreaker(BreakerConfig(**params), clock=clock)


def trip(breaker: CircuitBreaker) -> None:
    for _ in range(breaker.failure_threshold):
        breaker.record_failure()


def test_opens_after_n_consecutive_failures_and_fails_fast():
    clock = FakeClock()
    breaker = make(clock)
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED and breaker.allow_request()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert not breaker.allow_request()
    assert breaker.retry_after_s() == pytest.approx(5)
    clock.advance(3.2)
    assert breaker.retry_after_s() == pytest.approx(1.8)
    assert breaker.retry_after_header() == 2


def test_success_resets_the_failure_streak():
    breaker = make(FakeClock())
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED


def test_failures_outside_the_window_do_not_count():
    clock = FakeClock()
    breaker = make(clock)
    breaker.record_failure()
    clock.advance(6)
    breaker.record_failure()
    clock.advance(6)  # the first failure is now 12 s old, outside the 10 s window
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure()  # three within 10 s: 6, 12 (relative) and now
    assert breaker.state is BreakerState.OPEN


def test_half_open_after_cooldown_allows_limited_probes():
    clock = FakeClock()
    breaker = make(clock, half_open_max_probes=2)
    trip(breaker)
    clock.advance(4.99)
    assert breaker.state is BreakerState.OPEN
    clock.advance(0.01)
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow_request() and breaker.allow_request()
    assert not breaker.allow_request()
    assert breaker.retry_after_s() == HALF_OPEN_BUSY_RETRY_AFTER_S


def test_half_open_closes_after_m_successes():
    clock = FakeClock()
    breaker = make(clock)
    trip(breaker)
    clock.advance(5)
    assert breaker.allow_request()
    assert not breaker.allow_request()  # one probe at a time
    breaker.record_success()
    assert breaker.state is BreakerState.HALF_OPEN  # M = 2
    assert breaker.allow_request()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
    assert breaker.allow_request() and breaker.retry_after_s() == 0
    # A fresh streak is needed to open again.
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED


def test_failure_in_half_open_reopens_with_fresh_cooldown():
    clock = FakeClock()
    breaker = make(clock)
    trip(breaker)
    clock.advance(5)
    assert breaker.allow_request()
    breaker.record_success()
    assert breaker.allow_request()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert breaker.retry_after_s() == pytest.approx(5)
    clock.advance(5)
    assert breaker.state is BreakerState.HALF_OPEN
    # The earlier probe success does not carry over into the new half-open period.
    assert breaker.allow_request()
    breaker.record_success()
    assert breaker.state is BreakerState.HALF_OPEN


def test_late_outcomes_while_open_change_nothing():
    clock = FakeClock()
    breaker = make(clock)
    trip(breaker)
    clock.advance(3)
    breaker.record_failure()  # does not extend the cooldown
    breaker.record_success()  # does not close it
    assert breaker.state is BreakerState.OPEN
    clock.advance(2)
    assert breaker.state is BreakerState.HALF_OPEN


def test_cancelled_probe_frees_its_slot():
    clock = FakeClock()
    breaker = make(clock)
    trip(breaker)
    clock.advance(5)
    assert breaker.allow_request()
    assert not breaker.allow_request()
    breaker.record_cancelled()
    assert breaker.allow_request()
    assert breaker.state is BreakerState.HALF_OPEN


def test_defaults_are_usable():
    breaker = CircuitBreaker(BreakerConfig())
    assert breaker.state is BreakerState.CLOSED and breaker.allow_request()
