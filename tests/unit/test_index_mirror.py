"""The Routers' local copy of the prefix index (app.prefix_cache.mirror) and its sync, without Ray."""

from __future__ import annotations

import asyncio

import pytest

from app.config import load_app_config
from app.prefix_cache.index import PrefixIndex, block_hashes
from app.prefix_cache.mirror import IndexChangeLog, IndexMirror
from app.prefix_cache.request_router import mirror_lookup, sync_mirror_forever
from app.prefix_cache.shared_state import SharedPrefixState
from tests.unit.test_config import cpu_args, error_of
from tests.fakes import FakeClock
from tests.unit.test_popularity import BLOCK


def prompt(seed: int, length: int = 1100) -> list[int]:
    return [(seed * 7919 + i) % 5000 + 3 for i in range(length)]


def matches(index_or_mirror, hashes) -> list[tuple[str, int]]:
    found = index_or_mirror.lookup(hashes, BLOCK) if isinstance(index_or_mirror, IndexMirror) else \
        index_or_mirror.longest_matches(hashes, BLOCK)
    return [(m.replica_id, m.matched_tokens) for m in found]


def sync(mirror: IndexMirror, state: SharedPrefixState) -> dict:
    changes = state.changes_since(*mirror.cursor())
    mirror.apply(changes)
    return changes


def test_a_new_mirror_gets_a_snapshot_then_only_the_ops_it_lacks():
    clock = FakeClock()
    state = SharedPrefixState(load_app_config(cpu_args()), clock=clock)
    a, b = block_hashes(prompt(1), BLOCK), block_hashes(prompt(2), BLOCK)
    state.apply_update("r1", "hot", a, [], False)
    mirror = IndexMirror(max_entries=1000, max_staleness_s=2.0, clock=clock)
    assert "snapshot" in sync(mirror, state)
    assert matches(mirror, a) == matches(state.index, a) == [("r1", len(a) * BLOCK)]

    state.apply_update("r2", "cold", b, [], False)
    state.apply_update("r1", "hot", [], a[-5:], False)
    changes = sync(mirror, state)
    assert [op[0] for op in changes["ops"]] == ["add", "remove"]
    assert matches(mirror, a) == [("r1", (len(a) - 5) * BLOCK)]
    assert matches(mirror, b) == [("r2", len(b) * BLOCK)]
    # Nothing new: an empty answer, and the mirror counts as synced again.
    assert sync(mirror, state)["ops"] == []

    # A resync of r1 (cleared) and a replica that went silent: both reach the mirror.
    state.apply_update("r1", "hot", b[:3], [], True)
    sync(mirror, state)
    assert matches(mirror, a) == []
    assert sorted(matches(mirror, b)) == sorted(matches(state.index, b))
    state.report_replica_stats("r1", "hot", {})
    clock.now += 60
    state.report_replica_stats("r2", "cold", {})
    assert state.forget_stale_replicas() == ["r1"]  # silent for 60 s: gone
    sync(mirror, state)
    assert matches(mirror, b) == matches(state.index, b) == [("r2", len(b) * BLOCK)]


def test_evictions_in_the_prefix_cache_reach_the_mirror():
    state = SharedPrefixState(load_app_config(cpu_args(**{"prefix_cache.max_entries": 40})))
    mirror = IndexMirror(max_entries=40, max_staleness_s=2.0)
    sync(mirror, state)
    first, second = block_hashes(prompt(3), BLOCK), block_hashes(prompt(4), BLOCK)  # 34 blocks each
    state.apply_update("r1", "hot", first, [], False)
    state.apply_update("r1", "hot", second, [], False)  # evicts 28 of first's blocks, deepest first
    changes = sync(mirror, state)
    assert "drop" in [op[0] for op in changes["ops"]]
    assert len(mirror.index) == len(state.index) == 40
    assert matches(mirror, first) == matches(state.index, first)


def test_a_mirror_too_far_behind_or_from_another_instance_gets_a_snapshot():
    state = SharedPrefixState(load_app_config(cpu_args()))
    state.changes = IndexChangeLog(state.epoch, max_ops=3)
    mirror = IndexMirror(max_entries=1000, max_staleness_s=2.0)
    sync(mirror, state)
    for seed in range(5):  # five ops: more than the log keeps
        state.apply_update("r1", "hot", block_hashes(prompt(seed), BLOCK), [], False)
    assert "snapshot" in sync(mirror, state)
    assert all(matches(mirror, block_hashes(prompt(s), BLOCK)) for s in range(5))
    restarted = SharedPrefixState(load_app_config(cpu_args()))  # a new PrefixCache: new epoch, empty
    assert "snapshot" in sync(mirror, restarted)
    assert len(mirror.index) == 0 and mirror.epoch == restarted.epoch


def test_a_stale_mirror_answers_nothing_so_routing_goes_load_only():
    clock = FakeClock()
    state = SharedPrefixState(load_app_config(cpu_args()), clock=clock)
    hashes = block_hashes(prompt(5), BLOCK)
    state.apply_update("r1", "hot", hashes, [], False)
    mirror = IndexMirror(max_entries=1000, max_staleness_s=2.0, clock=clock)
    outcomes: dict[str, int] = {}
    assert mirror_lookup(None, hashes, BLOCK, outcomes) is None  # no handle yet
    assert mirror_lookup(mirror, hashes, BLOCK, outcomes) is None  # never synced
    sync(mirror, state)
    assert mirror_lookup(mirror, hashes, BLOCK, outcomes) == {"r1": len(hashes) * BLOCK}
    clock.now += 2.5
    assert mirror_lookup(mirror, hashes, BLOCK, outcomes) is None
    assert outcomes == {"unavailable": 1, "stale": 2, "ok": 1}
    assert mirror.stats()["fresh"] is False


def test_ops_from_another_epoch_are_refused():
    mirror = IndexMirror(max_entries=10, max_staleness_s=2.0)
    mirror.apply({"epoch": "e1", "seq": 0, "snapshot": []})
    with pytest.raises(ValueError, match="snapshot"):
        mirror.apply({"epoch": "e2", "seq": 4, "ops": [("add", "r1", [1])]})
    # The sync loop's answer to that: the next pull asks for a snapshot.
    mirror.resync()
    assert mirror.cursor() == (None, 0)


async def test_the_sync_loop_survives_a_dead_prefix_cache_and_follows_a_restart():
    state = SharedPrefixState(load_app_config(cpu_args()))
    hashes = block_hashes(prompt(6), BLOCK)
    state.apply_update("r1", "hot", hashes, [], False)
    current = {"state": state, "down": False}

    async def pull(epoch, seq):
        if current["down"]:
            raise RuntimeError("PrefixCache is gone")
        return current["state"].changes_since(epoch, seq)

    mirror = IndexMirror(max_entries=1000, max_staleness_s=2.0)
    task = asyncio.ensure_future(sync_mirror_forever(mirror, pull, 0.01))
    try:
        await asyncio.sleep(0.05)
        assert mirror.lookup(hashes, BLOCK)[0].replica_id == "r1"
        current["down"] = True
        await asyncio.sleep(0.05)
        assert mirror.sync_errors > 0
        restarted = SharedPrefixState(load_app_config(cpu_args()))
        restarted.apply_update("r2", "hot", hashes, [], True)
        current.update(state=restarted, down=False)
        await asyncio.sleep(0.05)
        assert [m.replica_id for m in mirror.lookup(hashes, BLOCK)] == ["r2"]
    finally:
        task.cancel()


def test_snapshot_keeps_the_least_recently_used_order():
    source = PrefixIndex(max_entries=100)
    source.add("r1", [1, 2, 3])
    source.add("r2", [4])
    copy = PrefixIndex(max_entries=100)
    copy.load_snapshot(source.snapshot())
    assert copy.snapshot() == source.snapshot() == [(3, ["r1"]), (2, ["r1"]), (1, ["r1"]), (4, ["r2"])]


def test_mirror_settings_are_validated():
    message = error_of(cpu_args(**{"prefix_cache.mirror_max_staleness_s": 0.1}))
    assert "mirror_max_staleness_s" in message and "mirror_sync_interval_s" in message
    assert "lookup" in error_of(cpu_args(**{"prefix_cache.lookup": "psychic"}))
