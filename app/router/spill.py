"""Spill and degrade: which lane serves a request, at what priority, with how many output tokens.

The rule, in order:
1. Refuse (400) only what no lane can serve: prompt + max_tokens (after the lane's max_tokens cap) above every lane's
   max_model_len.
2. Start from the class's home lane (realtime, interactive: hot; batch: cold).
3. Long-context degrade: a prompt above `long_context_threshold` tokens goes to the cold lane, whatever its class,
   so one long prefill does not stall everyone's TTFT on the hot lane.
4. Saturation spill: interactive only (realtime never spills) goes to the cold lane when the hot lane is saturated or
   its predicted queue wait exceeds the interactive TTFT SLO.
   Borrowing, the other way: batch goes to the hot lane when the caller grants it `hot_batch_slots` (TrafficControl
   does once the Router's cold share is taken, a loan of `hot_batch_borrow_max` is free, 0 by default, and no
   interactive or realtime request waits), the hot lane is not saturated and the prompt is below the long-context
   threshold; there it runs at batch priority, behind every other class.
5. A lane that cannot fit the request, or whose breaker is open, hands over to the other lane when allowed: always
   for "does not fit"; for an open breaker only for interactive, or to bring a request back to its home lane
   (realtime stays on hot, batch stays off hot). Otherwise 503 with the breaker's Retry-After.
6. max_tokens above the chosen lane's cap is clipped, not refused.
Every step that moves or changes a request adds a reason; the reasons go to a metric and the response header.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from app.classes import CLASS_POLICIES, Lane, RequestClass, policy_for

# The tuning guide: sequences above 8K tokens degrade to the memory-efficient (cold) path.
DEFAULT_LONG_CONTEXT_THRESHOLD = 8192
# An interactive request on the cold lane runs ahead of batch work there (vLLM serves lower numbers first): it already
# lost the hot lane's latency, it must not also queue behind the bulk backlog.
COLD_LANE_INTERACTIVE_PRIORITY = CLASS_POLICIES[RequestClass.INTERACTIVE].priority

REASON_LONG_CONTEXT = "long_context"
REASON_HOT_SATURATED = "hot_saturated"
REASON_BORROWED_HOT = "borrowed_hot"
REASON_MAX_TOKENS_CLIPPED = "max_tokens_clipped"


def reason_breaker_open(lane: Lane) -> str:
    return f"{lane.value}_breaker_open"


def reason_exceeds_context(lane: Lane) -> str:
    return f"exceeds_{lane.value}_max_model_len"


@dataclass(frozen=True)
class LaneCaps:
    max_model_len: int
    # Largest max_tokens the lane accepts; a larger request is clipped to it. None: only max_model_len limits it.
    max_tokens_cap: int | None = None

    def clipped_max_tokens(self, max_tokens: int) -> int:
        return max_tokens if self.max_tokens_cap is None else min(max_tokens, self.max_tokens_cap)

    def fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        return prompt_tokens + self.clipped_max_tokens(max_tokens) <= self.max_model_len


@dataclass(frozen=True)
class RouteInputs:
    request_class: RequestClass
    prompt_tokens: int
    max_tokens: int
    lane_caps: Mapping[Lane, LaneCaps]
    long_context_threshold: int = DEFAULT_LONG_CONTEXT_THRESHOLD
    # Predicted wait before a new interactive request starts on the best hot replica, vs. the interactive TTFT SLO.
    predicted_hot_wait_s: float = 0.0
    interactive_ttft_slo_s: float = math.inf
    # True when no hot replica can take an interactive request now (KV headroom used up, queues full).
    hot_saturated: bool = False
    # Lanes whose breaker refuses requests now, with the breaker's Retry-After in seconds.
    open_breakers: Mapping[Lane, float] = field(default_factory=dict)
    # Batch requests the hot lane may take now on loan from the cold lane (0: none; the caller counts the loans).
    hot_batch_slots: int = 0


@dataclass(frozen=True)
class RouteDecision:
    lane: Lane
    priority: int
    max_tokens: int
    reasons: tuple[str, ...] = ()

    @property
    def degraded(self) -> bool:
        return bool(self.reasons)

    @property
    def header_value(self) -> str:
        """For the x-llm-lanes-degraded response header ("" when nothing was changed)."""
        return ",".join(self.reasons)


@dataclass(frozen=True)
class RouteRefusal:
    status: int  # 400: no lane can ever serve it; 503: the lane that may serve it is down
    code: str
    message: str
    retry_after_s: int | None = None


def _other(lane: Lane) -> Lane:
    return Lane.COLD if lane is Lane.HOT else Lane.HOT


def _breaker_reroute_allowed(request_class: RequestClass, to_lane: Lane) -> bool:
    home = policy_for(request_class).lane
    return request_class is RequestClass.INTERACTIVE or to_lane is home


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

    reasons: list[str] = []
    lane = policy_for(cls).lane
    cold_exists = Lane.COLD in inputs.lane_caps
    if lane is Lane.HOT and cold_exists and inputs.prompt_tokens > inputs.long_context_threshold:
        lane = Lane.COLD
        reasons.append(REASON_LONG_CONTEXT)
    elif (
        lane is Lane.HOT
        and cold_exists
        and cls is RequestClass.INTERACTIVE
        and (inputs.hot_saturated or inputs.predicted_hot_wait_s > inputs.interactive_ttft_slo_s)
    ):
        lane = Lane.COLD
        reasons.append(REASON_HOT_SATURATED)
    elif (
        cls is RequestClass.BATCH
        and lane is Lane.COLD
        and inputs.hot_batch_slots > 0
        and not inputs.hot_saturated
        and Lane.HOT in inputs.lane_caps
        and Lane.HOT not in inputs.open_breakers
        and fits.get(Lane.HOT, False)
        and inputs.prompt_tokens <= inputs.long_context_threshold
    ):
        lane = Lane.HOT
        reasons.append(REASON_BORROWED_HOT)

    if not fits.get(lane, False):
        # Step 1 guarantees the other lane fits. A lane missing from lane_caps (a one-lane deployment) is no degrade.
        if lane in inputs.lane_caps:
            reasons.append(reason_exceeds_context(lane))
        lane = _other(lane)

    if lane in inputs.open_breakers:
        other = _other(lane)
        can_move = (
            other in inputs.lane_caps
            and fits.get(other, False)
            and other not in inputs.open_breakers
            and _breaker_reroute_allowed(cls, other)
        )
        if not can_move:
            return RouteRefusal(
                503,
                reason_breaker_open(lane),
                f"the {lane.value} lane is failing and has been taken out of service for a moment; retry later",
                retry_after_s=max(1, math.ceil(inputs.open_breakers[lane])),
            )
        reasons.append(reason_breaker_open(lane))
        lane = other

    max_tokens = inputs.lane_caps[lane].clipped_max_tokens(inputs.max_tokens)
    if max_tokens < inputs.max_tokens:
        reasons.append(REASON_MAX_TOKENS_CLIPPED)

    priority = policy_for(cls).priority
    if cls is RequestClass.INTERACTIVE and lane is Lane.COLD:
        priority = COLD_LANE_INTERACTIVE_PRIORITY
    return RouteDecision(lane=lane, priority=priority, max_tokens=max_tokens, reasons=tuple(reasons))


def predicted_queue_wait_s(queue_len: int, drain_rate_per_s: float) -> float:
    """Time until a request joining the back of a queue starts: queue length / observed drain rate."""
    if queue_len <= 0:
        return 0.0
    if drain_rate_per_s <= 0:
        return math.inf
    return queue_len / drain_rate_per_s
