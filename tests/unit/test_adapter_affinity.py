"""Adapter affinity's rules (app/prefix_cache/adapter_affinity.py), one test per rule."""

from dataclasses import dataclass

import pytest

from app.prefix_cache.adapter_affinity import AdapterReason, adapter_root_hash, narrow_for_adapter
from app.prefix_cache.index import ROOT_HASH, block_hashes
from tests.unit.test_prefix_policy import FakeReplica, make_router, pending

REPLICAS = ("r1", "r2", "r3")


def test_rule_1_the_base_model_is_not_narrowed():
    held = {"r1": {"a": 3}}
    narrowed = narrow_for_adapter(None, REPLICAS, held, spread_at=4)
    assert narrowed.replica_ids == REPLICAS and narrowed.reason is AdapterReason.BASE_MODEL


def test_rule_2_an_adapter_goes_to_the_replicas_holding_it():
    held = {"r1": {"a": 1, "b": 0}, "r2": {"b": 2}, "r3": {"a": 0}}
    narrowed = narrow_for_adapter("a", REPLICAS, held, spread_at=4)
    assert narrowed.replica_ids == ("r1", "r3") and narrowed.reason is AdapterReason.LOADED


def test_rule_3_an_adapter_in_heavy_use_spreads_to_every_candidate():
    held = {"r1": {"a": 4}, "r2": {"b": 1}}
    narrowed = narrow_for_adapter("a", REPLICAS, held, spread_at=4)
    assert narrowed.replica_ids == REPLICAS and narrowed.reason is AdapterReason.SPREAD
    # One holder below the mark: it takes the next request, no spreading yet.
    held = {"r1": {"a": 4}, "r2": {"a": 3}}
    assert narrow_for_adapter("a", REPLICAS, held, spread_at=4).replica_ids == ("r1", "r2")
    # Every candidate holds it: nothing to spread to.
    held = {r: {"a": 9} for r in REPLICAS}
    assert narrow_for_adapter("a", REPLICAS, held, spread_at=4).reason is AdapterReason.LOADED


def test_rule_4_an_adapter_whose_holders_are_busy_spreads_to_every_candidate():
    held = {"r1": {"a": 1, "b": 3}, "r2": {"c": 0}}
    # r1's queue is 4 longer than r2's, the shortest of those that do not hold "a".
    narrowed = narrow_for_adapter("a", REPLICAS, held, spread_at=8, queue_lens={"r1": 5, "r2": 1, "r3": 2},
                                  max_queue_imbalance=4)
    assert narrowed.replica_ids == REPLICAS and narrowed.reason is AdapterReason.SPREAD_BUSY
    # 3 longer: below the bound, the holder keeps it.
    narrowed = narrow_for_adapter("a", REPLICAS, held, spread_at=8, queue_lens={"r1": 4, "r2": 1, "r3": 2},
                                  max_queue_imbalance=4)
    assert narrowed.replica_ids == ("r1",) and narrowed.reason is AdapterReason.LOADED
    # Every holder must be that busy: one holder with a short queue takes it.
    held = {"r1": {"a": 1}, "r2": {"a": 0}}
    narrowed = narrow_for_adapter("a", REPLICAS, held, spread_at=8, queue_lens={"r1": 6, "r2": 0, "r3": 0},
                                  max_queue_imbalance=4)
    assert narrowed.replica_ids == ("r1", "r2") and narrowed.reason is AdapterReason.LOADED
    # Without queue lengths (or a bound) the rule is off.
    held = {"r1": {"a": 1}}
    assert narrow_for_adapter("a", REPLICAS, held, spread_at=8).reason is AdapterReason.LOADED


def test_rule_5_an_adapter_nobody_holds_goes_where_the_fewest_adapters_are_loaded():
    held = {"r1": {"b": 0, "c": 0}, "r2": {"b": 0}, "r3": {"c": 1}}
    narrowed = narrow_for_adapter("a", REPLICAS, held, spread_at=4)
    assert narrowed.replica_ids == ("r2", "r3") and narrowed.reason is AdapterReason.NOT_LOADED
    assert narrow_for_adapter("a", REPLICAS, {}, spread_at=4).replica_ids == REPLICAS


def test_only_candidates_count():
    # r1 holds it but is not a candidate (full, or gone): the request is routed as if nobody held it.
    held = {"r1": {"a": 0}}
    assert narrow_for_adapter("a", ("r2", "r3"), held, spread_at=4).reason is AdapterReason.NOT_LOADED


def test_spread_at_must_be_positive():
    with pytest.raises(ValueError, match="spread_at=0"):
        narrow_for_adapter("a", REPLICAS, {}, spread_at=0)


def test_prefix_hashes_of_different_adapters_never_match():
    tokens = list(range(64))
    base = block_hashes(tokens, 16)
    a = block_hashes(tokens, 16, adapter_root_hash("a"))
    b = block_hashes(tokens, 16, adapter_root_hash("b"))
    assert adapter_root_hash(None) == ROOT_HASH
    assert not set(base) & set(a) and not set(a) & set(b)
    assert a == block_hashes(tokens, 16, adapter_root_hash("a"))


# --- the lanes' request router applying it (fake replicas, no Ray cluster) ----------------------------------------
@dataclass
class AdapterRequest:
    prompt_token_ids: list
    adapter: dict | None = None
    request_id: str = "req"
    request_class: str = "interactive"


def holding(replica: FakeReplica, **running: int) -> FakeReplica:
    replica.routing_stats = {**replica.routing_stats, "adapters": dict(running)}
    return replica


async def test_the_router_sends_an_adapters_request_to_the_replica_holding_it_and_counts_why():
    holder = holding(FakeReplica("a", queue_len=2), x=1)
    other = holding(FakeReplica("b", queue_len=0), y=0)
    router = make_router()
    router.set_prefix_lookup(None)
    ranks = await router.choose_replicas([other, holder], pending(AdapterRequest([1, 2], {"name": "x"})))
    assert ranks[0] == [holder]  # though busier
    ranks = await router.choose_replicas([other, holder], pending(AdapterRequest([1, 2]), "r2"))
    assert ranks[0] == [other]  # the base model: by load
    router.replica_queue_len_cache.update(holder.replica_id, 9)
    holding(holder, x=9)
    ranks = await router.choose_replicas([other, holder], pending(AdapterRequest([1, 2], {"name": "x"}), "r3"))
    assert ranks[0] == [other]  # every holder runs adapter_spread_at (8) of it: it spreads, by load
    assert router.stats.adapter_routing == {"adapter_loaded": 1, "adapter_spread": 1}
