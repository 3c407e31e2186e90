"""PrefixPopularity: which long prefixes get pinned for warm-up."""

import pytest

from app.prefix_cache.popularity import PrefixPopularity
from tests.fakes import FakeClock

BLOCK = 32


def system_prompt(group: int, n: int = 1024) -> list[int]:
    return [group * 100_000 + i for i in range(n)]


def question(i: int, n: int = 40) -> list[int]:
    return [900_000 + i * 1000 + j for j in range(n)]


def make(**kwargs) -> PrefixPopularity:
    kwargs.setdefault("clock", FakeClock())
    kwargs.setdefault("max_pinned_prefixes", 4)
    kwargs.setdefault("half_life_s", 600.0)
    return PrefixPopularity(block_size=BLOCK, min_prefix_tokens=1024, **kwargs)


def test_pins_the_shared_part_of_reused_prompts_most_reused_first():
    popularity = make(max_pinned_prefixes=4)
    for i in range(5):
        popularity.record(system_prompt(1) + question(i))
    for i in range(3):
        popularity.record(system_prompt(2, 1088) + question(i))
    popularity.record(system_prompt(3) + question(0))  # used once: not a reused prefix
    assert popularity.pinned() == [system_prompt(1), system_prompt(2, 1088)]


def test_short_prompts_are_ignored():
    popularity = make()
    for _ in range(5):
        popularity.record(system_prompt(1, 1000))
    assert len(popularity) == 0 and popularity.pinned() == []


def test_keeps_at_most_max_pinned_and_prefers_the_longest_equally_reused_prefix():
    popularity = make(max_pinned_prefixes=2)
    for group, uses in ((1, 2), (2, 6), (3, 4)):
        for i in range(uses):
            popularity.record(system_prompt(group, 1100) + question(i))
    pinned = popularity.pinned()
    # Full blocks of the 1100 shared tokens: 34 blocks = 1088 tokens; shorter boundaries are contained in it.
    assert pinned == [system_prompt(2, 1088), system_prompt(3, 1088)]


def test_a_longer_less_used_prefix_can_be_pinned_beside_its_base():
    popularity = make(max_pinned_prefixes=4)
    for i in range(6):
        popularity.record(system_prompt(1) + question(i))
    for i in range(3):
        popularity.record(system_prompt(1) + [5] * 512 + question(i))  # a longer shared prefix for some requests
    pinned = popularity.pinned()
    assert pinned[0] == system_prompt(1)
    assert pinned[1] == system_prompt(1) + [5] * 512
    assert len(pinned) == 2


def test_counts_decay_so_old_favourites_fade():
    clock = FakeClock()
    popularity = make(max_pinned_prefixes=1, half_life_s=60.0, clock=clock)
    for i in range(8):
        popularity.record(system_prompt(1) + question(i))
    clock.now += 600  # ten half-lives: 8 uses weigh 8 / 1024
    for i in range(2):
        popularity.record(system_prompt(2) + question(i))
    assert popularity.pinned() == [system_prompt(2)]
    clock.now += 600
    assert popularity.pinned() == []  # nothing reused recently


def test_memory_is_bounded():
    popularity = make(max_tracked_prefixes=64)
    for i in range(500):
        popularity.record(system_prompt(i, 1024 + 5 * BLOCK))
        assert len(popularity) <= 64 * 1.25 + 6
    for i in range(3):
        popularity.record(system_prompt(7777) + question(i))
    assert popularity.pinned() == [system_prompt(7777)]


def test_precomputed_hashes_give_the_same_result():
    from app.prefix_cache.index import block_hashes

    with_hashes, without = make(), make()
    for i in range(3):
        prompt = system_prompt(1) + question(i)
        with_hashes.record(prompt, block_hashes(prompt, BLOCK))
        without.record(prompt)
    assert with_hashes.pinned() == without.pinned() == [system_prompt(1)]


def test_validation():
    with pytest.raises(ValueError):
        PrefixPopularity(block_size=0, min_prefix_tokens=1024, max_pinned_prefixes=4, half_life_s=600.0)
    with pytest.raises(ValueError):
        PrefixPopularity(block_size=32, min_prefix_tokens=1024, max_pinned_prefixes=10, half_life_s=600.0,
                         max_tracked_prefixes=5)
    assert make(max_pinned_prefixes=0).pinned() == []
