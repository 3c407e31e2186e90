import pytest

from app.classes import Lane, RequestClass, UnknownRequestClass, classify, policy_for


@pytest.mark.parametrize("tier, expected", [
    (None, RequestClass.INTERACTIVE), ("auto", RequestClass.INTERACTIVE), ("default", RequestClass.INTERACTIVE),
    ("priority", RequestClass.REALTIME), ("flex", RequestClass.BATCH),
])
def test_service_tier_maps_to_class(tier, expected):
    assert classify(tier) is expected


def test_header_wins_over_service_tier():
    assert classify("flex", "Realtime") is RequestClass.REALTIME


def test_unknown_values_are_client_errors():
    with pytest.raises(UnknownRequestClass, match="X-Request-Class header 'urgent'"):
        classify(None, "urgent")
    with pytest.raises(UnknownRequestClass, match="service_tier 'scale'"):
        classify("scale")


@pytest.mark.parametrize("tier", [[], {}, ["flex"], 5, True])
def test_a_service_tier_that_is_not_a_string_is_a_client_error(tier):
    # From a JSON body: a list or an object would otherwise fail the lookup itself (a 500, not the client's 400).
    with pytest.raises(UnknownRequestClass, match="unknown service_tier"):
        classify(tier)


def test_classes_map_to_lanes_and_vllm_priorities():
    assert policy_for(RequestClass.REALTIME).lane is Lane.HOT
    assert policy_for(RequestClass.INTERACTIVE).lane is Lane.HOT
    assert policy_for(RequestClass.BATCH).lane is Lane.COLD
    # vLLM serves lower priority values first.
    priorities = [policy_for(c).priority for c in (RequestClass.REALTIME, RequestClass.INTERACTIVE, RequestClass.BATCH)]
    assert priorities == sorted(priorities) and len(set(priorities)) == 3
