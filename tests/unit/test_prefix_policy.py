"""Affinity decision (pure) and the Ray Serve PrefixAffinityRouter driven with fake replicas (no Ray cluster)."""

import asyncio
import random
import threading
from collections import Counter
from dataclasses import dataclass, field

import pytest

from app.config import PrefixCacheConfig
from app.prefix_cache.index import PrefixIndex, block_hashes
from app.prefix_cache.policy import (
    AffinityPolicy,
    ReplicaLoad,
    RoutingReason,
    decide,
    load_score,
    power_of_two_choice,
)

POLICY = AffinityPolicy(min_prefix_tokens=1024, match_threshold=0.85, max_queue_imbalance=4, kv_usage_weight=8.0)


def loads(*specs):
    return [ReplicaLoad(rid, q, kv) for rid, q, kv in specs]


# --- pure decision ---------------------------------------------------------------------------------------------
def test_affinity_to_the_longest_match_above_threshold():
    candidates = loads(("a", 3, 0.2), ("b", 0, 0.0), ("c", 1, 0.1))
    decision = decide(2000, candidates, {"a": 1900, "b": 512}, POLICY, random.Random(0))
    assert decision.replica_id == "a"
    assert decision.reason is RoutingReason.AFFINITY
    assert decision.match_ratio == pytest.approx(0.95)
    assert decision.matched_tokens == 1900


def test_short_prompts_skip_affinity():
    decision = decide(1023, loads(("a", 0, 0), ("b", 0, 0)), {"a": 1023}, POLICY, random.Random(0))
    assert decision.reason is RoutingReason.SHORT_PROMPT
    assert decision.match_ratio == 0.0


def test_threshold_boundary():
    candidates = loads(("a", 0, 0), ("b", 0, 0))
    at = decide(2000, candidates, {"a": 1700}, POLICY, random.Random(0))  # exactly 0.85
    assert (at.replica_id, at.reason) == ("a", RoutingReason.AFFINITY)
    below = decide(2000, candidates, {"a": 1696}, POLICY, random.Random(0))
    assert below.reason is RoutingReason.BELOW_THRESHOLD
    assert below.match_ratio == pytest.approx(0.848)


def test_imbalance_bound_is_inclusive():
    within = decide(2000, loads(("a", 6, 0), ("b", 2, 0)), {"a": 2000}, POLICY, random.Random(0))
    assert (within.replica_id, within.reason) == ("a", RoutingReason.AFFINITY)
    beyond = decide(2000, loads(("a", 7, 0), ("b", 2, 0)), {"a": 2000}, POLICY, random.Random(0))
    assert beyond.reason is RoutingReason.IMBALANCED
    assert beyond.replica_id == "b"  # only two candidates: power of two picks the lighter
    assert beyond.match_ratio == pytest.approx(1.0)


def test_no_match_and_lookup_failed():
    candidates = loads(("a", 0, 0), ("b", 0, 0))
    assert decide(2000, candidates, {}, POLICY, random.Random(0)).reason is RoutingReason.NO_MATCH
    # Matches on replicas that are not candidates (the other lane, a dead replica) do not count.
    assert decide(2000, candidates, {"z": 2000}, POLICY, random.Random(0)).reason is RoutingReason.NO_MATCH
    assert decide(2000, candidates, None, POLICY, random.Random(0)).reason is RoutingReason.LOOKUP_FAILED


def test_equal_matches_go_to_the_lighter_replica():
    candidates = loads(("a", 3, 0), ("b", 1, 0), ("c", 0, 0))
    decision = decide(2000, candidates, {"a": 1800, "b": 1800}, POLICY, random.Random(0))
    assert decision.replica_id == "b"


def test_matched_tokens_are_capped_at_the_prompt():
    decision = decide(1100, loads(("a", 0, 0)), {"a": 1120}, POLICY, random.Random(0))
    assert decision.match_ratio == 1.0


def test_load_score_formula():
    assert load_score(ReplicaLoad("a", 3, 0.5), 8.0) == 7.0
    assert load_score(ReplicaLoad("a", 3, 2.0), 8.0) == 11.0  # usage clamped to 1
    assert load_score(ReplicaLoad("a", 3, 0.9), 0.0) == 3.0


def test_power_of_two_prefers_lower_score_and_spreads_load():
    rng = random.Random(1)
    candidates = loads(("busy", 12, 0.0), ("kvfull", 2, 1.0), ("idle", 2, 0.0), ("mid", 4, 0.0))
    picks = Counter(power_of_two_choice(candidates, rng, 8.0).replica_id for _ in range(4000))
    # "busy" (score 12) loses every pair, so it is never picked; "idle" (2) wins every pair it is in (1/2 of them).
    assert picks["busy"] == 0
    assert picks["idle"] == pytest.approx(2000, rel=0.1)
    assert picks["mid"] > 0 and picks["kvfull"] < picks["idle"]
    assert power_of_two_choice(candidates[:1], rng, 8.0).replica_id == "busy"
    with pytest.raises(ValueError):
        power_of_two_choice([], rng, 8.0)


def test_policy_validation():
    for bad in ({"match_threshold": 0}, {"match_threshold": 1.01}, {"min_prefix_tokens": 0},
                {"max_queue_imbalance": -1}, {"kv_usage_weight": -1}):
        with pytest.raises(ValueError):
            AffinityPolicy(**{"min_prefix_tokens": 1024, "match_threshold": 0.85, "max_queue_imbalance": 4,
                              "kv_usage_weight": 8.0, **bad})
    with pytest.raises(ValueError):
        decide(2000, [], {}, POLICY, random.Random(0))


# --- the Serve request router with fake replicas -------------------------------------------------------------------
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest, ReplicaID  # noqa: E402

from app.prefix_cache import request_router as rr  # noqa: E402

DEPLOYMENT = DeploymentID(name="HotLane", app_name="llm-lanes")
BLOCK = 32


@dataclass
class FakeReplica:
    """What the router reads from a RunningReplica."""

    unique_id: str
    queue_len: int = 0
    kv_usage: float = 0.0
    max_ongoing_requests: int = 64
    probes: int = 0
    routing_stats: dict = field(default_factory=dict)

    def __post_init__(self):
        self.replica_id = ReplicaID(self.unique_id, DEPLOYMENT)
        self.routing_stats = {"kv_usage": self.kv_usage}

    @property
    def full_id(self) -> str:
        return self.replica_id.to_full_id_str()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.probes += 1
        return self.queue_len


@dataclass
class LaneRequest:
    prompt_token_ids: list
    request_id: str = "req"
    request_class: str = "interactive"


def make_router(realtime_reserved_replicas: int = 0, **settings) -> rr.PrefixAffinityRouter:
    """A router over the schema's prefix_cache settings, with `settings` overriding some of them."""
    router = rr.PrefixAffinityRouter(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA, use_replica_queue_len_cache=True
    )
    router.initialize_state(settings=PrefixCacheConfig(**settings).model_dump(mode="json"), block_size=BLOCK,
                            realtime_reserved_replicas=realtime_reserved_replicas, seed=7)
    router.stats = rr.DecisionStats()  # the process-wide one is shared by every router of "HotLane"
    return router


def pending(arg, request_id="r1") -> PendingRequest:
    return PendingRequest(args=[arg], kwargs={}, metadata=RequestMetadata(request_id=request_id,
                                                                          internal_request_id=request_id))


def index_lookup(index: PrefixIndex, delay_s: float = 0.0, fail: bool = False):
    calls = []

    async def lookup(hashes, block_size):
        calls.append(len(hashes))
        if delay_s:
            await asyncio.sleep(delay_s)
        if fail:
            raise RuntimeError("PrefixCache replica died")
        return [(m.replica_id, m.matched_tokens) for m in index.longest_matches(hashes, block_size)]

    lookup.calls = calls
    return lookup


PROMPT = list(range(5000, 5000 + 1100))  # 1100 tokens: 34 full blocks (1088 tokens), ratio 0.989 when all held


def test_extract_prompt_token_ids_from_objects_dicts_and_kwargs():
    assert rr.extract_prompt_token_ids([LaneRequest([1, 2])], {}) == [1, 2]
    assert rr.extract_prompt_token_ids([{"prompt_token_ids": (3,)}], {}) == [3]
    assert rr.extract_prompt_token_ids(["text"], {"request": {"prompt_token_ids": [4]}}) == [4]
    assert rr.extract_prompt_token_ids(["text"], {}) is None


def test_rank_replicas_puts_the_choice_first():
    assert rr.rank_replicas(["a", "b", "c"], "b", str) == [["b"], ["a", "c"]]
    assert rr.rank_replicas(["a"], "a", str) == [["a"]]


async def test_router_routes_to_the_replica_holding_the_prefix():
    a, b = FakeReplica("a", queue_len=2), FakeReplica("b", queue_len=0)
    index = PrefixIndex(max_entries=1000)
    index.add(a.full_id, block_hashes(PROMPT, BLOCK))
    router = make_router()
    lookup = index_lookup(index)
    router.set_prefix_lookup(lookup)
    ranks = await router.choose_replicas([a, b], pending(LaneRequest(PROMPT)))
    assert ranks == [[a], [b]]
    assert lookup.calls == [34]
    assert router.stats.reasons == {"affinity": 1}
    assert a.probes == 1 and b.probes == 1  # not in Serve's queue-length cache yet: probed


async def test_router_uses_cached_queue_lengths_and_kv_usage_without_probing():
    a, b = FakeReplica("a", kv_usage=0.9), FakeReplica("b", kv_usage=0.0)
    router = make_router()
    router.set_prefix_lookup(None)
    router.replica_queue_len_cache.update(a.replica_id, 1)
    router.replica_queue_len_cache.update(b.replica_id, 1)
    ranks = await router.choose_replicas([a, b], pending(LaneRequest([1, 2, 3])))
    assert ranks[0] == [b]  # same queue, b has free KV cache (score 1 vs 1 + 8 * 0.9)
    assert a.probes == b.probes == 0
    assert router.stats.reasons == {"short_prompt": 1}


async def test_router_imbalance_falls_back_to_load():
    a, b = FakeReplica("a", queue_len=9), FakeReplica("b", queue_len=0)
    index = PrefixIndex(max_entries=1000)
    index.add(a.full_id, block_hashes(PROMPT, BLOCK))
    router = make_router(max_queue_imbalance=4)
    router.set_prefix_lookup(index_lookup(index))
    ranks = await router.choose_replicas([a, b], pending(LaneRequest(PROMPT)))
    assert ranks[0] == [b]
    assert router.stats.reasons == {"imbalanced": 1}


async def test_slow_or_dead_prefix_cache_never_delays_or_fails_routing():
    a, b = FakeReplica("a"), FakeReplica("b")
    index = PrefixIndex(max_entries=1000)
    index.add(a.full_id, block_hashes(PROMPT, BLOCK))
    router = make_router(lookup_timeout_s=0.005)
    router.set_prefix_lookup(index_lookup(index, delay_s=1.0))
    loop = asyncio.get_running_loop()
    started = loop.time()
    ranks = await router.choose_replicas([a, b], pending(LaneRequest(PROMPT)))
    assert loop.time() - started < 0.5
    assert ranks and len(ranks[0]) == 1
    router.set_prefix_lookup(index_lookup(index, fail=True))
    assert await router.choose_replicas([a, b], pending(LaneRequest(PROMPT), "r2"))
    assert router.stats.reasons == {"lookup_failed": 2}
    snapshot = router.stats.snapshot()
    assert snapshot["p99_ms"] is not None and sum(snapshot["buckets_ms"].values()) >= 2


async def test_full_or_silent_replicas_are_left_out():
    full = FakeReplica("full", queue_len=64, max_ongoing_requests=64)
    ok = FakeReplica("ok", queue_len=10)
    index = PrefixIndex(max_entries=1000)
    index.add(full.full_id, block_hashes(PROMPT, BLOCK))
    router = make_router()
    router.set_prefix_lookup(index_lookup(index))
    ranks = await router.choose_replicas([full, ok], pending(LaneRequest(PROMPT)))
    assert ranks == [[ok]]
    assert router.stats.reasons == {"no_match": 1}


async def test_observer_hook():
    a, b = FakeReplica("a"), FakeReplica("b")
    seen = []
    observer = lambda name, decision, elapsed: seen.append((name, decision.reason.value, elapsed))  # noqa: E731
    rr.add_decision_observer(observer)
    try:
        router = make_router()
        router.set_prefix_lookup(index_lookup(PrefixIndex(max_entries=1000)))
        request = pending(LaneRequest(PROMPT), "feed-1")
        await router.choose_replicas([a, b], request)
    finally:
        rr.remove_decision_observer(observer)
    assert seen and seen[0][0] == "HotLane" and seen[0][1] == "no_match" and seen[0][2] >= 0
    assert request.routing_context.should_backoff  # retries back off instead of spinning


async def test_affinity_keeps_a_shared_prefix_group_on_one_replica():
    """End to end over the real index: once a group's prefix is recorded on a replica, its requests stay there."""
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    index = PrefixIndex(max_entries=1000)
    router = make_router()
    router.set_prefix_lookup(index_lookup(index))
    system = list(range(100_000, 100_000 + 1024))
    chosen = []
    for i in range(10):
        prompt = system + [7, 8, 9, i]  # ratio 1024 / 1028 >= 0.85
        request = pending(LaneRequest(prompt), f"g{i}")
        ranks = await router.choose_replicas(replicas, request)
        # The replica records the prompt it admitted (what the feeds do), under its full id.
        index.add(ranks[0][0].full_id, block_hashes(prompt, BLOCK))
        chosen.append(ranks[0][0].unique_id)
    assert len(set(chosen[1:])) == 1 and chosen[1] == chosen[0]
    assert router.stats.reasons["affinity"] == 9


def test_initialize_state_rejects_unknown_and_bad_kwargs():
    router = rr.PrefixAffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA)
    settings = PrefixCacheConfig().model_dump(mode="json")
    with pytest.raises(TypeError):
        router.initialize_state(settings=settings, block_sise=32, realtime_reserved_replicas=0)
    with pytest.raises(ValueError):
        router.initialize_state(settings={**settings, "match_threshold": 1.5}, block_size=32,
                                realtime_reserved_replicas=0)
    with pytest.raises(ValueError):
        router.initialize_state(settings={**settings, "lookup_timeout_s": 0}, block_size=32,
                                realtime_reserved_replicas=0)
    with pytest.raises(ValueError):
        router.initialize_state(settings={**settings, "match_thresold": 0.9}, block_size=32,
                                realtime_reserved_replicas=0)


def test_plugs_into_serves_request_router_config(tmp_path):
    """Serve cloudpickles the router module by value; the copy a routing process unpickles must still report to the
    shared decision_stats module (imported by reference), and module state must not stop the pickling."""
    import subprocess
    import sys
    import threading

    from ray.serve.config import RequestRouterConfig

    rr.decision_stats("HotLane")  # populated registries (locks inside) must not break pickling
    lock = threading.Lock()
    observer = lambda *args: lock  # noqa: E731
    rr.add_decision_observer(observer)
    try:
        config = RequestRouterConfig(
            request_router_class="app.prefix_cache.request_router:PrefixAffinityRouter",
            request_router_kwargs={"settings": PrefixCacheConfig().model_dump(mode="json"), "block_size": 32,
                                   "realtime_reserved_replicas": 0},
            request_routing_stats_period_s=1.0,
        )
    finally:
        rr.remove_decision_observer(observer)
    assert config.get_request_router_class() is rr.PrefixAffinityRouter
    (tmp_path / "router.pkl").write_bytes(config._serialized_request_router_cls)
    child = f"""
import asyncio, pickle
from app.prefix_cache import decision_stats
from app.prefix_cache.policy import RoutingDecision, RoutingReason
from ray.serve._private.common import DeploymentHandleSource, DeploymentID
cls = pickle.loads(open({str(tmp_path / "router.pkl")!r}, "rb").read())
seen = []
decision_stats.add_decision_observer(lambda name, decision, elapsed: seen.append(name))
router = cls(deployment_id=DeploymentID(name="ColdLane", app_name="a"), handle_source=DeploymentHandleSource.REPLICA)
router.initialize_state(settings={{}}, block_size=32, realtime_reserved_replicas=0)
router.record_decision(RoutingDecision("r", RoutingReason.SHORT_PROMPT, 0.0), 0.001)
assert seen == ["ColdLane"], seen
assert decision_stats.decision_stats("ColdLane").reasons == {{"short_prompt": 1}}
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]


@pytest.mark.parametrize("separate_loop", [True, False])
async def test_prefix_cache_handle_is_made_where_serve_routes(monkeypatch, separate_loop):
    # Serve's default routes handle calls on its own loop, and making a handle then waits on that loop: a worker
    # thread does it. With RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 (gpu-single.yaml's runtime_env) Serve refuses a
    # handle made off the caller's loop, so it is made on the loop, at once.
    # Patched at the source the router reads at call time (a module attribute patch on `rr` would not reach a copy
    # of the router module that an earlier test had Serve pickle by value).
    monkeypatch.setattr("ray.serve._private.constants.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", separate_loop)
    router = make_router(lookup="remote")
    made_on = []

    async def lookup(hashes, block_size):
        return []

    def create():
        made_on.append(threading.get_ident())
        return lookup, None

    monkeypatch.setattr(router, "_create_prefix_cache_handle", create)
    router._ensure_prefix_lookup()
    if not separate_loop:
        assert made_on == [threading.get_ident()]
    await asyncio.wait_for(asyncio.shield(router._handle_creation), 5)
    await asyncio.sleep(0)  # the done callback
    assert router._lookup is lookup
    assert (made_on[0] == threading.get_ident()) is (not separate_loop)
