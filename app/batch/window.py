"""Dynamic concurrency window for a cold-lane replica: how many batch requests to keep in flight (the schema's
batch.window_min..window_max, 16-32 by default: the tuning guide's dynamic batch range).

AIMD on measured numbers, one decision per observation interval:
- latency (time per output token, which includes time queued inside the engine) above target -> multiplicative
  decrease (x decrease_factor, never below min_size): the engine is queueing, so back off fast;
- latency within target and throughput (output tokens/s) improved by at least min_throughput_gain over the previous
  interval -> additive increase (+1, never above max_size): more concurrency is still buying throughput;
- otherwise hold: more in flight would only add queueing.
With slow_start (as TCP's), the window doubles instead of adding one until the first hold or shrink: a batch job
that lasts a few intervals otherwise never gets near max_size (on the CPU a 21 s job ran at 32-37 of 64 slots,
docs/benchmarks.md).
Pure and deterministic: callers pass timestamps; nothing reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from app.config import BatchConfig


@dataclass(frozen=True)
class WindowSample:
    latency_s: float  # request start to last token
    output_tokens: int


@dataclass(frozen=True)
class WindowDecision:
    size: int
    reason: str  # "grow", "shrink", "hold", "too_few_samples"
    throughput_tok_s: float | None
    latency_per_token_s: float | None


class ConcurrencyWindow:
    def __init__(self, settings: BatchConfig, *, initial_size: int | None = None, decrease_factor: float = 0.5,
                 min_throughput_gain: float = 0.02, min_samples: int = 8):
        """`settings` is the schema's batch section, which validates its values: window_min / window_max (the
        bounds), target_latency_per_token_s, window_interval_s and window_slow_start. The keywords are the AIMD
        rule's own knobs."""
        if not 0 < decrease_factor < 1:
            raise ValueError(f"decrease_factor={decrease_factor} must be in (0, 1)")
        self.min_size = settings.window_min
        self.max_size = settings.window_max
        self.size = min(max(initial_size if initial_size is not None else self.min_size, self.min_size), self.max_size)
        self.target_latency_per_token_s = settings.target_latency_per_token_s
        self.decrease_factor = decrease_factor
        self.min_throughput_gain = min_throughput_gain
        self.min_samples = min_samples
        self.interval_s = settings.window_interval_s
        self.slow_start = settings.window_slow_start
        self._initial_size = self.size
        self._initial_slow_start = self.slow_start
        self._samples: list[WindowSample] = []
        self._interval_start: float | None = None
        self._previous_throughput: float | None = None

    def restart(self) -> None:
        """Back to the initial size and slow start, with no measurements: called when the dispatcher has gone idle,
        so the next job is measured on its own (as TCP restarts slow start after an idle period). Without it, the
        low-throughput interval at a job's tail would end slow start for good and the next job would start from
        wherever the last one left the window."""
        self.size = self._initial_size
        self.slow_start = self._initial_slow_start
        self._samples, self._interval_start, self._previous_throughput = [], None, None

    def begin(self, now: float) -> None:
        """Start the first observation interval (when dispatching starts); later intervals start themselves."""
        if self._interval_start is None:
            self._interval_start = now

    def record(self, latency_s: float, output_tokens: int, now: float) -> None:
        """One finished request. Without begin(), the first record starts the first interval."""
        if self._interval_start is None:
            self._interval_start = now
        self._samples.append(WindowSample(max(0.0, latency_s), max(0, int(output_tokens))))

    def update_if_due(self, now: float) -> WindowDecision | None:
        """Close the interval and decide, once interval_s has passed since it began; None before that."""
        if self._interval_start is None or now - self._interval_start < self.interval_s:
            return None
        return self.update(now)

    def update(self, now: float) -> WindowDecision:
        """Close the current observation interval at `now` and apply one AIMD step."""
        samples, start = self._samples, self._interval_start
        if len(samples) < self.min_samples or start is None:
            # Too little evidence: keep collecting into the same interval.
            return WindowDecision(self.size, "too_few_samples", None, None)
        self._samples, self._interval_start = [], now
        elapsed = max(now - start, 1e-9)
        tokens = sum(s.output_tokens for s in samples)
        throughput = tokens / elapsed
        latency_per_token = sum(s.latency_s for s in samples) / max(tokens, 1)
        previous, self._previous_throughput = self._previous_throughput, throughput
        if latency_per_token > self.target_latency_per_token_s:
            self.size = max(self.min_size, math.floor(self.size * self.decrease_factor))
            reason = "shrink"
            self.slow_start = False
        elif previous is None or throughput >= previous * (1 + self.min_throughput_gain):
            self.size = min(self.max_size, self.size * 2 if self.slow_start else self.size + 1)
            reason = "grow"
        else:
            reason = "hold"
            self.slow_start = False
        return WindowDecision(self.size, reason, throughput, latency_per_token)
