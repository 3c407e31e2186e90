"""The one routing decision: which lane serves a request, at what priority, with how many output tokens, whether it
waits in the Router for a hot-lane slot, and whether the cold lane takes over its decode.

The rule, in order:
1. Refuse (400) only what no lane can serve: prompt + max_tokens (after the lane's max_tokens cap) above every lane's
   max_model_len.
2. A continuation (the rest of an answer whose first tokens an earlier lane call generated: the decode handoff's, or
   a stream whose lane replica was lost mid-answer) runs on the cold lane for interactive (at interactive priority)
   and on its home lane for the other classes; on the other lane while that one's breaker is open or it has no
   replica (the client already has its first tokens: finishing beats failing).
3. Start from the class's home lane (realtime, interactive: hot; batch: cold).
4. Long-context degrade: a prompt above `long_context_threshold` tokens goes to the cold lane, whatever its class,
   so one long prefill does not stall everyone's TTFT on the hot lane.
5. Interactive on the hot lane (realtime never spills; the hot replicas' own gate orders it):
   a. a hot replica refused this request for KV headroom, or one did a moment ago: the cold lane;
   b. a hot-lane slot of this Router is free: the hot lane, now;
   c. the predicted wait for a slot (from the slots in use and their recent hold times, `LaneSlots`) is within the
      interactive TTFT SLO: the hot lane, after waiting in the Router for a slot. The wait is bounded by what the SLO
      leaves (a prediction can be wrong when the load changes): a request whose slot has not come by then is decided
      again without this step;
   d. the cold lane has spill room: the cold lane;
   e. otherwise 429 with a Retry-After of the time until a slot is expected within the SLO (TrafficControl spreads
      the Retry-Afters of a backlog of refusals over the lanes' admission rate: admission.RetrySchedule).
   A request whose tenant holds its share of the slots while other tenants are active (hot_slots.py) is decided the
   same way, with the slots of its share for "free" and its own line for the wait: a spill says `tenant_share`
   instead of `hot_saturated`, a refusal `tenant_share_full` instead of `hot_lane_full`.
   The Router never sends the hot engines more interactive work than they run at once, and never leaves a hot slot
   idle while an interactive request waits for one.
6. A lane that cannot fit the request, whose breaker refuses requests now (open, or half-open with its probes
   taken), or that has no replica to send it to (its only replica lost, or none started yet: Serve's handle would
   hold the request until one runs) hands over to the other lane when allowed: always for "does not fit"; for a
   refusing breaker or a lane without replicas, interactive (at interactive priority on the cold lane), realtime
   from a hot lane without replicas when the cold lane's predicted first token is within the realtime TTFT target
   (at realtime priority, ahead of everything there), and any class back to its home lane. Otherwise:
   a. batch waits in the Router for its lane (cold) for the breaker's Retry-After (a lane without replicas: a
      second), then is decided again, until its deadline: a lane that is down (a replica restarting, its engine
      loading) costs batch work time, not a 503. It does not move to the hot lane: flex requests and batch lines
      (up to the dispatchers' windows) would take the hot slots that interactive requests wait for, for as long as
      the cold lane is down;
   b. realtime and interactive: 503 with the breaker's Retry-After (waiting would spend their latency target);
      interactive whose lanes both have no replica (a rolling update of one-replica lanes, a lost node) stays on
      its lane and waits in Serve's handle for the first replica to run.
7. max_tokens above the chosen lane's cap is clipped, not refused.
8. Decode handoff: an interactive request that starts on the hot lane hands its decode to the cold lane after
   `decode_handoff_tokens` tokens where app/router/handoff.py says it may.
Every step that moves or changes a request adds a reason; the reasons go to a metric and the response header.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from app.classes import CLASS_POLICIES, Lane, RequestClass, policy_for
from app.router.handoff import REASON_DECODE_ON_COLD, handoff_after_tokens
from app.router.lane_caps import LaneCaps

# An interactive request on the cold lane runs ahead of batch work there (vLLM serves lower numbers first): it already
# lost the hot lane's latency, it must not also queue behind the bulk backlog.
COLD_LANE_INTERACTIVE_PRIORITY = CLASS_POLICIES[RequestClass.INTERACTIVE].priority
# Retry-After is clamped: under 1 s clients hammer us, over 60 s they give up on a service that may recover sooner.
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 60
# The shortest wait for a lane's breaker (rule 6a): a breaker about to let requests through again is asked again
# after this, not in a busy loop.
LANE_WAIT_MIN_S = 0.25

REASON_LONG_CONTEXT = "long_context"
REASON_HOT_SATURATED = "hot_saturated"
REASON_TENANT_SHARE = "tenant_share"
REASON_KV_HEADROOM = "hot_kv_headroom"
REASON_MAX_TOKENS_CLIPPED = "max_tokens_clipped"
# Every reason the decision can give, for dashboards and the doctor (the breaker, replica and context ones name a
# lane).
REASONS = (REASON_LONG_CONTEXT, REASON_HOT_SATURATED, REASON_TENANT_SHARE, REASON_KV_HEADROOM,
           REASON_MAX_TOKENS_CLIPPED, REASON_DECODE_ON_COLD, "hot_breaker_open", "cold_breaker_open",
           "hot_lane_down", "cold_lane_down", "exceeds_hot_max_model_len", "exceeds_cold_max_model_len")
# Retry-After of a request refused because its lane has no replica, and how often batch work waiting for such a lane
# looks again: a replacement is RUNNING within seconds of its engine loading.
LANE_DOWN_RETRY_S = 1.0


def reason_breaker_open(lane: Lane) -> str:
    return f"{lane.value}_breaker_open"


def reason_lane_down(lane: Lane) -> str:
    return f"{lane.value}_lane_down"


def reason_exceeds_context(lane: Lane) -> str:
    return f"exceeds_{lane.value}_max_model_len"


@dataclass(frozen=True)
class HotSlotState:
    """This Router's hot-lane slots for interactive requests, as the decision sees them."""

    free: int
    # Predicted wait for a slot of a request joining the line now (0 with a free slot; inf when unknown and full).
    predicted_wait_s: float
    # No slot is free for this request's tenant although the lane has some: it holds its share (other tenants active).
    at_tenant_share: bool = False


@dataclass(frozen=True)
class RouteInputs:
    request_class: RequestClass
    prompt_tokens: int
    max_tokens: int
    lane_caps: Mapping[Lane, LaneCaps]
    long_context_threshold: int
    # What admission aims at for an interactive first token: the configured target less its headroom.
    interactive_ttft_target_s: float = math.inf
    # None: no Router-side slots (admission off, or a one-lane app): interactive goes to the hot lane at once.
    hot_slots: HotSlotState | None = None
    # May one more interactive request spill to the cold lane now (this Router's spill room there)?
    cold_spill_room: bool = True
    # A hot replica refused this request for KV headroom (it keeps the reserve for realtime).
    hot_refused_for_kv: bool = False
    # This request waited for a hot slot as long as its TTFT target allows, and none came free.
    hot_wait_expired: bool = False
    # A hot replica refused another interactive request for KV headroom a moment ago.
    hot_kv_exhausted: bool = False
    # Lanes whose breaker refuses requests now, with the breaker's Retry-After in seconds.
    open_breakers: Mapping[Lane, float] = field(default_factory=dict)
    # Lanes with no replica to send a request to (lost, or not started yet).
    lanes_down: frozenset[Lane] = frozenset()
    # Realtime requests are to start within this; a realtime request goes to the cold lane (its hot lane down) only
    # when `cold_start_s`, the cold lane's predicted time to a first token, is within it.
    realtime_ttft_target_s: float = math.inf
    cold_start_s: float = 0.0
    # Decode handoff (app/router/handoff.py): tokens the hot lane generates before the cold lane goes on (0: off).
    decode_handoff_tokens: int = 0
    has_stop_strings: bool = False
    # This is the rest of an answer whose first tokens the hot lane generated.
    continuation: bool = False


@dataclass(frozen=True)
class RouteDecision:
    lane: Lane
    priority: int
    max_tokens: int
    reasons: tuple[str, ...] = ()
    # Wait in the Router for a hot-lane slot before starting (rule 5c).
    wait_for_hot_slot: bool = False
    # Holds a hot-lane slot of this Router while it runs (interactive on the hot lane).
    takes_hot_slot: bool = False
    # Holds spill room on the cold lane while it runs (interactive spilled for load).
    takes_cold_spill: bool = False
    # Tokens the hot lane generates before the cold lane continues the answer; None: one lane serves it all.
    handoff_after: int | None = None
    # Wait this long in the Router for the lane's breaker, then decide again (rule 6a); 0: start now.
    wait_for_lane_s: float = 0.0


@dataclass(frozen=True)
class RouteRefusal:
    status: int  # 400: no lane can ever serve it; 429: too many wait; 503: the lane that may serve it is down
    code: str
    message: str
    retry_after_s: int | None = None


def _other(lane: Lane) -> Lane:
    return Lane.COLD if lane is Lane.HOT else Lane.HOT


def _breaker_reroute_allowed(request_class: RequestClass, to_lane: Lane) -> bool:
    home = policy_for(request_class).lane
    return request_class is RequestClass.INTERACTIVE or to_lane is home


def retry_after_s(seconds: float) -> int:
    """Seconds for a Retry-After header: rounded up, clamped to [1, 60] (an unknown wait is the maximum)."""
    if not math.isfinite(seconds):
        return RETRY_AFTER_MAX_S
    return int(min(max(math.ceil(seconds), RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S))


def _interactive_on_hot(inputs: RouteInputs, reasons: list[str]) -> tuple[Lane, bool] | RouteRefusal:
    """Rule 5: (lane, wait for a hot slot) for an interactive request whose lane so far is the hot lane."""
    cold_usable = (Lane.COLD in inputs.lane_caps and Lane.COLD not in inputs.open_breakers
                   and Lane.COLD not in inputs.lanes_down)
    if inputs.hot_refused_for_kv or inputs.hot_kv_exhausted:
        reasons.append(REASON_KV_HEADROOM if inputs.hot_refused_for_kv else REASON_HOT_SATURATED)
        return Lane.COLD, False
    slots = inputs.hot_slots
    if not inputs.hot_wait_expired:
        if slots is None or slots.free > 0:
            return Lane.HOT, False
        if slots.predicted_wait_s <= inputs.interactive_ttft_target_s:
            return Lane.HOT, True
    at_share = slots is not None and slots.at_tenant_share
    if cold_usable and inputs.cold_spill_room:
        reasons.append(REASON_TENANT_SHARE if at_share else REASON_HOT_SATURATED)
        return Lane.COLD, False
    wait = retry_after_s(slots.predicted_wait_s - inputs.interactive_ttft_target_s if slots is not None else 0)
    code, what = (("tenant_share_full", "your tenant holds its share of the hot lane while other tenants use it")
                  if at_share else ("hot_lane_full", "the hot lane is full"))
    return RouteRefusal(429, code,
                        f"{what} and its queue would not start this request within the "
                        f"{inputs.interactive_ttft_target_s:.3g} s admission aims at for an interactive first token",
                        retry_after_s=wait)


def decide_route(inputs: RouteInputs) -> RouteDecision | RouteRefusal:
    cls = inputs.request_class
    if inputs.prompt_tokens < 0 or inputs.max_tokens < 1:
        raise ValueError(
            f"need prompt_tokens >= 0 and max_tokens >= 1, got {inputs.prompt_tokens}, {inputs.max_tokens}"
        )
    fits = {
        lane: caps.fits(inputs.prompt_tokens, inputs.max_tokens) for lane, caps in inputs.lane_caps.items()
    }
    if not any(fits.values()):
        ordered = sorted(inputs.lane_caps.items(), key=lambda item: item[0].value)
        limits = ", ".join(f"{lane.value}: {caps.max_model_len}" for lane, caps in ordered)
        return RouteRefusal(
            400,
            "context_length_exceeded",
            f"prompt ({inputs.prompt_tokens} tokens) + max_tokens ({inputs.max_tokens}) exceeds the maximum context "
            f"length of every lane ({limits}); shorten the prompt or lower max_tokens",
        )

    if inputs.continuation:
        # The decode handoff's lane for interactive; a resumed stream of another class goes back to its home lane.
        lane = Lane.COLD if cls is RequestClass.INTERACTIVE else policy_for(cls).lane
        other = _other(lane)
        if (lane not in inputs.lane_caps or lane in inputs.open_breakers or lane in inputs.lanes_down) and (
                other in inputs.lane_caps and other not in inputs.open_breakers and other not in inputs.lanes_down):
            lane = other
        priority = (COLD_LANE_INTERACTIVE_PRIORITY if cls is RequestClass.INTERACTIVE and lane is Lane.COLD
                    else policy_for(cls).priority)
        return RouteDecision(lane=lane, priority=priority, max_tokens=inputs.max_tokens)

    reasons: list[str] = []
    lane = policy_for(cls).lane
    wait_for_hot_slot = False
    cold_exists = Lane.COLD in inputs.lane_caps
    if lane is Lane.HOT and cold_exists and inputs.prompt_tokens > inputs.long_context_threshold:
        lane = Lane.COLD
        reasons.append(REASON_LONG_CONTEXT)
    elif lane is Lane.HOT and cold_exists and cls is RequestClass.INTERACTIVE and Lane.HOT not in inputs.lanes_down:
        chosen = _interactive_on_hot(inputs, reasons)
        if isinstance(chosen, RouteRefusal):
            return chosen
        lane, wait_for_hot_slot = chosen

    if not fits.get(lane, False):
        # Step 1 guarantees the other lane fits. A lane missing from lane_caps (a one-lane deployment) is no degrade.
        if lane in inputs.lane_caps:
            reasons.append(reason_exceeds_context(lane))
        lane = _other(lane)
        wait_for_hot_slot = False

    if lane in inputs.open_breakers or lane in inputs.lanes_down:
        other = _other(lane)
        lane_down = lane not in inputs.open_breakers
        can_move = (
            other in inputs.lane_caps
            and fits.get(other, False)
            and other not in inputs.open_breakers
            and other not in inputs.lanes_down
            and (_breaker_reroute_allowed(cls, other)
                 or (cls is RequestClass.REALTIME and lane_down and lane is Lane.HOT
                     and inputs.cold_start_s <= inputs.realtime_ttft_target_s))
        )
        reason = reason_lane_down(lane) if lane_down else reason_breaker_open(lane)
        wait_s = LANE_DOWN_RETRY_S if lane_down else inputs.open_breakers[lane]
        if can_move:
            reasons.append(reason)
            lane = other
        elif cls is RequestClass.BATCH and lane is Lane.COLD:
            return RouteDecision(lane=lane, priority=policy_for(cls).priority, max_tokens=inputs.max_tokens,
                                 reasons=(*reasons, reason), wait_for_lane_s=max(wait_s, LANE_WAIT_MIN_S))
        elif lane_down and cls is RequestClass.INTERACTIVE:
            # Neither lane can take it now (a rolling update of one-replica lanes, a lost node): it waits in Serve's
            # handle for its lane's first replica, as every request did before a lane was known to have none.
            reasons.append(reason)
        else:
            what = ("has no running replica (lost or starting)" if lane_down
                    else "is failing and has been taken out of service for a moment")
            return RouteRefusal(503, reason, f"the {lane.value} lane {what}; retry later",
                                retry_after_s=max(1, math.ceil(wait_s)))
        wait_for_hot_slot = False

    max_tokens = inputs.lane_caps[lane].clipped_max_tokens(inputs.max_tokens)
    if max_tokens < inputs.max_tokens:
        reasons.append(REASON_MAX_TOKENS_CLIPPED)

    priority = policy_for(cls).priority
    interactive = cls is RequestClass.INTERACTIVE
    if interactive and lane is Lane.COLD:
        priority = COLD_LANE_INTERACTIVE_PRIORITY
    takes_hot_slot = interactive and lane is Lane.HOT and inputs.hot_slots is not None
    handoff_after = handoff_after_tokens(
        request_class=cls, lane=lane, prompt_tokens=inputs.prompt_tokens, max_tokens=max_tokens,
        has_stop_strings=inputs.has_stop_strings, handoff_tokens=inputs.decode_handoff_tokens,
        lane_caps=inputs.lane_caps)
    if handoff_after is not None:
        reasons.append(REASON_DECODE_ON_COLD)
    return RouteDecision(lane=lane, priority=priority, max_tokens=max_tokens, reasons=tuple(reasons),
                         wait_for_hot_slot=wait_for_hot_slot and takes_hot_slot, takes_hot_slot=takes_hot_slot,
                         # Spilled for load, or moved off a hot lane without replicas (then over the spill room:
                         # its slots count the lane's starts, what a realtime request's move is predicted from).
                         takes_cold_spill=(cls is not RequestClass.BATCH and lane is Lane.COLD
                                           and not {REASON_HOT_SATURATED, REASON_TENANT_SHARE,
                                                    reason_lane_down(Lane.HOT)}.isdisjoint(reasons)),
                         handoff_after=handoff_after)
