"""Exact prefix-index feed from an engine replica's own vLLM KV-cache events.

vLLM (0.32; also 0.26) publishes KV-cache events when `kv_events_config` enables them: a ZeroMQ PUB socket sends
multipart messages `(topic, seq as 8-byte big-endian, payload)`, the payload a msgpack-encoded `KVEventBatch` whose
events are `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, ...)`, `BlockRemoved(block_hashes)`
and `AllBlocksCleared()`. The block hashes there are vLLM's own; the index uses llm-lanes' hash space (index.py) so a
vLLM upgrade cannot break routing. This module:

- `KVEventTranslator` (pure): keeps vLLM block hash -> our chained hash, re-hashing each stored block's token ids
  chained from its parent's our-hash, and accumulates net adds/removes in our hash space (`IndexUpdate`). A chain's
  first block (no parent) chains from the root of the LoRA adapter it was computed under (`chain_root`), as the
  request router hashes that adapter's prompts, so an adapter's blocks are indexed and match only its own requests.
- `KVEventSubscriber`: a zmq.asyncio SUB socket that decodes vLLM's batches with vLLM's own msgspec types and feeds
  the translator, handing batched updates to a callback (the replica reports them to the PrefixCache deployment).
- `ipc_endpoint` / `tcp_endpoint` / `kv_events_config`: the endpoint pair and the engine-args dict.

vLLM is imported lazily (only the subscriber's decoder needs it): the translator runs without it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import tempfile
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.lanes.types import BASE_ADAPTER_NAME
from app.prefix_cache.adapter_affinity import adapter_root_hash
from app.prefix_cache.index import ROOT_HASH, BlockHash, hash_block

logger = logging.getLogger(__name__)

# vLLM names the storage tier of an event; only blocks in the engine's own (GPU, also on vLLM-CPU) cache can serve
# a prefix hit without a transfer. Offload tiers ("CPU", "STORAGE") are not what the router routes on.
ROUTABLE_MEDIA = (None, "GPU")
KV_EVENTS_TOPIC = "kv-events"
# Enough for the KV cache of any single engine we run (an 80 GB GPU at block 32 holds well under 1M blocks); a bound
# only matters if BlockRemoved events are lost.
MAX_TRACKED_BLOCKS = 1_000_000

VllmBlockHash = Hashable  # vLLM's ExternalBlockHash: int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, default) or bytes


@dataclass
class IndexUpdate:
    """Net change to one replica's entries in the index. Apply in this order: if `cleared`, forget everything the
    replica held; then remove `removes`; then add `adds` (the two lists never share a hash)."""

    adds: list[BlockHash] = field(default_factory=list)
    removes: list[BlockHash] = field(default_factory=list)
    cleared: bool = False

    def is_empty(self) -> bool:
        return not (self.adds or self.removes or self.cleared)


@dataclass
class TranslatorStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    skipped_unknown_parent: int = 0  # BlockStored whose parent chain we never saw
    # Other block size, offload tier, multimodal / salted blocks, an adapter known only by its id, malformed.
    skipped_unsupported: int = 0
    evicted_mappings: int = 0  # vLLM hashes forgotten to stay within max_tracked_blocks
    unknown_events: int = 0


class KVEventTranslator:
    """vLLM KV events -> net index updates in llm-lanes' hash space, for one engine (one replica)."""

    def __init__(self, block_size: int, max_tracked_blocks: int = MAX_TRACKED_BLOCKS):
        if block_size < 1 or max_tracked_blocks < 1:
            raise ValueError("block_size and max_tracked_blocks must be >= 1")
        self.block_size = block_size
        self.max_tracked_blocks = max_tracked_blocks
        # vLLM hash -> our hash, least recently stored first.
        self._ours: OrderedDict[VllmBlockHash, BlockHash] = OrderedDict()
        # Our hash -> how many vLLM hashes map to it (identical content stored under different vLLM keys).
        self._refs: dict[BlockHash, int] = {}
        # Pending net changes since the last drain(): dicts keep insertion (root-first) order.
        self._adds: dict[BlockHash, None] = {}
        self._removes: dict[BlockHash, None] = {}
        self._cleared = False
        self.stats = TranslatorStats()

    def __len__(self) -> int:
        return len(self._ours)

    @property
    def pending_blocks(self) -> int:
        return len(self._adds) + len(self._removes)

    def our_hash(self, vllm_hash: VllmBlockHash) -> BlockHash | None:
        return self._ours.get(vllm_hash)

    # --- events ------------------------------------------------------------------------------------------------
    def block_stored(
        self,
        block_hashes: Sequence[VllmBlockHash],
        parent_block_hash: VllmBlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
        root: BlockHash = ROOT_HASH,
    ) -> None:
        """`root`: where the chain starts if the block has no parent (`chain_root` of the block's adapter); a block
        with a parent continues its parent's chain, which started from its own root."""
        if block_size != self.block_size or len(token_ids) != len(block_hashes) * block_size:
            # Hybrid-model partial blocks or masked (skipped) blocks: token ids no longer line up with hashes.
            self.stats.skipped_unsupported += 1
            return
        if parent_block_hash is None:
            parent = root
        else:
            known_parent = self._ours.get(parent_block_hash)
            if known_parent is None:
                # The chain above this block is unknown (events lost, or the parent was skipped): hashing from the
                # root would claim a different prefix, so record nothing for this chain.
                self.stats.skipped_unknown_parent += 1
                return
            parent = known_parent
        for i, vllm_hash in enumerate(block_hashes):
            ours = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
            previous = self._ours.get(vllm_hash)
            if previous is None:
                self._ours[vllm_hash] = ours
                self._refs[ours] = self._refs.get(ours, 0) + 1
            else:
                # Re-reported block (e.g. a prefix-cache hit in "full" report mode): refresh, same content.
                self._ours.move_to_end(vllm_hash)
                ours = previous
            self._pending_add(ours)
            self.stats.stored_blocks += 1
            parent = ours
        while len(self._ours) > self.max_tracked_blocks:
            # Forget the oldest mapping and say so: the index must not keep what we can no longer remove.
            _, ours = self._ours.popitem(last=False)
            self.stats.evicted_mappings += 1
            self._release(ours)

    def block_removed(self, block_hashes: Iterable[VllmBlockHash]) -> None:
        for vllm_hash in block_hashes:
            ours = self._ours.pop(vllm_hash, None)
            if ours is None:
                continue
            self.stats.removed_blocks += 1
            self._release(ours)

    def all_blocks_cleared(self) -> None:
        self._ours.clear()
        self._refs.clear()
        self._adds.clear()
        self._removes.clear()
        self._cleared = True
        self.stats.clears += 1

    def apply_event(self, event: Any) -> None:
        """One vLLM event object (BlockStored / BlockRemoved / AllBlocksCleared), matched by class name."""
        kind = type(event).__name__
        if kind == "BlockStored":
            if not _routable_store(event):
                self.stats.skipped_unsupported += 1
                return
            self.block_stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                              root=chain_root(getattr(event, "lora_name", None)))
        elif kind == "BlockRemoved":
            if getattr(event, "medium", None) not in ROUTABLE_MEDIA or getattr(event, "group_idx", None) not in (
                None,
                0,
            ):
                self.stats.skipped_unsupported += 1
                return
            self.block_removed(event.block_hashes)
        elif kind == "AllBlocksCleared":
            self.all_blocks_cleared()
        else:
            self.stats.unknown_events += 1

    def apply_events(self, events: Iterable[Any]) -> None:
        for event in events:
            self.apply_event(event)

    # --- output ------------------------------------------------------------------------------------------------
    def drain(self) -> IndexUpdate:
        """The net change since the last drain (and reset it)."""
        update = IndexUpdate(list(self._adds), list(self._removes), self._cleared)
        self._adds.clear()
        self._removes.clear()
        self._cleared = False
        return update

    def snapshot(self) -> IndexUpdate:
        """Everything this engine holds now, as a full resync (`cleared` + adds); drops pending changes."""
        self._adds.clear()
        self._removes.clear()
        self._cleared = False
        return IndexUpdate(adds=list(dict.fromkeys(self._ours.values())), removes=[], cleared=True)

    def _pending_add(self, ours: BlockHash) -> None:
        self._removes.pop(ours, None)
        self._adds[ours] = None

    def _release(self, ours: BlockHash) -> None:
        refs = self._refs.get(ours, 0) - 1
        if refs > 0:
            self._refs[ours] = refs
            return
        self._refs.pop(ours, None)
        self._adds.pop(ours, None)
        self._removes[ours] = None


def chain_root(lora_name: str | None) -> BlockHash:
    """Where the chain of a block stored under `lora_name` (None: no adapter) starts: the adapter's own root, as the
    request router hashes its prompts (adapter_affinity.adapter_root_hash). The identity adapter's blocks are the base
    model's (a CPU host's engine runs the base model's requests under it), so they chain from ROOT_HASH."""
    if lora_name == BASE_ADAPTER_NAME:
        return ROOT_HASH
    return adapter_root_hash(lora_name)


def _routable_store(event: Any) -> bool:
    """Blocks whose reuse depends on more than token ids and adapter (multimodal inputs, cache salt, prompt
    embeddings), that live in an offload tier or another KV-cache group, or whose adapter has no name to key its chain
    by (a lora_id alone) are not routable."""
    if getattr(event, "medium", None) not in ROUTABLE_MEDIA:
        return False
    if getattr(event, "group_idx", None) not in (None, 0):
        return False
    lora_name = getattr(event, "lora_name", None)
    if lora_name is None and getattr(event, "lora_id", None) is not None:
        return False
    if getattr(event, "locality", None) not in (None, "LOCAL"):
        return False
    extra_keys = getattr(event, "extra_keys", None)
    return not (extra_keys and any(_keys_besides_adapter(keys, lora_name) for keys in extra_keys))


def _keys_besides_adapter(block_keys: Sequence[Any] | None, lora_name: str | None) -> Sequence[Any]:
    """One block's extra keys (vLLM's, untagged) less its adapter's name, which vLLM lists first for every block
    computed under an adapter: the chain's root already stands for the adapter."""
    if not block_keys:
        return ()
    if lora_name is not None and block_keys[0] == lora_name:
        return block_keys[1:]
    return block_keys


# --- engine configuration ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVEventsEndpoint:
    publisher: str  # what the engine's `kv_events_config.endpoint` is
    subscriber: str  # what our SUB socket uses
    subscriber_binds: bool  # True: SUB binds and the engine's PUB connects (tcp); False: PUB binds (ipc)


def ipc_endpoint(directory: str | None = None) -> KVEventsEndpoint:
    """A fresh unix-socket endpoint (same host only; vLLM's publisher binds ipc:// endpoints)."""
    path = os.path.join(directory or tempfile.gettempdir(), f"llm-lanes-kv-{uuid.uuid4().hex[:12]}.sock")
    address = f"ipc://{path}"
    return KVEventsEndpoint(publisher=address, subscriber=address, subscriber_binds=False)


def tcp_endpoint(host: str = "127.0.0.1", port: int | None = None) -> KVEventsEndpoint:
    """A loopback TCP endpoint. vLLM's publisher connects to a `tcp://host:port` address (it binds only wildcard
    addresses, which would listen on every interface), so our SUB socket binds `host:port` and the engine connects."""
    if port is None:
        port = free_tcp_port(host)
    address = f"tcp://{host}:{port}"
    return KVEventsEndpoint(publisher=address, subscriber=address, subscriber_binds=True)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def kv_events_config(endpoint: KVEventsEndpoint, topic: str = KV_EVENTS_TOPIC) -> dict[str, Any]:
    """The `kv_events_config` engine argument (vLLM's VllmConfig turns the dict into its KVEventsConfig). Needs
    `enable_prefix_caching=True` (no prefix cache, no events)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint.publisher, "topic": topic}


# --- decoding and subscribing ------------------------------------------------------------------------------------
def make_event_batch_decoder() -> Callable[[bytes], Any]:
    """vLLM's own decoder for the publisher's payload: bytes -> vllm KVEventBatch (raises on a malformed payload)."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Decoder(type=KVEventBatch).decode


UpdateCallback = Callable[[IndexUpdate], Awaitable[None]]


@dataclass
class SubscriberStats:
    batches: int = 0
    missed_batches: int = 0  # sequence gaps (PUB dropped at its high-water mark, or we joined late)
    decode_errors: int = 0
    reports: int = 0
    report_errors: int = 0
    resyncs: int = 0
    last_seq: int | None = None


class KVEventSubscriber:
    """Consumes one engine's KV events and reports batched index updates through `on_update`.

    Updates are flushed every `flush_interval_s` or once `max_pending_blocks` block changes are pending, so the
    PrefixCache deployment sees a few calls a second, not one per engine step. If a report fails (PrefixCache slow or
    down), its changes are not retried piecemeal: the next report is a full snapshot of what the engine holds
    (`IndexUpdate.cleared=True`), which also repairs a PrefixCache that restarted empty (call `request_resync()`).
    A sequence gap is counted but does not clear the state: a lost BlockStored is re-reported when the block is
    stored again, and a lost BlockRemoved costs at most a mis-routed request before the block is re-stored.
    """

    def __init__(
        self,
        endpoint: KVEventsEndpoint,
        translator: KVEventTranslator,
        on_update: UpdateCallback,
        *,
        topic: str = KV_EVENTS_TOPIC,
        flush_interval_s: float = 0.05,
        max_pending_blocks: int = 4096,
        decoder: Callable[[bytes], Any] | None = None,
    ):
        self.endpoint = endpoint
        self.translator = translator
        self.on_update = on_update
        self.topic = topic
        self.flush_interval_s = flush_interval_s
        self.max_pending_blocks = max_pending_blocks
        self._decoder = decoder
        self._needs_resync = False
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self.stats = SubscriberStats()

    def request_resync(self) -> None:
        self._needs_resync = True

    def start(self) -> asyncio.Task:
        """Run in the current event loop; `await subscriber.ready()` before starting the engine."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="kv-event-subscriber")
        return self._task

    async def ready(self) -> None:
        await self._ready.wait()

    def cancel(self) -> None:
        """Stop without waiting (for synchronous teardown)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def handle_message(self, frames: Sequence[bytes]) -> None:
        """One multipart message `(topic, seq, payload)` from vLLM's publisher."""
        if len(frames) != 3:
            self.stats.decode_errors += 1
            return
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if self.stats.last_seq is not None and seq > self.stats.last_seq + 1:
            self.stats.missed_batches += seq - self.stats.last_seq - 1
        self.stats.last_seq = seq
        if self._decoder is None:
            self._decoder = make_event_batch_decoder()
        try:
            batch = self._decoder(payload)
        except Exception:
            self.stats.decode_errors += 1
            logger.warning("undecodable KV event batch seq=%d (%d bytes)", seq, len(payload))
            return
        self.stats.batches += 1
        self.translator.apply_events(batch.events)

    async def flush(self) -> None:
        # The flag is taken before the report is sent, not cleared after it: a resync asked for while the report is
        # on its way (its answer names a restarted, empty PrefixCache; the stats heartbeat noticed one) is for the
        # next flush. Cleared after the send, that request was lost whenever the first report to reach a restarted
        # PrefixCache was a plain drain, and the new index never got what the engine held before.
        resync, self._needs_resync = self._needs_resync, False
        update = self.translator.snapshot() if resync else self.translator.drain()
        if update.is_empty():
            return
        try:
            await self.on_update(update)
            self.stats.reports += 1
            if resync:
                self.stats.resyncs += 1
        except Exception as error:  # PrefixCache slow/down must not stop the feed; resync when it is back
            self.stats.report_errors += 1
            self._needs_resync = True
            logger.warning("reporting KV events to the prefix cache failed (%s); will resync", error)

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context.instance()
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if self.endpoint.subscriber_binds:
                sock.bind(self.endpoint.subscriber)
            else:
                sock.connect(self.endpoint.subscriber)
            self._ready.set()
            last_flush = time.monotonic()
            while True:
                timeout_ms = max(0, int((last_flush + self.flush_interval_s - time.monotonic()) * 1000))
                if await sock.poll(timeout=timeout_ms):
                    self.handle_message(await sock.recv_multipart())
                    # Drain what is already queued without waiting, then decide whether to flush.
                    while await sock.poll(timeout=0):
                        self.handle_message(await sock.recv_multipart())
                        if self.translator.pending_blocks >= self.max_pending_blocks:
                            break
                now = time.monotonic()
                flush_due = now - last_flush >= self.flush_interval_s
                if flush_due or self.translator.pending_blocks >= self.max_pending_blocks:
                    await self.flush()
                    last_flush = time.monotonic()
        finally:
            sock.close(linger=0)
