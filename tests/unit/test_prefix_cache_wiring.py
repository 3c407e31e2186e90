"""The prefix cache's glue, without Ray: the shared state behind the PrefixCache deployment, a replica's feed and
warm-up, the lanes' request-router options and the per-replica stats merge."""

from __future__ import annotations

import asyncio

import pytest

from app.config import load_app_config
from app.lanes.replica_stats import merge_replica_stats
from app.lanes.types import LaneChunk
from app.main import lane_deployment_options, lane_request_router_config
from app.prefix_cache.index import PrefixIndex, block_hashes
from app.prefix_cache.replica_feed import ReplicaPrefixFeed
from app.prefix_cache.shared_state import SharedPrefixState
from tests.unit.test_config import cpu_args, error_of
from tests.fakes import FakeClock
from tests.unit.test_popularity import BLOCK

def indexed_args(**overrides):
    """App args whose lanes run two replicas each: lanes that keep the prefix index (AppConfig.keeps_prefix_index)."""
    return cpu_args(**{"hot_lane.deployment.num_replicas": 2, "cold_lane.deployment.num_replicas": 2, **overrides})


def prompt(seed: int, length: int = 1100) -> list[int]:
    return [(seed * 7919 + i) % 5000 + 3 for i in range(length)]


# ---- SharedPrefixState --------------------------------------------------------------------------------------------


def test_exact_feed_adds_removes_and_resyncs_a_replica():
    state = SharedPrefixState(load_app_config(cpu_args()))
    hashes = block_hashes(prompt(1), BLOCK)
    state.apply_update("r1", "hot", hashes, [], False)
    assert state.lookup(hashes, BLOCK) == [("r1", len(hashes) * BLOCK)]
    # BlockRemoved of the last 10 blocks: the match shrinks to what is left.
    state.apply_update("r1", "hot", [], hashes[-10:], False)
    assert state.lookup(hashes, BLOCK) == [("r1", (len(hashes) - 10) * BLOCK)]
    # A resync (cleared) replaces everything the replica held.
    other = block_hashes(prompt(2), BLOCK)
    state.apply_update("r1", "hot", other, [], True)
    assert state.lookup(hashes, BLOCK) == []
    assert state.lookup(other, BLOCK)[0][0] == "r1"
    assert state.stats()["replicas"]["r1"]["blocks"] == len(other)


def test_observed_prompts_index_blocks_only_for_the_approximate_feed_and_count_for_pinning():
    state = SharedPrefixState(load_app_config(cpu_args()))
    tokens = prompt(3)
    state.observe_prompt("r1", "cold", tokens, BLOCK, record_blocks=False)
    assert state.lookup(block_hashes(tokens, BLOCK), BLOCK) == []
    state.observe_prompt("r2", "cold", tokens, BLOCK, record_blocks=True)
    assert state.lookup(block_hashes(tokens, BLOCK), BLOCK) == [("r2", len(tokens) // BLOCK * BLOCK)]
    # Seen twice: pinned (the full-block part of the prompt).
    assert state.pinned_prefixes() == [tokens[: len(tokens) // BLOCK * BLOCK]]


def test_approximate_entries_expire_after_the_ttl_but_exact_ones_never_do():
    clock = FakeClock()
    approximate = SharedPrefixState(load_app_config(cpu_args(**{"prefix_cache.feed": "approximate",
                                                                "prefix_cache.approximate_ttl_s": 60})), clock=clock)
    tokens = prompt(4)
    approximate.observe_prompt("r1", "hot", tokens, BLOCK, record_blocks=True)
    clock.now += 30
    assert approximate.expire_approximate() == 0
    clock.now += 31
    assert approximate.expire_approximate() == len(tokens) // BLOCK
    assert approximate.lookup(block_hashes(tokens, BLOCK), BLOCK) == []

    exact = SharedPrefixState(load_app_config(cpu_args()), clock=clock)
    exact.apply_update("r1", "hot", block_hashes(tokens, BLOCK), [], False)
    clock.now += 10_000
    assert exact.expire_approximate() == 0 and len(exact.index) == len(tokens) // BLOCK


def test_replicas_that_stop_reporting_are_forgotten_with_their_index_entries():
    clock = FakeClock()
    state = SharedPrefixState(load_app_config(cpu_args()), clock=clock, replica_stale_s=15)
    hashes = block_hashes(prompt(5), BLOCK)
    state.apply_update("old", "cold", hashes, [], False)
    state.apply_update("new", "cold", hashes, [], False)
    state.report_replica_stats("old", "cold", {"replica_id": "old", "running": 1})
    state.report_replica_stats("new", "cold", {"replica_id": "new", "running": 2})
    assert [s["replica_id"] for s in state.replica_stats()["cold"]] == ["new", "old"]
    clock.now += 10
    state.report_replica_stats("new", "cold", {"replica_id": "new", "running": 0})
    clock.now += 10
    assert state.forget_stale_replicas() == ["old"]
    assert [m[0] for m in state.lookup(hashes, BLOCK)] == ["new"]
    assert state.replica_stats() == {"cold": [{"replica_id": "new", "running": 0, "stats_age_s": 10.0}]}


def test_index_expire_unused_keeps_recently_looked_up_entries():
    clock = FakeClock()
    index = PrefixIndex(max_entries=1000, clock=clock)
    a, b = block_hashes(prompt(6), BLOCK), block_hashes(prompt(7), BLOCK)
    index.add("r1", a)
    index.add("r1", b)
    clock.now += 50
    index.longest_matches(a, BLOCK)  # a lookup is a use
    clock.now += 20
    assert index.expire_unused(60) == len(b)
    assert index.longest_matches(a, BLOCK)[0].matched_tokens == len(a) * BLOCK
    assert index.blocks_by_replica() == {"r1": len(a)}


# ---- a replica's feed and warm-up ---------------------------------------------------------------------------------


class FakeMethod:
    def __init__(self, result=None, delay_s: float = 0.0):
        self.calls: list[tuple] = []
        self.result = result
        self.delay_s = delay_s

    def remote(self, *args):
        self.calls.append(args)

        async def answer():
            await asyncio.sleep(self.delay_s)
            return self.result

        return answer()


class FakePrefixCache:
    def __init__(self, pinned: list[list[int]], delay_s: float = 0.0):
        self.pinned_prefixes = FakeMethod(pinned, delay_s)
        self.observe_prompt = FakeMethod()
        self.apply_update = FakeMethod()
        self.report_replica_stats = FakeMethod()


def recording_generate(seen: list):
    async def generate(request):
        seen.append(request)
        yield LaneChunk(text="x", completion_tokens=1, prompt_tokens=len(request.prompt_token_ids),
                        cached_prompt_tokens=0, finish_reason="length")

    return generate


async def test_warm_up_prefills_each_pinned_prefix_with_one_token():
    pinned = [prompt(8, 1024), prompt(9, 2048)]
    cache = FakePrefixCache(pinned)
    feed = ReplicaPrefixFeed(load_app_config(indexed_args(**{"prefix_cache.feed": "approximate"})), "cold", "r1", BLOCK,
                             cache)
    seen: list = []
    await feed.warm_up(recording_generate(seen))
    assert [r.prompt_token_ids for r in seen] == pinned
    assert all(r.sampling.max_tokens == 1 and not r.stream and r.request_class == "batch" for r in seen)
    assert feed.stats()["warmup"]["prefixes"] == 2 and feed.stats()["warmup"]["prompt_tokens"] == 3072
    assert feed.engine_kv_events_config() is None  # approximate feed: the engine publishes no events


async def test_warm_up_gives_up_after_its_timeout_and_the_replica_starts_anyway():
    cache = FakePrefixCache([prompt(1)], delay_s=5)
    feed = ReplicaPrefixFeed(load_app_config(indexed_args(**{"prefix_cache.warmup_timeout_s": 0.05})), "hot", "r1",
                             BLOCK, cache)
    seen: list = []
    await feed.warm_up(recording_generate(seen))
    assert seen == [] and "TimeoutError" in feed.stats()["warmup"]["error"]


async def test_observe_sends_long_prompts_only_and_says_which_feed_indexes_them():
    cache = FakePrefixCache([])
    exact = ReplicaPrefixFeed(load_app_config(indexed_args()), "hot", "r1", BLOCK, cache)
    assert exact.engine_kv_events_config()["enable_kv_cache_events"] is True
    exact.observe(prompt(1, 100))  # shorter than min_prefix_tokens (1024)
    exact.observe(prompt(1, 1100))
    await asyncio.sleep(0)
    assert [(c[0], len(c[2]), c[4]) for c in cache.observe_prompt.calls] == [("r1", 1100, False)]
    approximate = ReplicaPrefixFeed(load_app_config(indexed_args(**{"prefix_cache.feed": "approximate"})), "hot", "r2",
                                    BLOCK, cache)
    approximate.observe(prompt(2, 1100))
    await asyncio.sleep(0)
    assert cache.observe_prompt.calls[-1][4] is True


async def test_a_lane_of_one_replica_keeps_no_index_but_counts_popularity_and_warms_up():
    """Nothing to choose between: no KV events, no blocks recorded, no affinity router; the rest stays."""
    cache = FakePrefixCache([prompt(8, 1024)])
    for feed_mode in ("kv_events", "approximate"):
        cfg = load_app_config(cpu_args(**{"prefix_cache.feed": feed_mode, "cold_lane.deployment.num_replicas": 2}))
        assert not cfg.keeps_prefix_index(cfg.hot_lane) and cfg.keeps_prefix_index(cfg.cold_lane)
        feed = ReplicaPrefixFeed(cfg, "hot", "r1", BLOCK, cache)
        assert feed.engine_kv_events_config() is None and feed.stats()["mode"] == "off"
        feed.observe(prompt(1, 1100))
        await asyncio.sleep(0)
        assert cache.observe_prompt.calls[-1][:2] == ("r1", "hot") and cache.observe_prompt.calls[-1][4] is False
        seen: list = []
        await feed.warm_up(recording_generate(seen))
        assert [r.prompt_token_ids for r in seen] == [prompt(8, 1024)]
        assert lane_request_router_config(cfg, cfg.hot_lane)["request_router_class"].endswith(":LaneRouter")
        hot_router = lane_deployment_options(cfg.hot_lane, cfg)["request_router_config"]
        assert hot_router.request_router_class.endswith(":LaneRouter")
        cold_router = lane_deployment_options(cfg.cold_lane, cfg)["request_router_config"]
        assert cold_router.request_router_class.endswith(":PrefixAffinityRouter")


def test_an_autoscaled_lane_keeps_the_index_when_it_may_grow_past_one_replica():
    autoscaling = {"min_replicas": 1, "max_replicas": 3}
    cfg = load_app_config(cpu_args(**{"cold_lane.deployment.autoscaling": autoscaling}))
    assert cfg.cold_lane.deployment.max_replicas == 3 and cfg.keeps_prefix_index(cfg.cold_lane)
    single = load_app_config(cpu_args(**{"cold_lane.deployment.autoscaling": {**autoscaling, "max_replicas": 1}}))
    assert not single.keeps_prefix_index(single.cold_lane)


def test_no_prefix_cache_means_no_events_no_warm_up_and_feed_off():
    feed = ReplicaPrefixFeed(load_app_config(indexed_args()), "hot", "r1", BLOCK, None)
    assert feed.engine_kv_events_config() is None and feed.stats()["mode"] == "off"
    feed.observe(prompt(1))  # nothing to send to: no error


# ---- deployment options and config --------------------------------------------------------------------------------


def test_lanes_use_the_affinity_router_by_default_and_serves_pow2_when_asked():
    cfg = load_app_config(indexed_args(**{"prefix_cache.match_threshold": 0.9}))
    options = lane_deployment_options(cfg.cold_lane, cfg)
    router = options["request_router_config"]
    assert router.request_router_kwargs["settings"]["match_threshold"] == 0.9
    assert router.request_router_kwargs["block_size"] == cfg.cold_lane.engine.block_size
    assert router.request_routing_stats_period_s == 1.0
    pow2 = load_app_config(indexed_args(**{"prefix_cache.routing": "pow2"}))
    # Serve's power-of-two choices, in the class that reports the lane's replicas to the Router.
    assert lane_request_router_config(pow2, pow2.hot_lane) == {
        "request_router_class": "app.prefix_cache.request_router:LaneRouter"}
    assert lane_deployment_options(pow2.hot_lane, pow2)["request_router_config"].request_router_class.endswith(
        ":LaneRouter")


def test_kv_events_feed_needs_the_engine_prefix_cache():
    message = error_of(indexed_args(**{"hot_lane.engine.enable_prefix_caching": False}))
    assert "hot_lane.engine.enable_prefix_caching" in message and "feed: approximate" in message
    load_app_config(cpu_args(**{"hot_lane.engine.enable_prefix_caching": False, "prefix_cache.feed": "approximate"}))
    # A lane of one replica sends no events, so its engine may run without a prefix cache.
    load_app_config(cpu_args(**{"hot_lane.engine.enable_prefix_caching": False}))


@pytest.mark.parametrize("field,value", [("prefix_cache.lookup_timeout_s", 0), ("prefix_cache.routing", "random"),
                                         ("prefix_cache.feed", "guess"), ("prefix_cache.max_queue_imbalance", -1)])
def test_prefix_cache_fields_are_validated(field, value):
    assert field.split(".")[-1] in error_of(cpu_args(**{field: value}))


# ---- admin stats ----------------------------------------------------------------------------------------------------


def test_admin_stats_list_every_replica_live_one_first():
    live = {"replica_id": "a", "running": 3}
    registry = [{"replica_id": "a", "running": 1, "stats_age_s": 1.5}, {"replica_id": "b", "running": 0}]
    assert merge_replica_stats(live, registry) == [live, {"replica_id": "b", "running": 0}]
    assert merge_replica_stats({"error": "timeout"}, registry) == registry
    assert merge_replica_stats({"error": "timeout"}, []) == [{"error": "timeout"}]


async def test_a_restarted_prefix_cache_gets_a_full_resync():
    from types import SimpleNamespace

    from app.prefix_cache.kv_events import IndexUpdate

    cache = FakePrefixCache([])
    feed = ReplicaPrefixFeed(load_app_config(indexed_args()), "hot", "r1", BLOCK, cache)
    resyncs = []
    feed.subscriber = SimpleNamespace(request_resync=lambda: resyncs.append(True))
    cache.apply_update.result = "epoch-1"
    await feed._report(IndexUpdate(adds=[1, 2]))
    await feed._report(IndexUpdate(removes=[2]))
    assert resyncs == []
    cache.apply_update.result = "epoch-2"  # the PrefixCache replica was replaced: it lost what we sent
    await feed._report(IndexUpdate(adds=[3]))
    assert resyncs == [True]
    await feed._report(IndexUpdate(adds=[4]))
    assert resyncs == [True]


async def test_an_idle_replica_notices_a_restarted_prefix_cache_through_its_stats_push():
    """No KV event flows while a replica is idle, so the periodic stats push is what carries the new epoch."""
    from types import SimpleNamespace

    cache = FakePrefixCache([])
    feed = ReplicaPrefixFeed(load_app_config(indexed_args()), "hot", "r1", BLOCK, cache)
    resyncs = []
    feed.subscriber = SimpleNamespace(request_resync=lambda: resyncs.append(True))

    async def push() -> None:
        feed.report_replica_stats({"replica_id": "r1", "running": 0})
        await feed._stats_report

    cache.report_replica_stats.result = "epoch-1"
    await push()
    await push()
    assert resyncs == [] and cache.report_replica_stats.calls[-1] == ("r1", "hot", {"replica_id": "r1", "running": 0})
    cache.report_replica_stats.result = "epoch-2"
    await push()
    assert resyncs == [True]


async def test_a_slow_stats_push_is_not_piled_up_and_a_failed_one_is_dropped():
    cache = FakePrefixCache([])
    cache.report_replica_stats.delay_s = 0.05
    feed = ReplicaPrefixFeed(load_app_config(indexed_args()), "hot", "r1", BLOCK, cache)
    feed.report_replica_stats({"n": 1})
    feed.report_replica_stats({"n": 2})  # the first is still unanswered: skipped
    await feed._stats_report
    assert [call[2] for call in cache.report_replica_stats.calls] == [{"n": 1}]

    def broken(*args):
        raise RuntimeError("PrefixCache is gone")

    cache.report_replica_stats.remote = broken
    feed.report_replica_stats({"n": 3})
    await feed._stats_report  # logged, not raised; the next push goes out
    assert feed._stats_report is None
