"""Adapter affinity: which lane replicas a request for a LoRA adapter is routed among. Pure, no Ray, no I/O.

A lane replica's engine holds a bounded set of adapters (`engine.lora.max_cpu_loras` in host memory, each read from
disk once, the least recently used evicted). A request for an adapter its replica does not hold waits for that load
(and evicts another adapter) before its prefill. So the candidates are narrowed before the prefix-affinity decision
(policy.decide), by these rules:

1. A request for the base model is not narrowed ("base_model").
2. A request for an adapter goes to the candidates whose engines hold it ("adapter_loaded"), unless
3. the adapter is in heavy use: every one of those runs at least `spread_at` of its requests. Then the candidates that
   do not hold it join them ("adapter_spread"), so an adapter in heavy use spreads over more replicas, and the
   load-based choice among them picks where it spreads; or
4. its holders are busy: each one's queue is at least `max_queue_imbalance` requests longer than the shortest queue
   among the candidates that do not hold it (the bound prefix affinity yields at, policy.py). Then every candidate
   joins ("adapter_spread_busy"): a replica that holds several popular adapters otherwise takes most of their
   requests while another idles, and waiting in its queue costs more than reading the adapter from disk.
5. No candidate holds it: the candidates with the fewest adapters loaded, whose engines evict least to load it
   ("adapter_not_loaded").

Each replica reports what it holds in its routing stats (app.lanes.replica_stats.ADAPTERS_STAT: adapter name -> its
requests running there, for every adapter the engine holds; app/lanes/replica.py). The stats are a second or so old:
a replica that has just loaded an adapter is a holder a moment later, so the first few requests for a new adapter may
load it on two replicas, never on every one.

Prefix affinity works within an adapter: KV blocks computed under one adapter are never another's (vLLM keys its
cached blocks by the adapter too), so the prefix hashes of an adapter's prompts start from the adapter's own root
(`adapter_root_hash`) and never match the base model's or another adapter's. The KV-event feed chains the blocks an
engine stores under an adapter from the same root (kv_events.chain_root), so an adapter's request finds the replicas
holding its prefix among the candidates narrowed here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from app.prefix_cache.index import ROOT_HASH, BlockHash


class AdapterReason(str, Enum):
    BASE_MODEL = "base_model"
    LOADED = "adapter_loaded"
    SPREAD = "adapter_spread"
    SPREAD_BUSY = "adapter_spread_busy"
    NOT_LOADED = "adapter_not_loaded"


@dataclass(frozen=True)
class AdapterNarrowing:
    replica_ids: tuple[str, ...]
    reason: AdapterReason


def adapter_root_hash(adapter: str | None) -> BlockHash:
    """Where the chain of an adapter's prompt-block hashes starts (index.block_hashes' `parent`); the base model's is
    ROOT_HASH."""
    if not adapter:
        return ROOT_HASH
    return int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=8, person=b"llm-lanes-lora").digest(),
                          "little") or 1


def narrow_for_adapter(adapter: str | None, candidates: Sequence[str],
                       held: Mapping[str, Mapping[str, int]], spread_at: int,
                       queue_lens: Mapping[str, int] | None = None,
                       max_queue_imbalance: int | None = None) -> AdapterNarrowing:
    """The candidate replica ids (in their given order) a request for `adapter` (None: the base model) is routed
    among, and why. `held`: replica id -> {adapter it holds: its requests running there}; a replica missing from it
    holds none. `spread_at`: requests per holder at which an adapter spreads to more replicas (rule 3).
    `queue_lens` (replica id -> its queue) and `max_queue_imbalance`: rule 4, off when either is None."""
    if spread_at < 1:
        raise ValueError(f"spread_at={spread_at} must be >= 1")
    if not adapter or not candidates:
        return AdapterNarrowing(tuple(candidates), AdapterReason.BASE_MODEL)
    holders = [replica for replica in candidates if adapter in held.get(replica, {})]
    if holders:
        others = [replica for replica in candidates if replica not in holders]
        if others and all(held[r][adapter] >= spread_at for r in holders):
            return AdapterNarrowing(tuple(candidates), AdapterReason.SPREAD)
        if others and queue_lens is not None and max_queue_imbalance is not None:
            shortest_other = min(queue_lens.get(r, 0) for r in others)
            if all(queue_lens.get(r, 0) - shortest_other >= max_queue_imbalance for r in holders):
                return AdapterNarrowing(tuple(candidates), AdapterReason.SPREAD_BUSY)
        return AdapterNarrowing(tuple(holders), AdapterReason.LOADED)
    fewest = min(len(held.get(replica, {})) for replica in candidates)
    return AdapterNarrowing(tuple(r for r in candidates if len(held.get(r, {})) == fewest), AdapterReason.NOT_LOADED)
