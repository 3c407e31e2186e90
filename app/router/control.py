"""TrafficControl: one Router replica's admission state, tying the pure policies together. No Ray, no vLLM.

Lifecycle of a request: `admit()` on arrival (bounded per-class queue, 429 when full), `route()` (lane, priority,
clipped max_tokens, degrade reasons, or a refusal), `started()` at its first token (it leaves the queue), and
`finished()` once (breaker, deadline and drain-rate bookkeeping).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from app.config import AppConfig
from app.router.admission import AdmissionResult, BackPressure, Decision
from app.router.breaker import BreakerState, CircuitBreaker
from app.classes import Lane, RequestClass
from app.router.deadlines import DeadlinePolicy
from app.router.spill import LaneCaps, RouteDecision, RouteInputs, RouteRefusal, decide_route, predicted_queue_wait_s

# After a hot replica refuses an interactive request for KV headroom, treat the hot lane as saturated this long,
# so the next interactive requests spill straight away instead of each making the round trip.
HOT_SATURATION_MEMORY_S = 1.0
REASON_KV_HEADROOM = "hot_kv_headroom"
# The drain-rate estimate starts at zero; until this many interactive requests have started, it would predict
# absurd waits and spill the first requests of a burst for nothing.
MIN_STARTS_FOR_WAIT_PREDICTION = 20
NO_DEADLINE_S = 24 * 3600.0


@dataclass
class Outcome:
    # Failures and timeouts count alike against the lane's breaker.
    ok: bool


class TrafficControl:
    def __init__(self, cfg: AppConfig, clock=time.monotonic):
        self.cfg = cfg
        self.enabled = cfg.admission.enabled
        admission = cfg.admission
        self.clock = clock
        self.back_pressure = BackPressure(
            bounds={RequestClass.REALTIME: admission.realtime_queue_bound,
                    RequestClass.INTERACTIVE: admission.interactive_queue_bound,
                    RequestClass.BATCH: None},
            clock=clock, drain_time_constant_s=admission.drain_rate_time_constant_s,
        )
        breaker = admission.breaker
        self.breakers = {
            Lane(name): CircuitBreaker(
                failure_threshold=breaker.failure_threshold, failure_window_s=breaker.failure_window_s,
                cooldown_s=breaker.cooldown_s, half_open_max_probes=breaker.half_open_max_probes,
                success_threshold=breaker.success_threshold, clock=clock)
            for name in cfg.lane_names
        }
        deadlines = admission.deadlines
        self.deadlines = DeadlinePolicy(
            floors_s={RequestClass.REALTIME: deadlines.realtime_timeout_floor_s,
                      RequestClass.INTERACTIVE: deadlines.interactive_timeout_floor_s,
                      RequestClass.BATCH: deadlines.batch_timeout_floor_s},
            multiplier=deadlines.p99_multiplier, window=deadlines.window, min_samples=deadlines.min_samples,
        )
        self.lane_caps = {
            Lane(name): LaneCaps(cfg.model.max_model_len, cfg.lane(name).max_tokens_cap) for name in cfg.lane_names
        }
        self._hot_saturated_until = 0.0
        self._interactive_starts = 0
        # Batch requests of this Router on each lane, from the lane call until the request ends (Generation).
        self.batch_in_flight = {Lane.HOT: 0, Lane.COLD: 0}
        # High-water marks of the above: lets an operator (and a test) see the slots and loans hold.
        self.batch_in_flight_peak = {Lane.HOT: 0, Lane.COLD: 0}
        # This Router's share of the cold lane's batch slots (the dispatcher's window share), read when a batch
        # request is routed; the Router wires it. Until then (None) the cold lane never counts as full: no loans.
        self.cold_batch_slots: Callable[[], int] | None = None
        # Called whenever a batch request ends (its slot is free): the Router wakes a batch request waiting for one.
        self.on_batch_slot_freed: Callable[[], None] | None = None

    # ---- arrival ----------------------------------------------------------------------------------------------

    def admit(self, request_class: RequestClass) -> AdmissionResult:
        if not self.enabled:
            return AdmissionResult(Decision.ADMIT, "admission_disabled")
        # A lane that is down is route()'s business (503 with the breaker's Retry-After), not a full queue's (429).
        return self.back_pressure.try_enqueue(request_class)

    def route(self, request_class: RequestClass, prompt_tokens: int, max_tokens: int) -> RouteDecision | RouteRefusal:
        admission = self.cfg.admission
        open_breakers = {lane: b.retry_after_s() for lane, b in self.breakers.items()
                         if b.state is BreakerState.OPEN}
        if not self.enabled:
            return decide_route(RouteInputs(request_class, prompt_tokens, max_tokens, self.lane_caps,
                                            long_context_threshold=10**12, open_breakers=open_breakers))
        queue = self.back_pressure.queued(RequestClass.INTERACTIVE)
        drain = self.back_pressure.drain_rate_per_s(RequestClass.INTERACTIVE)
        hot_batch_slots = self._hot_batch_slots() if request_class is RequestClass.BATCH else 0
        return decide_route(RouteInputs(
            request_class, prompt_tokens, max_tokens, self.lane_caps,
            long_context_threshold=admission.long_context_threshold,
            # The request itself is already counted in the queue: wait for the ones ahead of it.
            predicted_hot_wait_s=(predicted_queue_wait_s(max(queue - 1, 0), drain)
                                  if drain > 0 and self._interactive_starts >= MIN_STARTS_FOR_WAIT_PREDICTION
                                  else 0.0),
            interactive_ttft_slo_s=admission.interactive_ttft_slo_s,
            hot_saturated=self.clock() < self._hot_saturated_until,
            open_breakers=open_breakers,
            hot_batch_slots=hot_batch_slots,
        ))

    def _cold_share_full(self) -> bool:
        """Has this Router as many batch requests on the cold lane as its share of the slots (never, unwired)?"""
        return self.cold_batch_slots is not None and self.batch_in_flight[Lane.COLD] >= self.cold_batch_slots()

    def _hot_batch_slots(self) -> int:
        """Batch requests the hot lane may take now: only once this Router's cold share is full (a small batch stays
        on the cold lane and leaves the hot one alone), and only while nothing latency-bound waits here."""
        free_loans = self.cfg.admission.hot_batch_borrow_max - self.batch_in_flight[Lane.HOT]
        if free_loans <= 0 or not self._cold_share_full():
            return 0
        if self.back_pressure.queued(RequestClass.INTERACTIVE) or self.back_pressure.queued(RequestClass.REALTIME):
            return 0
        return free_loans

    @property
    def hot_batch_loans(self) -> int:
        """Batch requests of this Router running on the hot lane (admission.hot_batch_borrow_max bounds them)."""
        return self.batch_in_flight[Lane.HOT]

    def batch_started(self, lane: Lane) -> None:
        """A batch request went to `lane`; batch_ended(lane) exactly once when it is over."""
        self.batch_in_flight[lane] += 1
        self.batch_in_flight_peak[lane] = max(self.batch_in_flight_peak[lane], self.batch_in_flight[lane])

    def batch_ended(self, lane: Lane) -> None:
        self.batch_in_flight[lane] = max(0, self.batch_in_flight[lane] - 1)
        if self.on_batch_slot_freed is not None:
            self.on_batch_slot_freed()

    def batch_slot_free(self) -> bool:
        """May one more batch request start now: room in this Router's cold share, or a hot loan it may take?"""
        return not self._cold_share_full() or self._hot_batch_slots() > 0

    def may_spill(self, request_class: RequestClass, lane: Lane) -> bool:
        """May a hot replica send this request back for the cold lane (KV headroom) instead of waiting?"""
        cold = self.breakers.get(Lane.COLD)
        return (self.enabled and request_class is RequestClass.INTERACTIVE and lane is Lane.HOT
                and cold is not None and cold.state is not BreakerState.OPEN)

    def hot_refused_for_kv(self) -> None:
        self._hot_saturated_until = self.clock() + HOT_SATURATION_MEMORY_S

    def allow(self, lane: Lane) -> bool:
        return self.breakers[lane].allow_request()

    def timeout_s(self, request_class: RequestClass) -> float:
        # A plain pool (admission off) has no deadlines either: a baseline must show its queueing as latency.
        return self.deadlines.timeout_s(request_class) if self.enabled else NO_DEADLINE_S

    # ---- progress -----------------------------------------------------------------------------------------------

    def started(self, request_class: RequestClass) -> None:
        if request_class is RequestClass.INTERACTIVE:
            self._interactive_starts += 1
        if self.enabled:
            self.back_pressure.dequeue(request_class)
            self.back_pressure.record_completion(request_class)

    def abandoned_before_start(self, request_class: RequestClass) -> None:
        if self.enabled:
            self.back_pressure.dequeue(request_class)

    def finished(self, request_class: RequestClass, lane: Lane, outcome: Outcome, e2e_s: float | None) -> None:
        breaker = self.breakers[lane]
        if outcome.ok:
            breaker.record_success()
            if e2e_s is not None:
                self.deadlines.record(request_class, e2e_s)
        else:
            breaker.record_failure()

    def breaker_states(self) -> dict[str, str]:
        return {lane.value: breaker.state.value for lane, breaker in self.breakers.items()}

    def queue_depths(self) -> dict[str, int]:
        return {c.value: self.back_pressure.queued(c) for c in RequestClass}
