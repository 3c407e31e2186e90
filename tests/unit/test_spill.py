import math

import pytest

from app.classes import CLASS_POLICIES, Lane, RequestClass
from app.router.spill import (
    COLD_LANE_INTERACTIVE_PRIORITY,
    LaneCaps,
    RouteDecision,
    RouteInputs,
    RouteRefusal,
    decide_route,
    predicted_queue_wait_s,
)

RT, IA, BA = RequestClass.REALTIME, RequestClass.INTERACTIVE, RequestClass.BATCH
HOT, COLD = Lane.HOT, Lane.COLD
CAPS = {HOT: LaneCaps(max_model_len=16384, max_tokens_cap=1024), COLD: LaneCaps(max_model_len=32768)}


def route(request_class=IA, prompt_tokens=100, max_tokens=64, **kwargs) -> RouteDecision | RouteRefusal:
    kwargs.setdefault("lane_caps", CAPS)
    return decide_route(RouteInputs(request_class, prompt_tokens, max_tokens, **kwargs))


def test_each_class_goes_home_undegraded():
    for cls in RequestClass:
        decision = route(cls)
        assert isinstance(decision, RouteDecision)
        assert decision.lane is CLASS_POLICIES[cls].lane
        assert decision.priority == CLASS_POLICIES[cls].priority
        assert decision.max_tokens == 64 and decision.reasons == () and not decision.degraded


def test_long_context_degrades_to_cold_for_hot_classes():
    at_threshold = route(IA, prompt_tokens=8192)
    assert at_threshold.lane is HOT
    above = route(IA, prompt_tokens=8193)
    assert above.lane is COLD and above.reasons == ("long_context",)
    assert above.priority == COLD_LANE_INTERACTIVE_PRIORITY
    realtime = route(RT, prompt_tokens=9000)
    assert realtime.lane is COLD and realtime.priority == CLASS_POLICIES[RT].priority
    assert route(IA, prompt_tokens=600, long_context_threshold=512).lane is COLD


def test_interactive_spills_when_hot_wait_exceeds_slo_or_hot_saturated():
    spilled = route(IA, predicted_hot_wait_s=1.5, interactive_ttft_slo_s=1.0)
    assert spilled.lane is COLD and spilled.reasons == ("hot_saturated",)
    assert spilled.priority < CLASS_POLICIES[BA].priority  # ahead of the batch backlog on the cold lane
    assert route(IA, predicted_hot_wait_s=1.0, interactive_ttft_slo_s=1.0).lane is HOT
    assert route(IA, hot_saturated=True).lane is COLD


def test_realtime_never_spills_for_saturation():
    decision = route(RT, predicted_hot_wait_s=100, interactive_ttft_slo_s=1.0, hot_saturated=True)
    assert decision.lane is HOT and decision.reasons == ()


def test_max_tokens_clipped_to_lane_cap_not_refused():
    decision = route(IA, max_tokens=4000)
    assert decision.lane is HOT and decision.max_tokens == 1024 and decision.reasons == ("max_tokens_clipped",)
    assert decision.header_value == "max_tokens_clipped"
    # Clipped after a spill: the cold lane has no cap, so nothing is clipped there.
    spilled = route(IA, max_tokens=4000, hot_saturated=True)
    assert spilled.lane is COLD and spilled.max_tokens == 4000 and spilled.reasons == ("hot_saturated",)


def test_refused_only_when_no_lane_can_serve():
    caps = {HOT: LaneCaps(2048, max_tokens_cap=256), COLD: LaneCaps(4096)}
    # Fits hot only thanks to clipping: 1900 + 256 > 2048, but cold fits 1900 + 1000.
    ok = route(IA, prompt_tokens=1900, max_tokens=1000, lane_caps=caps)
    assert isinstance(ok, RouteDecision)
    assert ok.lane is COLD and ok.reasons == ("exceeds_hot_max_model_len",)
    refused = route(IA, prompt_tokens=4000, max_tokens=200, lane_caps=caps)
    assert isinstance(refused, RouteRefusal)
    assert refused.status == 400 and refused.code == "context_length_exceeded"
    assert "4000" in refused.message and "hot: 2048" in refused.message and "cold: 4096" in refused.message
    # Exactly at max_model_len is allowed.
    assert isinstance(route(BA, prompt_tokens=4000, max_tokens=96, lane_caps=caps), RouteDecision)


def test_clipping_makes_a_request_fit():
    caps = {HOT: LaneCaps(2048, max_tokens_cap=128), COLD: LaneCaps(2048, max_tokens_cap=128)}
    decision = route(IA, prompt_tokens=1900, max_tokens=1000, lane_caps=caps)
    assert decision.lane is HOT and decision.max_tokens == 128 and decision.reasons == ("max_tokens_clipped",)


def test_interactive_rerouted_around_open_breaker():
    to_cold = route(IA, open_breakers={HOT: 4.2})
    assert to_cold.lane is COLD and to_cold.reasons == ("hot_breaker_open",)
    assert to_cold.priority == COLD_LANE_INTERACTIVE_PRIORITY
    # Spilled to cold but cold is down: back home to hot.
    back = route(IA, hot_saturated=True, open_breakers={COLD: 3})
    assert back.lane is HOT and back.reasons == ("hot_saturated", "cold_breaker_open")


def test_realtime_and_batch_fail_fast_instead_of_crossing_lanes():
    realtime = route(RT, open_breakers={HOT: 4.2})
    assert isinstance(realtime, RouteRefusal)
    assert realtime.status == 503 and realtime.code == "hot_breaker_open" and realtime.retry_after_s == 5
    batch = route(BA, open_breakers={COLD: 0.1})
    assert isinstance(batch, RouteRefusal) and batch.code == "cold_breaker_open" and batch.retry_after_s == 1
    # A long-context realtime request may go back to its home lane when cold is down.
    home = route(RT, prompt_tokens=9000, open_breakers={COLD: 3})
    assert home.lane is HOT and home.reasons == ("long_context", "cold_breaker_open")


def test_both_breakers_open_refuses_503():
    refusal = route(IA, open_breakers={HOT: 2, COLD: 7})
    assert isinstance(refusal, RouteRefusal) and refusal.status == 503 and refusal.retry_after_s == 2


def test_reroute_needs_the_other_lane_to_fit():
    caps = {HOT: LaneCaps(8192), COLD: LaneCaps(1024)}
    refusal = route(IA, prompt_tokens=2000, open_breakers={HOT: 1}, lane_caps=caps)
    assert isinstance(refusal, RouteRefusal) and refusal.status == 503


def test_single_lane_deployment_never_degrades_to_a_missing_lane():
    hot_only = {HOT: LaneCaps(16384)}
    decision = route(IA, prompt_tokens=9000, hot_saturated=True, lane_caps=hot_only)
    assert decision.lane is HOT and decision.reasons == ()
    batch = route(BA, lane_caps=hot_only)
    assert batch.lane is HOT and batch.reasons == ()


def test_reasons_combine_in_order():
    caps = {HOT: LaneCaps(16384), COLD: LaneCaps(32768, max_tokens_cap=512)}
    decision = route(IA, prompt_tokens=10000, max_tokens=2000, lane_caps=caps)
    assert decision.lane is COLD and decision.max_tokens == 512
    assert decision.reasons == ("long_context", "max_tokens_clipped")
    assert decision.header_value == "long_context,max_tokens_clipped"


def test_input_validation():
    with pytest.raises(ValueError):
        route(IA, max_tokens=0)
    with pytest.raises(ValueError):
        route(IA, prompt_tokens=-1)


def test_predicted_queue_wait():
    assert predicted_queue_wait_s(0, 0.0) == 0.0
    assert predicted_queue_wait_s(10, 4.0) == 2.5
    assert predicted_queue_wait_s(3, 0.0) == math.inf


def test_batch_borrows_the_hot_lane_only_with_a_free_slot():
    assert route(BA).lane is COLD  # no slots: batch stays home
    borrowed = route(BA, hot_batch_slots=1)
    assert borrowed.lane is HOT and borrowed.reasons == ("borrowed_hot",)
    assert borrowed.priority == CLASS_POLICIES[BA].priority  # behind every interactive and realtime request there
    assert route(BA, max_tokens=4000, hot_batch_slots=1).max_tokens == 1024  # the hot lane's cap applies


@pytest.mark.parametrize("blocker", [
    {"hot_saturated": True},
    {"open_breakers": {HOT: 5.0}},
    {"prompt_tokens": 9000},                         # a long prompt is the cold lane's work whatever its class
    {"prompt_tokens": 16000, "max_tokens": 500},     # does not fit the hot lane's context
    {"lane_caps": {COLD: CAPS[COLD]}},               # a cold-only deployment has no hot lane to borrow
])
def test_batch_is_not_lent_to_a_hot_lane_that_cannot_take_it(blocker):
    decision = route(BA, hot_batch_slots=4, **blocker)
    assert decision.lane is COLD and "borrowed_hot" not in decision.reasons


def test_other_classes_ignore_hot_batch_slots():
    assert route(IA, hot_batch_slots=4).reasons == () and route(RT, hot_batch_slots=4).reasons == ()
