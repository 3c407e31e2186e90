"""KV-event re-hashing (pure translator) and decoding/subscribing with vLLM's real event types and publisher."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from app.lanes.types import BASE_ADAPTER_ID, BASE_ADAPTER_NAME
from app.prefix_cache.adapter_affinity import adapter_root_hash
from app.prefix_cache.index import PrefixIndex, block_hashes
from app.prefix_cache.kv_events import (
    IndexUpdate,
    KVEventSubscriber,
    KVEventTranslator,
    ipc_endpoint,
    kv_events_config,
    make_event_batch_decoder,
    tcp_endpoint,
)

BLOCK = 4


def tokens(n, start=0):
    return list(range(start, start + n))


def stored(hashes, parent, token_ids, block_size=BLOCK, **extra):
    fields = dict(block_hashes=hashes, parent_block_hash=parent, token_ids=token_ids, block_size=block_size,
                  lora_id=None, medium="GPU", lora_name=None, extra_keys=None, group_idx=0)
    fields.update(extra)
    return type("BlockStored", (), fields)()


def removed(hashes, **extra):
    return type("BlockRemoved", (), dict(block_hashes=hashes, medium="GPU", group_idx=0, **extra))()


CLEARED = type("AllBlocksCleared", (), {})()


# --- translator ------------------------------------------------------------------------------------------------
def test_stored_blocks_rehash_into_the_routers_hash_space():
    prompt = tokens(12)
    ours = block_hashes(prompt, BLOCK)
    t = KVEventTranslator(BLOCK)
    # vLLM stores a request's blocks over several steps: first two blocks, then the third chained on block 2.
    t.apply_event(stored([101, 102], None, prompt[:8]))
    t.apply_event(stored([103], 102, prompt[8:12]))
    update = t.drain()
    assert update == IndexUpdate(adds=ours, removes=[], cleared=False)
    assert t.our_hash(103) == ours[2]
    assert t.drain().is_empty()


def test_unknown_parent_records_nothing_for_that_chain():
    t = KVEventTranslator(BLOCK)
    t.apply_event(stored([201], 999, tokens(4)))
    t.apply_event(stored([202], 201, tokens(4, 4)))  # its parent was never recorded either
    assert t.drain().is_empty()
    assert t.stats.skipped_unknown_parent == 2 and len(t) == 0


def test_removed_and_cleared_blocks():
    prompt = tokens(12)
    ours = block_hashes(prompt, BLOCK)
    t = KVEventTranslator(BLOCK)
    t.apply_event(stored([1, 2, 3], None, prompt))
    t.drain()
    t.apply_event(removed([3, 77]))  # 77 was never known: ignored
    assert t.drain() == IndexUpdate(adds=[], removes=[ours[2]])
    # Net effect inside one drain: the last event for a hash wins.
    t.apply_event(stored([3], 2, prompt[8:]))
    t.apply_event(removed([3]))
    t.apply_event(removed([2]))
    t.apply_event(stored([2], 1, prompt[4:8]))
    assert t.drain() == IndexUpdate(adds=[ours[1]], removes=[ours[2]])
    t.apply_event(stored([3], 2, prompt[8:]))
    t.apply_event(CLEARED)
    assert t.drain() == IndexUpdate(adds=[], removes=[], cleared=True)
    assert len(t) == 0
    t.apply_event(stored([9], 2, prompt[8:]))  # the parent is gone with the clear
    assert t.drain().is_empty()


def test_same_content_under_two_vllm_hashes_is_removed_only_when_both_are():
    t = KVEventTranslator(BLOCK)
    t.apply_event(stored([1], None, tokens(4)))
    t.apply_event(stored([2], None, tokens(4)))
    ours = block_hashes(tokens(4), BLOCK)
    assert t.drain().adds == ours
    t.apply_event(removed([1]))
    assert t.drain().is_empty()
    t.apply_event(removed([2]))
    assert t.drain().removes == ours


def test_rereported_block_refreshes_without_double_counting():
    t = KVEventTranslator(BLOCK)
    t.apply_event(stored([1, 2], None, tokens(8)))
    t.apply_event(stored([1, 2], None, tokens(8)))  # prefix-cache hit reported again ("full" report mode)
    assert t.drain().adds == block_hashes(tokens(8), BLOCK)
    t.apply_event(removed([1, 2]))
    assert t.drain().removes == block_hashes(tokens(8), BLOCK)


@pytest.mark.parametrize(
    "event",
    [
        stored([1], None, tokens(8), block_size=8),  # another block size than the index's
        stored([1, 2], None, tokens(4)),  # token ids do not line up with hashes (masked blocks)
        stored([1], None, tokens(4), medium="CPU"),  # offload tier
        stored([1], None, tokens(4), lora_id=3),  # an adapter known only by its id: no name to key its chain by
        stored([1], None, tokens(4), lora_name="sql", lora_id=3, extra_keys=[("sql", "salt")]),  # and a cache salt
        stored([1], None, tokens(4), extra_keys=[("salt",)]),  # cache salt / multimodal
        stored([1], None, tokens(4), group_idx=1),  # another KV cache group
    ],
)
def test_unroutable_blocks_are_skipped(event):
    t = KVEventTranslator(BLOCK)
    t.apply_event(event)
    assert t.drain().is_empty() and t.stats.skipped_unsupported == 1


def adapter_stored(hashes, parent, token_ids, name, adapter_id=3):
    """A BlockStored as vLLM's block pool makes it for a request under an adapter: every block's extra keys are the
    adapter's name."""
    return stored(hashes, parent, token_ids, lora_name=name, lora_id=adapter_id,
                  extra_keys=[(name,)] * len(hashes))


def test_an_adapters_blocks_rehash_as_the_router_hashes_its_prompts():
    prompt = tokens(12)
    t = KVEventTranslator(BLOCK)
    t.apply_event(adapter_stored([101, 102], None, prompt[:8], "sql"))
    t.apply_event(adapter_stored([103], 102, prompt[8:], "sql"))  # a child continues its parent's chain
    ours = block_hashes(prompt, BLOCK, adapter_root_hash("sql"))
    assert t.drain() == IndexUpdate(adds=ours, removes=[], cleared=False)
    assert t.our_hash(103) == ours[2] and t.stats.skipped_unsupported == 0
    index = PrefixIndex(max_entries=1000)
    index.add("r", ours)
    assert index.longest_matches(block_hashes(prompt, BLOCK), BLOCK) == []  # the base model's prompt: no match
    t.apply_event(removed([103]))
    assert t.drain().removes == [ours[2]]


def test_the_identity_adapters_blocks_are_the_base_models():
    prompt = tokens(8)
    t = KVEventTranslator(BLOCK)
    t.apply_event(adapter_stored([1, 2], None, prompt, BASE_ADAPTER_NAME, BASE_ADAPTER_ID))
    assert t.drain().adds == block_hashes(prompt, BLOCK)


def test_two_adapters_and_the_base_model_never_share_a_block():
    prompt = tokens(8)
    t = KVEventTranslator(BLOCK)
    # vLLM's own hashes differ too (the adapter is in its block key), so each store is its own mapping.
    t.apply_event(adapter_stored([1, 2], None, prompt, "sql", 3))
    t.apply_event(adapter_stored([11, 12], None, prompt, "chat", 4))
    t.apply_event(stored([21, 22], None, prompt))
    adds = t.drain().adds
    assert len(adds) == len(set(adds)) == 6
    assert adds == (block_hashes(prompt, BLOCK, adapter_root_hash("sql"))
                    + block_hashes(prompt, BLOCK, adapter_root_hash("chat")) + block_hashes(prompt, BLOCK))


def test_extra_keys_of_none_per_block_are_plain_blocks():
    t = KVEventTranslator(BLOCK)
    t.apply_event(stored([1, 2], None, tokens(8), extra_keys=[None, None]))
    assert len(t.drain().adds) == 2


def test_mapping_is_bounded_and_forgetting_is_reported():
    t = KVEventTranslator(BLOCK, max_tracked_blocks=2)
    t.apply_event(stored([1, 2, 3], None, tokens(12)))
    ours = block_hashes(tokens(12), BLOCK)
    update = t.drain()
    assert len(t) == 2 and t.stats.evicted_mappings == 1
    assert update.adds == ours[1:] and update.removes == [ours[0]]


def test_snapshot_is_a_full_resync_and_feeds_the_index():
    t = KVEventTranslator(BLOCK)
    t.apply_event(stored([1, 2, 3], None, tokens(12)))
    t.apply_event(removed([3]))
    snap = t.snapshot()
    assert snap.cleared and snap.adds == block_hashes(tokens(12), BLOCK)[:2] and not snap.removes
    assert t.drain().is_empty()
    index = PrefixIndex(max_entries=1000)
    index.add("r", [123])  # stale entry the resync must drop
    if snap.cleared:
        index.remove_replica("r")
    index.remove("r", snap.removes)
    index.add("r", snap.adds)
    assert index.longest_matches(block_hashes(tokens(16), BLOCK), BLOCK)[0].matched_tokens == 8
    assert index.longest_matches([123], BLOCK) == []


# --- vLLM's real types, encoder and publisher ------------------------------------------------------------------
def vllm_batch(events, ts=1.0):
    from vllm.distributed.kv_events import KVEventBatch

    return KVEventBatch(ts=ts, events=events)


def vllm_events(prompt, hash_type=int):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    h = (lambda i: i) if hash_type is int else (lambda i: i.to_bytes(32, "big"))
    return [
        BlockStored(block_hashes=[h(11), h(12)], parent_block_hash=None, token_ids=prompt[:8], block_size=BLOCK,
                    lora_id=None, medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockStored(block_hashes=[h(13)], parent_block_hash=h(12), token_ids=prompt[8:12], block_size=BLOCK,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[h(13)], medium="GPU"),
        AllBlocksCleared(),
        BlockStored(block_hashes=[h(21)], parent_block_hash=None, token_ids=prompt[:4], block_size=BLOCK,
                    lora_id=None, medium="GPU", lora_name=None),
    ]


@pytest.mark.parametrize("hash_type", [int, bytes])
def test_decodes_the_publishers_msgpack_with_vllms_types(hash_type):
    import msgspec

    prompt = tokens(12)
    payload = msgspec.msgpack.Encoder().encode(vllm_batch(vllm_events(prompt, hash_type)))  # as ZmqEventPublisher
    batch = make_event_batch_decoder()(payload)
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockStored"
    ]
    t = KVEventTranslator(BLOCK)
    t.apply_events(batch.events[:3])
    ours = block_hashes(prompt, BLOCK)
    # Block 3 was stored and removed within one drain: net, a (harmless) remove.
    assert t.drain() == IndexUpdate(adds=ours[:2], removes=[ours[2]])
    t.apply_events(batch.events[3:])
    assert t.drain() == IndexUpdate(adds=block_hashes(prompt, BLOCK)[:1], removes=[], cleared=True)


def test_decodes_an_adapters_blocks_as_vllms_block_pool_publishes_them():
    import msgspec
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys

    prompt = tokens(12)
    # vLLM keys an adapter's blocks by ("lora", name, path) and publishes each block's keys untagged.
    keys = to_event_extra_keys([(("lora", "sql", "/adapters/sql"),)] * 3)
    event = BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=prompt, block_size=BLOCK,
                        lora_id=3, medium="GPU", lora_name="sql", extra_keys=keys, group_idx=0)
    batch = make_event_batch_decoder()(msgspec.msgpack.Encoder().encode(vllm_batch([event])))
    t = KVEventTranslator(BLOCK)
    t.apply_events(batch.events)
    assert t.drain().adds == block_hashes(prompt, BLOCK, adapter_root_hash("sql"))


def test_kv_events_config_is_accepted_by_vllm():
    import pydantic
    from vllm.config.kv_events import KVEventsConfig

    endpoint = ipc_endpoint("/tmp")
    config = pydantic.TypeAdapter(KVEventsConfig).validate_python(kv_events_config(endpoint, topic="lane"))
    assert config.enable_kv_cache_events and config.publisher == "zmq"
    assert config.endpoint == endpoint.publisher and endpoint.publisher.startswith("ipc:///tmp/llm-lanes-kv-")
    tcp = tcp_endpoint()
    assert tcp.subscriber_binds and tcp.publisher.startswith("tcp://127.0.0.1:")


async def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("make_endpoint", [lambda tmp: ipc_endpoint(str(tmp)), lambda tmp: tcp_endpoint()])
async def test_subscriber_feeds_an_index_from_vllms_zmq_publisher(tmp_path, make_endpoint):
    from vllm.distributed.kv_events import ZmqEventPublisher

    endpoint = make_endpoint(tmp_path)
    index = PrefixIndex(max_entries=1000)
    updates = []

    async def report(update: IndexUpdate):
        updates.append(update)
        if update.cleared:
            index.remove_replica("replica-1")
        index.remove("replica-1", update.removes)
        index.add("replica-1", update.adds)

    subscriber = KVEventSubscriber(endpoint, KVEventTranslator(BLOCK), report, topic="lane", flush_interval_s=0.02)
    subscriber.start()
    await subscriber.ready()
    config = kv_events_config(endpoint, topic="lane")
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=config["endpoint"], topic=config["topic"])
    try:
        prompt = tokens(12, 500)
        from vllm.distributed.kv_events import BlockStored

        # PUB/SUB drops messages until the connection is up: publish a first block until it is seen.
        first = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=prompt[:4], block_size=BLOCK,
                            lora_id=None, medium="GPU", lora_name=None)
        while subscriber.stats.batches == 0:
            publisher.publish(vllm_batch([first]))
            await asyncio.sleep(0.05)
        rest = BlockStored(block_hashes=[2, 3], parent_block_hash=1, token_ids=prompt[4:12], block_size=BLOCK,
                           lora_id=None, medium="GPU", lora_name=None)
        publisher.publish(vllm_batch([rest]))
        await wait_for(lambda: [m.matched_tokens for m in index.longest_matches(block_hashes(prompt, BLOCK), BLOCK)]
                       == [12])
        assert subscriber.stats.decode_errors == 0 and subscriber.stats.missed_batches == 0
    finally:
        publisher.shutdown()
        await subscriber.stop()


async def test_failed_report_leads_to_a_full_resync():
    calls = []
    healthy = SimpleNamespace(ok=False)

    async def report(update):
        calls.append(update)
        if not healthy.ok:
            raise ConnectionError("PrefixCache is down")

    translator = KVEventTranslator(BLOCK)
    subscriber = KVEventSubscriber(ipc_endpoint(), translator, report, decoder=lambda payload: payload)
    subscriber.handle_message([b"t", (0).to_bytes(8, "big"), SimpleNamespace(events=[stored([1, 2], None, tokens(8))])])
    await subscriber.flush()
    assert subscriber.stats.report_errors == 1
    subscriber.handle_message([b"t", (2).to_bytes(8, "big"), SimpleNamespace(events=[removed([2])])])
    assert subscriber.stats.missed_batches == 1  # seq 1 never arrived
    healthy.ok = True
    await subscriber.flush()
    assert calls[-1] == IndexUpdate(adds=block_hashes(tokens(8), BLOCK)[:1], removes=[], cleared=True)
    assert subscriber.stats.resyncs == 1
    await subscriber.flush()  # nothing new: no call
    assert len(calls) == 2
    subscriber.request_resync()
    await subscriber.flush()
    assert calls[-1].cleared and len(calls) == 3
    subscriber.handle_message([b"t", b"x"])  # malformed multipart
    assert subscriber.stats.decode_errors == 1


async def test_a_resync_asked_for_while_a_report_is_on_its_way_is_sent_next():
    """A restarted PrefixCache answers the first drain that reaches it with its new epoch, and the feed asks for a
    resync inside that very report: the next flush must send everything the engine holds, not the next drain."""
    calls = []
    subscriber = None

    async def report(update):
        calls.append(update)
        if len(calls) == 2:
            subscriber.request_resync()  # what ReplicaPrefixFeed._note_epoch does on a new epoch

    translator = KVEventTranslator(BLOCK)
    subscriber = KVEventSubscriber(ipc_endpoint(), translator, report, decoder=lambda payload: payload)
    subscriber.handle_message([b"t", (0).to_bytes(8, "big"), SimpleNamespace(events=[stored([1, 2], None, tokens(8))])])
    await subscriber.flush()  # reaches the first PrefixCache
    # It restarts empty; the next events' drain is the first report the new one gets.
    subscriber.handle_message([b"t", (1).to_bytes(8, "big"), SimpleNamespace(events=[stored([3], 2, tokens(12)[8:])])])
    await subscriber.flush()
    assert not calls[1].cleared
    await subscriber.flush()  # nothing new happened in the engine, but the new index lacks blocks 1 and 2
    assert len(calls) == 3 and calls[2].cleared
    assert set(calls[2].adds) == set(calls[0].adds) | set(calls[1].adds)
    assert subscriber.stats.resyncs == 1
