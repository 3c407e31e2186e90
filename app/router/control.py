"""TrafficControl: one Router replica's admission state, tying the pure policies together. No Ray, no vLLM.

Lifecycle of a request: `admit()` on arrival (bounded per-class queue, 429 when full), `route()` (the one routing
decision, from the present state: breakers, hot-lane slots, spill room, a lane's refusal), `started()` at its first
token (it leaves the queue), and `finished()` once per lane call (breaker and deadline bookkeeping).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace

from app.batch.store import DEFAULT_TENANT
from app.classes import Lane, RequestClass
from app.config import AppConfig
from app.lanes.admission import AdmissionResult, Decision
from app.router.admission import BackPressure, RetrySchedule
from app.router.breaker import BreakerState, CircuitBreaker
from app.router.deadlines import DeadlinePolicy
from app.router.hot_slots import LaneSlots
from app.router.lane_caps import LaneCaps
from app.router.spill import (
    RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, HotSlotState, RouteDecision, RouteInputs, RouteRefusal, decide_route,
)

# After a hot replica refuses an interactive request for KV headroom, treat the hot lane's KV as used up this long,
# so the next interactive requests spill straight away instead of each making the round trip.
HOT_KV_EXHAUSTED_MEMORY_S = 1.0
# A plain pool (admission off) has no deadlines: a baseline must show its queueing as latency.
NO_DEADLINE_S = 24 * 3600.0
# Without admission.cold_spill_slots_per_replica, spilled interactive requests may take this fraction (1/N) of a
# cold engine's sequences.
COLD_SPILL_SHARE_OF_SEQUENCES = 8
# Retry-After for a full realtime queue: realtime requests are short and the hot replicas' gate serves them first.
REALTIME_RETRY_AFTER_S = 1


def share(per_replica: int, replicas: int, routers: int) -> int:
    """This Router's part of `per_replica` x `replicas` slots split across `routers` Router replicas (rounded up,
    so a small lane is not starved by the split)."""
    if per_replica <= 0 or replicas <= 0:
        return 0
    return math.ceil(per_replica * replicas / max(routers, 1))


def cold_spill_slots_per_replica(cfg: AppConfig) -> int:
    """admission.cold_spill_slots_per_replica, or its default: an eighth of the cold engine's sequences."""
    configured = cfg.admission.cold_spill_slots_per_replica
    if configured is not None or cfg.cold_lane is None:
        return configured or 0
    return max(cfg.cold_lane.engine.max_num_seqs // COLD_SPILL_SHARE_OF_SEQUENCES, 1)


class TrafficControl:
    def __init__(self, cfg: AppConfig, clock=time.monotonic,
                 routable_replicas: Callable[[Lane], int | None] | None = None):
        """`routable_replicas(lane)`: the lane's replicas this Router's handle can send a request to now (None:
        not known yet); a lane with none is routed around (spill.py, rule 6)."""
        self.cfg = cfg
        self.routable_replicas = routable_replicas or (lambda lane: None)
        admission = cfg.admission
        self.enabled = admission.enabled
        self.clock = clock
        self.back_pressure = BackPressure({RequestClass.REALTIME: admission.realtime_queue_bound,
                                           RequestClass.INTERACTIVE: admission.interactive_queue_bound,
                                           RequestClass.BATCH: None})
        self.breakers = {Lane(name): CircuitBreaker(admission.breaker, clock=clock) for name in cfg.lane_names}
        self.retry_schedule = RetrySchedule(clock, RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S)
        self.deadlines = DeadlinePolicy(admission.deadlines)
        self.lane_caps = {
            Lane(name): LaneCaps(cfg.model.max_model_len, cfg.lane(name).max_tokens_cap) for name in cfg.lane_names
        }
        self._hot_kv_exhausted_until = 0.0
        # What admission aims at for an interactive first token, seen from the Router: the target less its headroom.
        self.interactive_ttft_target_s = admission.interactive_ttft_slo_s * (1 - admission.interactive_ttft_headroom)
        # Router-side slots exist only where there is a choice to make: admission on and a cold lane to spill to.
        self.hot_slots = (LaneSlots(0, clock=clock, tenant_weights=cfg.auth.tenant_weights)
                          if self.enabled and cfg.cold_lane is not None else None)
        self.cold_spill = LaneSlots(0, clock=clock) if self.hot_slots is not None else None
        self.set_replica_counts(hot=cfg.hot_lane.deployment.min_replicas,
                                cold=cfg.cold_lane.deployment.min_replicas if cfg.cold_lane is not None else 0,
                                routers=cfg.router.num_replicas)

    def set_replica_counts(self, hot: int, cold: int, routers: int) -> None:
        """Size this Router's slots from the running replicas (the Router reads them from the Serve controller)."""
        if self.hot_slots is None:
            return
        admission = self.cfg.admission
        reserved = admission.realtime_reserved_hot_replicas
        sequences = self.cfg.hot_lane.engine.max_num_seqs
        # A hot replica keeps room for its realtime queue, unless realtime has replicas of its own.
        per_hot = sequences if reserved else max(sequences - admission.realtime_max_inflight, 1)
        interactive_hot = max(hot - reserved, 1) if hot > 0 else 0
        self.hot_slots.set_limit(share(per_hot, interactive_hot, routers))
        self.cold_spill.set_limit(share(cold_spill_slots_per_replica(self.cfg), cold, routers))

    # ---- arrival ----------------------------------------------------------------------------------------------

    def admit(self, request_class: RequestClass, tenant: str = DEFAULT_TENANT) -> AdmissionResult:
        if not self.enabled:
            return AdmissionResult(Decision.ADMIT, "admission_disabled")
        # A lane that is down is route()'s business (503 with the breaker's Retry-After), not a full queue's (429).
        return self.back_pressure.try_enqueue(request_class, lambda: self._queue_retry_after_s(request_class),
                                              tenant)

    def refusal_before_render(self, request_class: RequestClass, prompt_tokens_bound: int | None, max_tokens: int,
                              tenant: str = DEFAULT_TENANT) -> AdmissionResult | RouteRefusal | None:
        """The 429 that admit() or route() would give this request whatever its exact prompt, decided before its
        prompt is rendered and tokenized, so that a refusal under load costs almost nothing; nothing is taken.
        `prompt_tokens_bound`: at most how many tokens the prompt has (None: unknown before rendering). None: render
        it and decide as usual. Only a certain refusal is given here, and only to a request that cannot be a 400
        once rendered: a prompt that may be empty or too long for the lanes, or long enough to be routed by its
        length, is rendered first."""
        if (not self.enabled or prompt_tokens_bound is None
                or prompt_tokens_bound + max_tokens > self.cfg.model.max_model_len):
            return None
        queue_full = self.back_pressure.refusal(request_class, lambda: self._queue_retry_after_s(request_class),
                                                tenant)
        if queue_full is not None:
            return queue_full
        if (request_class is not RequestClass.INTERACTIVE or self.hot_slots is None
                or prompt_tokens_bound >= self.cfg.admission.long_context_threshold):
            return None
        hot_slots = self._hot_slot_state(tenant)
        if hot_slots is None or hot_slots.free > 0:
            return None  # the common case, decided without the rest
        decision = self.route(request_class, prompt_tokens_bound, max_tokens, tenant=tenant)
        return decision if isinstance(decision, RouteRefusal) and decision.status == 429 else None

    def _queue_retry_after_s(self, request_class: RequestClass) -> int:
        if request_class is RequestClass.INTERACTIVE and self.hot_slots is not None:
            return self._interactive_retry_after_s(self.hot_slots.predicted_wait_s())
        return REALTIME_RETRY_AFTER_S

    def _interactive_retry_after_s(self, earliest_s: float) -> int:
        """Retry-After of one more refused interactive request, spread over the lanes' admission rate."""
        return self.retry_schedule.retry_after_s(earliest_s, self._interactive_admit_interval_s())

    def _interactive_admit_interval_s(self) -> float:
        """Mean time between two interactive requests the lanes take while full: hot slots and cold spill room
        together, each once it has a known, non-zero hold time (0 before either has one: nothing to spread by yet)."""
        per_s = 0.0
        for slots in (self.hot_slots, self.cold_spill):
            interval = slots.admit_interval_s() if slots is not None else None
            if interval is not None and 0 < interval < math.inf:
                per_s += 1.0 / interval
        return 1.0 / per_s if per_s > 0 else 0.0

    def route(self, request_class: RequestClass, prompt_tokens: int, max_tokens: int, *,
              has_stop_strings: bool = False, hot_refused_for_kv: bool = False, hot_wait_expired: bool = False,
              continuation: bool = False, waited_s: float = 0.0,
              tenant: str = DEFAULT_TENANT) -> RouteDecision | RouteRefusal:
        """The routing decision from the present state; `waited_s`: how long the request has been at the Router;
        `tenant`: whose request (the wait for a hot slot is its turn among the tenants waiting)."""
        admission = self.cfg.admission
        # A half-open breaker whose probes are taken refuses too (retry_after_s > 0): the decision moves or holds
        # the request instead of starting it into a refusal.
        open_breakers = {lane: wait for lane, b in self.breakers.items() if (wait := b.retry_after_s()) > 0}
        lanes_down = self.lanes_down()
        if not self.enabled:
            return decide_route(RouteInputs(request_class, prompt_tokens, max_tokens, self.lane_caps,
                                            long_context_threshold=10**12, open_breakers=open_breakers,
                                            lanes_down=lanes_down, continuation=continuation))
        hot_slots = self._hot_slot_state(tenant)
        # Spill room is only asked for when the hot lane cannot take the request now (spill.py, rule 5d).
        needs_spill_room = request_class is RequestClass.INTERACTIVE and (
            hot_wait_expired or (hot_slots is not None and hot_slots.free == 0))
        decision = decide_route(RouteInputs(
            request_class, prompt_tokens, max_tokens, self.lane_caps,
            long_context_threshold=admission.long_context_threshold,
            interactive_ttft_target_s=self.interactive_ttft_target_s,
            hot_slots=hot_slots,
            cold_spill_room=needs_spill_room and self._cold_spill_room(waited_s),
            hot_refused_for_kv=hot_refused_for_kv,
            hot_wait_expired=hot_wait_expired,
            hot_kv_exhausted=self.clock() < self._hot_kv_exhausted_until,
            open_breakers=open_breakers,
            lanes_down=lanes_down,
            realtime_ttft_target_s=admission.realtime_ttft_slo_s,
            cold_start_s=(self.cold_spill.start_latency_s() if Lane.HOT in lanes_down and self.cold_spill is not None
                          and request_class is RequestClass.REALTIME else 0.0),
            decode_handoff_tokens=admission.interactive_decode_handoff_tokens,
            has_stop_strings=has_stop_strings,
            continuation=continuation,
        ))
        if isinstance(decision, RouteRefusal) and decision.status == 429 and hot_slots is not None:
            earliest = hot_slots.predicted_wait_s - self.interactive_ttft_target_s
            decision = replace(decision, retry_after_s=self._interactive_retry_after_s(earliest))
        return decision

    def lanes_down(self) -> frozenset[Lane]:
        """Lanes with no replica this Router can send a request to now (lost, or none started yet). An app of one
        lane has nowhere else to serve them: its requests wait in Serve's handle for a replica, as before."""
        if self.cfg.cold_lane is None:
            return frozenset()
        return frozenset(lane for lane in self.breakers if self.routable_replicas(lane) == 0)

    def _hot_slot_state(self, tenant: str = DEFAULT_TENANT) -> HotSlotState | None:
        """Free hot slots, and the predicted first token of a request that would wait for one: the wait plus the
        time from a slot to the first token, against the TTFT target (only worked out when no slot is free)."""
        slots = self.hot_slots
        if slots is None:
            return None
        free = slots.free(tenant)
        if free:
            return HotSlotState(free, 0.0)
        return HotSlotState(0, slots.predicted_wait_s(tenant=tenant) + slots.start_latency_s(),
                            at_tenant_share=slots.at_share(tenant))

    def _cold_spill_room(self, waited_s: float) -> bool:
        """Room for one more spilled interactive request, whose first token the cold lane's recent start times say
        would come within the TTFT target."""
        spill = self.cold_spill
        # Until a spilled request has had its first token, one at a time: the first moment of a burst would
        # otherwise send the whole spill room at once into a lane whose start time under this load is unknown.
        if spill is None or spill.free() <= 0 or spill.first_start_pending():
            return False
        return waited_s + spill.start_latency_s() <= self.interactive_ttft_target_s

    def may_spill(self, request_class: RequestClass, lane: Lane) -> bool:
        """May a hot replica send this request back for the cold lane (KV headroom) instead of waiting?"""
        cold = self.breakers.get(Lane.COLD)
        return (self.enabled and request_class is RequestClass.INTERACTIVE and lane is Lane.HOT
                and cold is not None and cold.state is not BreakerState.OPEN)

    def hot_refused_for_kv(self) -> None:
        self._hot_kv_exhausted_until = self.clock() + HOT_KV_EXHAUSTED_MEMORY_S

    def allow(self, lane: Lane) -> bool:
        return self.breakers[lane].allow_request()

    def hot_wait_budget_s(self, waited_s: float) -> float:
        """How long an interactive request that has been at this Router `waited_s` may still wait for a hot slot:
        what the TTFT target leaves after the time from a slot to the first token."""
        start = self.hot_slots.start_latency_s() if self.hot_slots is not None else 0.0
        return max(self.interactive_ttft_target_s - waited_s - start, 0.0)

    def timeout_s(self, request_class: RequestClass) -> float:
        return self.deadlines.timeout_s(request_class) if self.enabled else NO_DEADLINE_S

    # ---- progress -----------------------------------------------------------------------------------------------

    def started(self, request_class: RequestClass, tenant: str = DEFAULT_TENANT) -> None:
        if self.enabled:
            self.back_pressure.dequeue(request_class, tenant)

    def abandoned_before_start(self, request_class: RequestClass, tenant: str = DEFAULT_TENANT) -> None:
        if self.enabled:
            self.back_pressure.dequeue(request_class, tenant)

    def finished(self, request_class: RequestClass, lane: Lane, ok: bool | None, e2e_s: float | None) -> None:
        """A lane call ended: `ok` False counts against the lane's breaker (a lane failure or a deadline), True for
        it, None neither (the client left, its input was refused: a half-open breaker's probe is only freed); an
        E2E time feeds the class's deadline."""
        breaker = self.breakers[lane]
        if ok is None:
            breaker.record_cancelled()
        elif ok:
            breaker.record_success()
            if e2e_s is not None:
                self.deadlines.record(request_class, e2e_s)
        else:
            breaker.record_failure()

    def breaker_states(self) -> dict[str, str]:
        return {lane.value: breaker.state.value for lane, breaker in self.breakers.items()}

    def queue_depths(self) -> dict[str, int]:
        return {c.value: self.back_pressure.queued(c) for c in RequestClass}

    def slot_stats(self) -> dict[str, dict]:
        if self.hot_slots is None:
            return {}
        return {"hot_slots": self.hot_slots.stats(), "cold_spill": self.cold_spill.stats()}
