"""Prefix-affinity routing decision: pure, no Ray, no I/O.

Given a prompt's length, the candidate replicas with their load, and how many prompt tokens each replica already
holds in KV cache (from the PrefixIndex), pick one replica and say why. The rules are DESIGN.md's prefix-cache rules:

1. Prompts shorter than `min_prefix_tokens` skip affinity ("short_prompt"): a short prefill is cheap, so spreading
   load matters more than reuse.
2. If the prefix lookup failed or timed out ("lookup_failed"), route on load only: a dead or slow PrefixCache must
   never fail or stall a request.
3. The best-matching candidate (most matched tokens; ties go to the lower load score) is chosen ("affinity") when
   its match ratio (matched tokens / prompt tokens) is >= `match_threshold` and its queue is at most
   `max_queue_imbalance` requests longer than the shortest candidate queue. Otherwise route on load
   ("no_match", "below_threshold", "imbalanced").

Load-only routing is power-of-two-choices on `load_score`:

    load_score = queue_len + kv_usage_weight * kv_usage

`queue_len` is the replica's ongoing requests (what Ray Serve tracks); `kv_usage` is the fraction (0..1) of the
replica engine's KV cache in use. With the schema's weight of 8, a full KV cache counts like 8 more queued requests:
a replica near KV exhaustion must preempt or hold new sequences back, so between two equally queued replicas the one
with free KV memory serves the next prompt sooner. `max_queue_imbalance` bounds how many more ongoing requests the
affinity target may have than the least-loaded candidate: beyond it, the time a request waits in that queue costs
more than re-computing the prefix elsewhere.

The values are the settings of `prefix_cache` (app.config.PrefixCacheConfig, the tuning guide's defaults).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from app.config import PrefixCacheConfig


class RoutingReason(str, Enum):
    AFFINITY = "affinity"
    SHORT_PROMPT = "short_prompt"
    BELOW_THRESHOLD = "below_threshold"
    IMBALANCED = "imbalanced"
    NO_MATCH = "no_match"
    LOOKUP_FAILED = "lookup_failed"


@dataclass(frozen=True)
class ReplicaLoad:
    replica_id: str
    queue_len: int
    kv_usage: float = 0.0  # fraction of the replica's KV cache in use, 0..1


@dataclass(frozen=True)
class AffinityPolicy:
    min_prefix_tokens: int
    match_threshold: float
    max_queue_imbalance: int
    kv_usage_weight: float

    @classmethod
    def from_settings(cls, settings: PrefixCacheConfig) -> "AffinityPolicy":
        return cls(settings.min_prefix_tokens, settings.match_threshold, settings.max_queue_imbalance,
                   settings.kv_usage_weight)

    def __post_init__(self) -> None:
        if self.min_prefix_tokens < 1:
            raise ValueError(f"min_prefix_tokens={self.min_prefix_tokens} must be >= 1")
        if not 0 < self.match_threshold <= 1:
            raise ValueError(f"match_threshold={self.match_threshold} is out of range: use a ratio in (0, 1]")
        if self.max_queue_imbalance < 0:
            raise ValueError(f"max_queue_imbalance={self.max_queue_imbalance} must be >= 0")
        if self.kv_usage_weight < 0:
            raise ValueError(f"kv_usage_weight={self.kv_usage_weight} must be >= 0")


@dataclass(frozen=True)
class RoutingDecision:
    replica_id: str
    reason: RoutingReason
    match_ratio: float  # best candidate's matched tokens / prompt tokens; 0.0 when not looked up
    matched_tokens: int = 0  # matched tokens of the chosen replica


def load_score(load: ReplicaLoad, kv_usage_weight: float) -> float:
    kv_usage = min(max(load.kv_usage, 0.0), 1.0)
    return load.queue_len + kv_usage_weight * kv_usage


def power_of_two_choice(
    candidates: Sequence[ReplicaLoad], rng: random.Random, kv_usage_weight: float
) -> ReplicaLoad:
    """The lower-scored of two distinct random candidates (the only one if there is one)."""
    if not candidates:
        raise ValueError("power_of_two_choice needs at least one candidate")
    if len(candidates) == 1:
        return candidates[0]
    first, second = rng.sample(range(len(candidates)), 2)
    a, b = candidates[first], candidates[second]
    # Ties go to the first draw, which is itself random.
    return b if load_score(b, kv_usage_weight) < load_score(a, kv_usage_weight) else a


def decide(
    prompt_tokens: int,
    candidates: Sequence[ReplicaLoad],
    matched_tokens: Mapping[str, int] | None,
    policy: AffinityPolicy,
    rng: random.Random,
) -> RoutingDecision:
    """Choose a replica for a prompt of `prompt_tokens` tokens.

    `matched_tokens` maps replica id -> prompt tokens that replica holds in KV cache (replicas the index knows but
    that are not candidates are ignored); None means the lookup failed or was not made in time.
    """
    if not candidates:
        raise ValueError("decide needs at least one candidate replica")

    def fallback(reason: RoutingReason, match_ratio: float = 0.0) -> RoutingDecision:
        chosen = power_of_two_choice(candidates, rng, policy.kv_usage_weight)
        matched = matched_tokens.get(chosen.replica_id, 0) if matched_tokens else 0
        return RoutingDecision(chosen.replica_id, reason, match_ratio, matched)

    if prompt_tokens < policy.min_prefix_tokens:
        return fallback(RoutingReason.SHORT_PROMPT)
    if matched_tokens is None:
        return fallback(RoutingReason.LOOKUP_FAILED)

    best = max(
        candidates,
        key=lambda c: (matched_tokens.get(c.replica_id, 0), -load_score(c, policy.kv_usage_weight)),
    )
    best_matched = min(matched_tokens.get(best.replica_id, 0), prompt_tokens)
    if best_matched <= 0:
        return fallback(RoutingReason.NO_MATCH)
    match_ratio = best_matched / prompt_tokens
    if match_ratio < policy.match_threshold:
        return fallback(RoutingReason.BELOW_THRESHOLD, match_ratio)
    shortest_queue = min(c.queue_len for c in candidates)
    if best.queue_len - shortest_queue > policy.max_queue_imbalance:
        return fallback(RoutingReason.IMBALANCED, match_ratio)
    return RoutingDecision(best.replica_id, RoutingReason.AFFINITY, match_ratio, best_matched)
