"""AIMD concurrency window on synthetic measurement sequences."""

from __future__ import annotations

import pytest

from app.batch.window import ConcurrencyWindow
from app.config import BatchConfig

TARGET = 0.1  # seconds per output token


def make_window(min_size: int, max_size: int, *, slow_start: bool = False, interval_s: float = 1.0,
                **knobs) -> ConcurrencyWindow:
    """A window over the schema's batch settings with these bounds and TARGET; no slow start unless asked."""
    settings = BatchConfig(window_min=min_size, window_max=max_size, target_latency_per_token_s=TARGET,
                           window_interval_s=interval_s, window_slow_start=slow_start)
    return ConcurrencyWindow(settings, **knobs)


def feed(window: ConcurrencyWindow, start: float, duration: float, requests: int, tokens_each: int,
         latency_per_token: float) -> float:
    """Record `requests` finished requests spread over [start, start + duration); returns the interval's end."""
    window.begin(start)
    for i in range(requests):
        window.record(latency_per_token * tokens_each, tokens_each, start + duration * (i + 1) / requests)
    return start + duration


def test_starts_at_min_and_grows_by_one_while_throughput_improves():
    window = make_window(16, 32, min_samples=4)
    assert window.size == 16
    now = 0.0
    sizes = []
    for step in range(5):
        # Throughput rises 10 % per interval, latency well under target.
        now = feed(window, now, 1.0, requests=10 + step, tokens_each=100, latency_per_token=0.05)
        decision = window.update(now)
        sizes.append(decision.size)
        assert decision.reason == "grow"
    assert sizes == [17, 18, 19, 20, 21]


def test_holds_when_throughput_plateaus():
    window = make_window(16, 32, min_samples=4)
    now = feed(window, 0.0, 1.0, 10, 100, 0.05)
    assert window.update(now).reason == "grow"
    now = feed(window, now, 1.0, 10, 100, 0.05)  # same throughput
    decision = window.update(now)
    assert (decision.reason, decision.size) == ("hold", 17)


def test_halves_on_latency_above_target_but_never_below_min():
    window = make_window(16, 32, initial_size=30, min_samples=4)
    now = feed(window, 0.0, 1.0, 10, 100, 0.2)
    decision = window.update(now)
    assert (decision.reason, decision.size) == ("shrink", 16)
    assert decision.latency_per_token_s == pytest.approx(0.2)
    now = feed(window, now, 1.0, 10, 100, 0.3)
    assert window.update(now).size == 16


def test_never_exceeds_max():
    window = make_window(16, 18, min_samples=1)
    now = 0.0
    for step in range(6):
        now = feed(window, now, 1.0, 5 + 5 * step, 100, 0.01)
        window.update(now)
    assert window.size == 18


def test_sawtooth_is_deterministic():
    def run() -> list[int]:
        window = make_window(16, 32, min_samples=2)
        now, sizes = 0.0, []
        # Latency rises with the window (an engine that starts queueing past ~24 in flight).
        for step in range(40):
            latency = 0.05 if window.size < 24 else 0.15
            now = feed(window, now, 1.0, 10 + step, 50, latency)
            sizes.append(window.update(now).size)
        return sizes

    first, second = run(), run()
    assert first == second
    assert max(first) == 24 and min(first) >= 16
    assert 16 in first[first.index(24):]  # backed off multiplicatively after crossing the target


def test_waits_for_enough_samples_and_interval():
    window = make_window(16, 32, min_samples=8, interval_s=5.0)
    window.record(1.0, 10, now=1.0)
    assert window.update_if_due(now=2.0) is None  # interval not over
    assert window.update_if_due(now=10.0).reason == "too_few_samples"
    assert window.size == 16


def test_rejects_bad_bounds():
    with pytest.raises(ValueError):  # the schema validates the bounds
        BatchConfig(window_min=32, window_max=16)
    with pytest.raises(ValueError):
        make_window(16, 32, decrease_factor=1.0)


def test_slow_start_doubles_until_throughput_stops_improving_then_adds_one():
    window = make_window(8, 64, min_samples=4, slow_start=True)
    now, sizes = 0.0, []
    for requests in (10, 12, 14):  # throughput rising: 8 -> 16 -> 32 -> 64
        now = feed(window, now, 1.0, requests, 100, 0.05)
        sizes.append(window.update(now).size)
    assert sizes == [16, 32, 64]
    # At the cap it stays; a plateau ends slow start...
    now = feed(window, now, 1.0, 14, 100, 0.05)
    assert window.update(now).reason == "hold" and window.slow_start is False
    # ...after a shrink, growth is additive again.
    now = feed(window, now, 1.0, 14, 100, 0.5)
    assert window.update(now).size == 32
    now = feed(window, now, 1.0, 20, 100, 0.05)
    assert window.update(now).size == 33


def test_slow_start_ends_on_the_first_shrink():
    window = make_window(16, 64, min_samples=4, slow_start=True)
    now = feed(window, 0.0, 1.0, 10, 100, 0.5)  # latency above target at once
    assert window.update(now).reason == "shrink" and window.slow_start is False
    now = feed(window, now, 1.0, 20, 100, 0.05)
    assert window.update(now).size == 17


def test_restart_after_idle_measures_the_next_job_afresh():
    window = make_window(8, 64, min_samples=4, slow_start=True)
    now = feed(window, 0.0, 1.0, 10, 100, 0.05)
    window.update(now)
    now = feed(window, now, 1.0, 4, 100, 0.05)  # the job's tail: throughput falls, slow start ends
    assert window.update(now).reason == "hold" and window.slow_start is False and window.size == 16
    window.restart()
    assert window.size == 8 and window.slow_start is True
    # The next job's first interval starts when it begins, and doubles again.
    now = feed(window, now + 100.0, 1.0, 10, 100, 0.05)
    decision = window.update(now)
    assert decision.size == 16 and decision.throughput_tok_s == pytest.approx(1000.0)
