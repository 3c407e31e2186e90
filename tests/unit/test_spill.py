import math

import pytest

from app.classes import CLASS_POLICIES, Lane, RequestClass
from app.router.lane_caps import LaneCaps
from app.router.spill import (
    COLD_LANE_INTERACTIVE_PRIORITY,
    HotSlotState,
    RouteDecision,
    RouteInputs,
    RouteRefusal,
    decide_route,
    retry_after_s,
)

RT, IA, BA = RequestClass.REALTIME, RequestClass.INTERACTIVE, RequestClass.BATCH
HOT, COLD = Lane.HOT, Lane.COLD
CAPS = {HOT: LaneCaps(max_model_len=16384, max_tokens_cap=1024), COLD: LaneCaps(max_model_len=32768)}


FULL = HotSlotState(free=0, predicted_wait_s=5.0)  # no free hot slot, a 5 s wait for one


def route(request_class=IA, prompt_tokens=100, max_tokens=64, **kwargs) -> RouteDecision | RouteRefusal:
    kwargs.setdefault("lane_caps", CAPS)
    kwargs.setdefault("long_context_threshold", 8192)
    return decide_route(RouteInputs(request_class, prompt_tokens, max_tokens, **kwargs))


def test_each_class_goes_home_undegraded():
    for cls in RequestClass:
        decision = route(cls)
        assert isinstance(decision, RouteDecision) and decision.wait_for_lane_s == 0
        assert decision.lane is CLASS_POLICIES[cls].lane
        assert decision.priority == CLASS_POLICIES[cls].priority
        assert decision.max_tokens == 64 and decision.reasons == ()


def test_long_context_degrades_to_cold_for_hot_classes():
    at_threshold = route(IA, prompt_tokens=8192)
    assert at_threshold.lane is HOT
    above = route(IA, prompt_tokens=8193)
    assert above.lane is COLD and above.reasons == ("long_context",)
    assert above.priority == COLD_LANE_INTERACTIVE_PRIORITY
    realtime = route(RT, prompt_tokens=9000)
    assert realtime.lane is COLD and realtime.priority == CLASS_POLICIES[RT].priority
    assert route(IA, prompt_tokens=600, long_context_threshold=512).lane is COLD


def test_interactive_takes_a_free_hot_slot_at_once():
    decision = route(IA, hot_slots=HotSlotState(free=1, predicted_wait_s=0.0), interactive_ttft_target_s=1.0)
    assert decision.lane is HOT and decision.takes_hot_slot and not decision.wait_for_hot_slot


def test_interactive_waits_for_a_hot_slot_when_the_wait_is_within_the_slo():
    decision = route(IA, hot_slots=HotSlotState(free=0, predicted_wait_s=1.0), interactive_ttft_target_s=1.0)
    assert decision.lane is HOT and decision.wait_for_hot_slot and decision.takes_hot_slot and decision.reasons == ()


def test_interactive_spills_past_a_full_hot_lane_while_the_cold_lane_has_room():
    spilled = route(IA, hot_slots=FULL, interactive_ttft_target_s=1.0)
    assert spilled.lane is COLD and spilled.reasons == ("hot_saturated",) and spilled.takes_cold_spill
    assert spilled.priority < CLASS_POLICIES[BA].priority  # ahead of the batch backlog on the cold lane
    assert not spilled.takes_hot_slot and not spilled.wait_for_hot_slot


def test_interactive_is_refused_429_when_neither_lane_can_start_it_in_time():
    refusal = route(IA, hot_slots=FULL, interactive_ttft_target_s=1.0, cold_spill_room=False)
    assert isinstance(refusal, RouteRefusal) and refusal.status == 429 and refusal.code == "hot_lane_full"
    assert refusal.retry_after_s == 4  # the wait past the SLO: 5 s - 1 s
    cold_down = route(IA, hot_slots=FULL, interactive_ttft_target_s=1.0, open_breakers={COLD: 3})
    assert isinstance(cold_down, RouteRefusal) and cold_down.status == 429


def test_a_tenant_at_its_share_spills_or_is_refused_naming_its_share_not_a_full_lane():
    at_share = HotSlotState(free=0, predicted_wait_s=5.0, at_tenant_share=True)
    spilled = route(IA, hot_slots=at_share, interactive_ttft_target_s=1.0)
    assert spilled.lane is COLD and spilled.reasons == ("tenant_share",) and spilled.takes_cold_spill
    refusal = route(IA, hot_slots=at_share, interactive_ttft_target_s=1.0, cold_spill_room=False)
    assert isinstance(refusal, RouteRefusal) and refusal.status == 429 and refusal.code == "tenant_share_full"
    assert refusal.retry_after_s == 4 and "share" in refusal.message
    waits = route(IA, hot_slots=HotSlotState(free=0, predicted_wait_s=0.5, at_tenant_share=True),
                  interactive_ttft_target_s=1.0)
    assert waits.lane is HOT and waits.wait_for_hot_slot  # its own line moves fast enough: it waits its turn


def test_a_kv_headroom_refusal_sends_interactive_to_the_cold_lane():
    refused = route(IA, hot_slots=HotSlotState(free=3, predicted_wait_s=0.0), hot_refused_for_kv=True)
    assert refused.lane is COLD and refused.reasons == ("hot_kv_headroom",)
    recently = route(IA, hot_slots=HotSlotState(free=3, predicted_wait_s=0.0), hot_kv_exhausted=True)
    assert recently.lane is COLD and recently.reasons == ("hot_saturated",)


def test_realtime_never_spills_and_never_waits_for_a_router_slot():
    decision = route(RT, hot_slots=FULL, interactive_ttft_target_s=1.0, hot_kv_exhausted=True, cold_spill_room=False)
    assert decision.lane is HOT and decision.reasons == () and not decision.takes_hot_slot


def test_retry_after_is_rounded_up_and_clamped():
    assert retry_after_s(0.2) == 1 and retry_after_s(4.1) == 5 and retry_after_s(600) == 60
    assert retry_after_s(math.inf) == 60


def test_a_continuation_runs_on_the_cold_lane_or_back_on_hot_while_cold_is_down():
    cold = route(IA, continuation=True)
    assert cold.lane is COLD and cold.priority == COLD_LANE_INTERACTIVE_PRIORITY and cold.reasons == ()
    hot = route(IA, continuation=True, open_breakers={COLD: 2})
    assert hot.lane is HOT and hot.priority == CLASS_POLICIES[IA].priority


def test_the_decode_handoff_is_part_of_the_decision():
    decision = route(IA, max_tokens=10, decode_handoff_tokens=1)
    assert decision.lane is HOT and decision.handoff_after == 1 and decision.reasons == ("decode_on_cold",)
    assert route(IA, max_tokens=10, decode_handoff_tokens=1, has_stop_strings=True).handoff_after is None
    assert route(RT, max_tokens=10, decode_handoff_tokens=1).handoff_after is None


def test_max_tokens_clipped_to_lane_cap_not_refused():
    decision = route(IA, max_tokens=4000)
    assert decision.lane is HOT and decision.max_tokens == 1024 and decision.reasons == ("max_tokens_clipped",)
    # Clipped after a spill: the cold lane has no cap, so nothing is clipped there.
    spilled = route(IA, max_tokens=4000, hot_kv_exhausted=True)
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
    back = route(IA, hot_kv_exhausted=True, open_breakers={COLD: 3})
    assert back.lane is HOT and back.reasons == ("hot_saturated", "cold_breaker_open")


def test_realtime_fails_fast_and_batch_waits_for_its_lane_instead_of_crossing_lanes():
    realtime = route(RT, open_breakers={HOT: 4.2})
    assert isinstance(realtime, RouteRefusal)
    assert realtime.status == 503 and realtime.code == "hot_breaker_open" and realtime.retry_after_s == 5
    # Rule 6a: batch stays off the hot lane and waits for the cold lane's breaker, however free the hot lane is.
    batch = route(BA, open_breakers={COLD: 3.5}, hot_slots=HotSlotState(free=4, predicted_wait_s=0))
    assert isinstance(batch, RouteDecision) and batch.lane is COLD and batch.wait_for_lane_s == 3.5
    assert batch.priority == CLASS_POLICIES[BA].priority and batch.reasons == ("cold_breaker_open",)
    assert not batch.takes_hot_slot and not batch.takes_cold_spill
    # A breaker about to let requests through is asked again shortly, not in a busy loop.
    assert route(BA, open_breakers={COLD: 0.01}).wait_for_lane_s == pytest.approx(0.25)
    # A long batch prompt on its way to the cold lane waits the same way.
    assert route(BA, prompt_tokens=9000, open_breakers={COLD: 2}).wait_for_lane_s == 2
    # Both lanes down: batch still waits for its own lane.
    assert route(BA, open_breakers={HOT: 1, COLD: 2}).wait_for_lane_s == 2
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
    decision = route(IA, prompt_tokens=9000, hot_kv_exhausted=True, lane_caps=hot_only)
    assert decision.lane is HOT and decision.reasons == ()
    batch = route(BA, lane_caps=hot_only)
    assert batch.lane is HOT and batch.reasons == ()


def test_reasons_combine_in_order():
    caps = {HOT: LaneCaps(16384), COLD: LaneCaps(32768, max_tokens_cap=512)}
    decision = route(IA, prompt_tokens=10000, max_tokens=2000, lane_caps=caps)
    assert decision.lane is COLD and decision.max_tokens == 512
    assert decision.reasons == ("long_context", "max_tokens_clipped")


def test_input_validation():
    with pytest.raises(ValueError):
        route(IA, max_tokens=0)
    with pytest.raises(ValueError):
        route(IA, prompt_tokens=-1)


def test_a_request_whose_hot_wait_ran_out_spills_or_is_refused():
    free = HotSlotState(free=2, predicted_wait_s=0.0)
    spilled = route(IA, hot_slots=free, hot_wait_expired=True, interactive_ttft_target_s=1.0)
    assert spilled.lane is COLD and spilled.reasons == ("hot_saturated",)
    refused = route(IA, hot_slots=free, hot_wait_expired=True, interactive_ttft_target_s=1.0, cold_spill_room=False)
    assert isinstance(refused, RouteRefusal) and refused.status == 429 and refused.retry_after_s == 1


def test_a_hot_lane_without_replicas_sends_interactive_to_the_cold_lane_without_waiting_for_a_slot():
    decision = route(IA, hot_slots=FULL, cold_spill_room=False, interactive_ttft_target_s=1.0,
                     lanes_down=frozenset({HOT}))
    assert decision.lane is COLD and decision.reasons == ("hot_lane_down",)
    assert decision.priority == COLD_LANE_INTERACTIVE_PRIORITY
    assert not decision.takes_hot_slot and not decision.wait_for_hot_slot
    # Over the spill room: its slots count the cold lane's starts, which a realtime request's move is judged by.
    assert decision.takes_cold_spill


def test_realtime_moves_off_a_hot_lane_without_replicas_only_while_the_cold_lane_starts_in_time():
    moved = route(RT, lanes_down=frozenset({HOT}), realtime_ttft_target_s=0.5, cold_start_s=0.2)
    assert moved.lane is COLD and moved.priority == CLASS_POLICIES[RT].priority
    assert moved.reasons == ("hot_lane_down",)
    refused = route(RT, lanes_down=frozenset({HOT}), realtime_ttft_target_s=0.5, cold_start_s=0.8)
    assert isinstance(refused, RouteRefusal) and refused.status == 503 and refused.code == "hot_lane_down"
    assert refused.retry_after_s == 1
    # An open breaker is not a lost lane: realtime still fails fast there (rule 6b).
    breaker = route(RT, open_breakers={HOT: 3.0}, realtime_ttft_target_s=0.5, cold_start_s=0.0)
    assert isinstance(breaker, RouteRefusal) and breaker.code == "hot_breaker_open"


def test_batch_waits_for_a_cold_lane_without_replicas_and_interactive_stays_hot():
    batch = route(BA, lanes_down=frozenset({COLD}))
    assert batch.lane is COLD and batch.wait_for_lane_s == 1.0 and batch.reasons == ("cold_lane_down",)
    interactive = route(IA, hot_slots=FULL, interactive_ttft_target_s=1.0, lanes_down=frozenset({COLD}))
    assert isinstance(interactive, RouteRefusal) and interactive.status == 429  # no spill to a lane without replicas
    continuation = route(IA, continuation=True, lanes_down=frozenset({COLD}))
    assert continuation.lane is HOT


def test_with_neither_lane_routable_realtime_is_503_interactive_waits_on_its_lane_and_batch_in_the_router():
    both = frozenset({HOT, COLD})
    refused = route(RT, lanes_down=both, realtime_ttft_target_s=0.5)
    assert isinstance(refused, RouteRefusal) and refused.status == 503 and refused.code == "hot_lane_down"
    # A rolling update of one-replica lanes, a lost node: Serve's handle holds it until its lane's first replica
    # runs, as it did before a lane was known to have none.
    waits = route(IA, hot_slots=FULL, interactive_ttft_target_s=1.0, lanes_down=both)
    assert waits.lane is HOT and waits.reasons == ("hot_lane_down",) and not waits.wait_for_hot_slot
    assert route(BA, lanes_down=both).wait_for_lane_s == 1.0
