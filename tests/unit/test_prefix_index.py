"""PrefixIndex: insert/lookup/remove, chain correctness, LRU eviction, memory bound, replica removal."""

import threading

import pytest

from app.prefix_cache.index import ROOT_HASH, Match, PrefixIndex, block_hashes, hash_block
from tests.fakes import FakeClock

BLOCK = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_block_hashes_cover_full_blocks_only_and_chain():
    ids = tokens(10)
    hashes = block_hashes(ids, BLOCK)
    assert len(hashes) == 2  # the 2 trailing tokens are not a full block
    assert hashes[0] == hash_block(ROOT_HASH, ids[0:4])
    assert hashes[1] == hash_block(hashes[0], ids[4:8])
    # Same block content under a different parent is a different key.
    assert hash_block(ROOT_HASH, ids[4:8]) != hashes[1]
    assert block_hashes(ids, BLOCK) == hashes  # deterministic


def test_lookup_returns_matched_tokens_per_replica_longest_first():
    index = PrefixIndex(max_entries=1000)
    prompt = block_hashes(tokens(16), BLOCK)  # 4 blocks
    index.add("a", prompt[:2])
    index.add("b", prompt)
    assert index.longest_matches(prompt, BLOCK) == [Match("b", 16), Match("a", 8)]
    assert index.longest_matches(block_hashes(tokens(16, start=100), BLOCK), BLOCK) == []
    assert index.longest_matches([], BLOCK) == []


def test_a_block_only_matches_under_its_own_parent_chain():
    index = PrefixIndex(max_entries=1000)
    shared_tail = tokens(4, start=50)
    first = tokens(4, start=0) + shared_tail
    second = tokens(4, start=10) + shared_tail  # same second block, different first block
    index.add("a", block_hashes(first, BLOCK))
    assert index.longest_matches(block_hashes(second, BLOCK), BLOCK) == []
    assert index.longest_matches(block_hashes(first + tokens(4, 90), BLOCK), BLOCK) == [Match("a", 8)]


def test_match_stops_where_a_replica_misses_a_block():
    index = PrefixIndex(max_entries=1000)
    prompt = block_hashes(tokens(12), BLOCK)
    index.add("a", [prompt[0], prompt[2]])  # middle block evicted on that replica
    index.add("b", prompt)
    assert index.longest_matches(prompt, BLOCK) == [Match("b", 12), Match("a", 4)]


def test_remove_by_block_and_remove_replica():
    index = PrefixIndex(max_entries=1000)
    prompt = block_hashes(tokens(12), BLOCK)
    index.add("a", prompt)
    index.add("b", prompt)
    index.remove("a", prompt[1:])
    assert index.longest_matches(prompt, BLOCK) == [Match("b", 12), Match("a", 4)]
    index.remove_replica("b")
    assert index.longest_matches(prompt, BLOCK) == [Match("a", 4)]
    assert index.replicas() == {"a"}
    assert len(index) == 1  # entries with no replica left are deleted
    index.remove("a", prompt)
    index.remove("nobody", prompt)  # unknown replica / block: no error
    assert len(index) == 0 and index.replicas() == set()


def test_memory_bound_and_lru_eviction():
    index = PrefixIndex(max_entries=6, clock=FakeClock(now=0.0, tick=1.0))
    old = block_hashes(tokens(12, 0), BLOCK)
    hot = block_hashes(tokens(12, 100), BLOCK)
    index.add("a", old)
    index.add("a", hot)
    index.longest_matches(old, BLOCK)  # old becomes recently used
    new = block_hashes(tokens(12, 200), BLOCK)
    index.add("a", new)
    assert len(index) == 6
    assert index.evictions == 3
    assert index.longest_matches(hot, BLOCK) == []  # least recently used chain went
    assert index.longest_matches(old, BLOCK) == [Match("a", 12)]
    assert index.longest_matches(new, BLOCK) == [Match("a", 12)]
    for start in range(300, 3000, 12):
        index.add("b", block_hashes(tokens(12, start), BLOCK))
        assert len(index) <= 6


def test_eviction_takes_the_deepest_blocks_of_a_chain_first():
    index = PrefixIndex(max_entries=4)
    chain = block_hashes(tokens(16), BLOCK)
    index.add("a", chain)
    index.add("a", block_hashes(tokens(4, 500), BLOCK))  # one more block: one must go
    # The leaf went, not the root (which would strand its descendants).
    assert chain[3] not in index._entries and chain[0] in index._entries
    index.add("a", block_hashes(tokens(4, 600), BLOCK))
    assert chain[2] not in index._entries
    assert index.longest_matches(chain, BLOCK) == [Match("a", 8)]  # still a useful partial match


def test_last_used_is_updated_by_add_and_lookup():
    clock = FakeClock(now=0.0, tick=1.0)
    index = PrefixIndex(max_entries=1000, clock=clock)
    chain = block_hashes(tokens(8), BLOCK)
    index.add("a", chain)
    first_seen = index._entries[chain[0]].last_used
    index.longest_matches(chain, BLOCK)
    assert index._entries[chain[0]].last_used > first_seen


def test_rejects_a_useless_bound():
    with pytest.raises(ValueError):
        PrefixIndex(max_entries=0)


def test_concurrent_adds_and_lookups_stay_consistent():
    index = PrefixIndex(max_entries=500)
    chains = [block_hashes(tokens(32, 1000 * i), BLOCK) for i in range(20)]
    errors = []

    def writer(replica: str):
        for chain in chains:
            index.add(replica, chain)
            index.remove(replica, chain[4:])

    def reader():
        try:
            for _ in range(50):
                for chain in chains:
                    for match in index.longest_matches(chain, BLOCK):
                        assert match.matched_tokens % BLOCK == 0
        except Exception as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(f"r{i}",)) for i in range(4)] + [
        threading.Thread(target=reader) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(index) <= 500
    assert index.longest_matches(chains[0], BLOCK)[0].matched_tokens == 16
