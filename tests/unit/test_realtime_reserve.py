"""Realtime reserve: which hot replicas are kept for realtime requests (pure), and the lanes' request router applying
it to Serve's candidates (fake replicas, no Ray cluster)."""

import pytest

from app.config import ConfigError, load_app_config
from app.main import lane_request_router_config
from app.prefix_cache.realtime_reserve import reserved_replica_ids, split_by_reserve
from tests.unit.test_config import cpu_args
from tests.unit.test_prefix_policy import FakeReplica, LaneRequest, make_router, pending


# --- pure rule ---------------------------------------------------------------------------------------------------
def test_the_first_ids_in_sorted_order_are_reserved_whatever_order_they_come_in():
    assert reserved_replica_ids(["c", "a", "b"], 1) == ["a"]
    assert reserved_replica_ids(["c", "a", "b"], 2) == ["a", "b"]
    assert reserved_replica_ids(["b", "a"], 0) == []


def test_no_reserve_when_it_would_leave_nobody_for_the_rest():
    # Two replicas configured, one died: the survivor serves every class.
    assert reserved_replica_ids(["a"], 1) == []
    assert reserved_replica_ids(["a", "b"], 2) == []
    assert split_by_reserve(["a"], "realtime", 1) == (["a"], [])
    assert split_by_reserve(["a"], "interactive", 1) == (["a"], [])


def test_realtime_prefers_the_reserve_and_everything_else_the_rest():
    ids = ["b", "c", "a"]
    assert split_by_reserve(ids, "realtime", 1) == (["a"], ["b", "c"])
    assert split_by_reserve(ids, "interactive", 1) == (["b", "c"], ["a"])
    assert split_by_reserve(ids, "batch", 1) == (["b", "c"], ["a"])
    assert split_by_reserve(ids, None, 1) == (["b", "c"], ["a"])  # a stats call, a warm-up
    assert split_by_reserve(ids, "realtime", 0) == (ids, [])


# --- the request router ------------------------------------------------------------------------------------------
async def test_router_keeps_realtime_on_the_reserved_replica_even_when_it_is_busier():
    reserved, shared = FakeReplica("a", queue_len=3), FakeReplica("b", queue_len=0)
    router = make_router(realtime_reserved_replicas=1)
    router.set_prefix_lookup(None)
    ranks = await router.choose_replicas([shared, reserved], pending(LaneRequest([1, 2], request_class="realtime")))
    assert ranks == [[reserved], [shared]]  # the shared replica only if the reserved one rejects (full)
    ranks = await router.choose_replicas([shared, reserved], pending(LaneRequest([1, 2]), "r2"))
    assert ranks == [[shared], [reserved]]
    assert router.stats.reserve_routing == {"preferred": 2}


async def test_a_full_reserve_or_a_full_rest_falls_back_to_the_other_side():
    reserved = FakeReplica("a", queue_len=64, max_ongoing_requests=64)
    shared = FakeReplica("b", queue_len=5)
    router = make_router(realtime_reserved_replicas=1)
    router.set_prefix_lookup(None)
    ranks = await router.choose_replicas([reserved, shared], pending(LaneRequest([1], request_class="realtime")))
    assert ranks == [[shared]]  # the full reserved replica is left out; the request is served, not refused
    reserved.queue_len, shared.queue_len = 0, 64
    router.replica_queue_len_cache.update(reserved.replica_id, 0)
    router.replica_queue_len_cache.update(shared.replica_id, 64)
    ranks = await router.choose_replicas([reserved, shared], pending(LaneRequest([1]), "r2"))
    assert ranks == [[reserved]]
    assert router.stats.reserve_routing == {"fallback": 2}


async def test_without_a_reserve_realtime_goes_by_load():
    busy, idle = FakeReplica("a", queue_len=3), FakeReplica("b", queue_len=0)
    router = make_router()
    router.set_prefix_lookup(None)
    ranks = await router.choose_replicas([busy, idle], pending(LaneRequest([1, 2], request_class="realtime")))
    assert ranks[0] == [idle]
    assert router.stats.reserve_routing == {}


# --- config ------------------------------------------------------------------------------------------------------
def reserve_args(reserved: int, hot_replicas: int, routing: str = "affinity") -> dict:
    # Two cold replicas: a lane of one has no request router of its own (AppConfig.keeps_prefix_index).
    return cpu_args(**{"admission.realtime_reserved_hot_replicas": reserved,
                       "hot_lane.deployment.num_replicas": hot_replicas, "prefix_cache.routing": routing,
                       "cold_lane.deployment.num_replicas": 2})


def test_the_reserve_reaches_the_hot_lanes_router_only():
    cfg = load_app_config(reserve_args(1, 2))
    assert lane_request_router_config(cfg, cfg.hot_lane)["request_router_kwargs"]["realtime_reserved_replicas"] == 1
    assert lane_request_router_config(cfg, cfg.cold_lane)["request_router_kwargs"]["realtime_reserved_replicas"] == 0


def test_a_reserve_that_leaves_no_replica_for_interactive_is_refused():
    with pytest.raises(ConfigError) as error:
        load_app_config(reserve_args(1, 1))
    message = str(error.value)
    assert "admission.realtime_reserved_hot_replicas=1" in message and "hot_lane.deployment.num_replicas" in message


def test_a_reserve_without_the_lanes_request_router_is_refused():
    with pytest.raises(ConfigError) as error:
        load_app_config(reserve_args(1, 2, routing="pow2"))
    assert "prefix_cache.routing: affinity" in str(error.value)
