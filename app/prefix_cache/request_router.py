"""Prefix-affinity request router for the lane deployments (a Ray Serve 2.60 `RequestRouter` subclass).

Plug into a lane deployment:

    from ray.serve.config import RequestRouterConfig
    request_router_config=RequestRouterConfig(
        request_router_class="app.prefix_cache.request_router:PrefixAffinityRouter",  # or the class itself
        request_router_kwargs={"settings": cfg.prefix_cache.model_dump(mode="json"),  # app.config.PrefixCacheConfig
                               "block_size": 32, "realtime_reserved_replicas": 0},
        request_routing_stats_period_s=1.0,   # how often Serve calls the replica's record_routing_stats()
    )

Per request (`choose_replicas`): read `prompt_token_ids` from the request's first argument (a LaneRequest object or
dict; keyword arguments are searched too), hash its full blocks (index.block_hashes), look them up in this process's
copy of the index (`lookup_mode="local_mirror"`, mirror.py, synced from the PrefixCache every
`mirror_sync_interval_s`) or, with `lookup_mode="remote"`, ask the PrefixCache deployment
`lookup(hashes, block_size) -> list[(replica_id, matched_tokens)]` under `asyncio.wait_for` with a small budget
(`lookup_timeout_s`),
and apply policy.decide on the candidates' loads: queue length from Serve's queue-length cache (probing replicas
missing from it) and `kv_usage` from the replica's routing stats. A stale copy, a timeout, an error or a PrefixCache
handle not yet ready all mean load-only routing: no request waits on, or fails because of, the prefix cache. Nothing
here blocks the event loop: the PrefixCache handle is created in a worker thread (creating a handle's router from the
router's own event loop would deadlock it), a local lookup is a dictionary walk, and a remote one is awaited.

Replica ids in the index are `ReplicaID.to_full_id_str()`; the engine replica reports under
`serve.get_replica_context().replica_id.to_full_id_str()`. The replica implements
`record_routing_stats(self) -> dict` returning at least `{"kv_usage": <fraction of KV cache in use, 0..1>}`.

Ray Serve cloudpickles this module *by value* (RequestRouterConfig registers it so) and unpickles the class in every
process that routes to the lane. So this module keeps no mutable module-level state: shared, process-wide state
(decision stats, observers) lives in decision_stats.py, which is imported by reference.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from app.config import PrefixCacheConfig
from app.lanes.replica_stats import ADAPTERS_STAT, KV_USAGE_STAT
from app.prefix_cache.adapter_affinity import adapter_root_hash, narrow_for_adapter
from app.prefix_cache.decision_stats import (  # noqa: F401  (re-exported for the lead)
    DecisionStats,
    add_decision_observer,
    decision_stats,
    notify_decision_observers,
    remove_decision_observer,
)
from app.prefix_cache.index import BlockHash, block_hashes
from app.prefix_cache.mirror import IndexMirror, shared_mirror
from app.prefix_cache.policy import (
    AffinityPolicy,
    ReplicaLoad,
    RoutingDecision,
    decide,
)
from app.prefix_cache.realtime_reserve import split_by_reserve
from app.prefix_cache.replica_sets import replica_died, replicas_listed

logger = logging.getLogger(__name__)

PREFIX_CACHE_DEPLOYMENT = "PrefixCache"
LOOKUP_METHOD = "lookup"
CHANGES_METHOD = "changes_since"
PROMPT_TOKEN_IDS_FIELD = "prompt_token_ids"
REQUEST_CLASS_FIELD = "request_class"
ADAPTER_FIELD = "adapter"

PrefixLookup = Callable[[list[BlockHash], int], Awaitable[Sequence[tuple[str, int]]]]


# --- pure helpers ------------------------------------------------------------------------------------------------
def extract_request_field(args: Sequence[Any], kwargs: Mapping[Any, Any], name: str) -> Any:
    """Field `name` of the first argument (object attribute or dict key) that has it, positional first; else None."""
    for value in list(args) + list(kwargs.values()):
        found = value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)
        if found is not None:
            return found
    return None


def extract_prompt_token_ids(args: Sequence[Any], kwargs: Mapping[Any, Any]) -> list[int] | None:
    """`prompt_token_ids` of the first argument (object attribute or dict key) that has it, positional first."""
    token_ids = extract_request_field(args, kwargs, PROMPT_TOKEN_IDS_FIELD)
    return list(token_ids) if token_ids is not None else None


def extract_request_class(args: Sequence[Any], kwargs: Mapping[Any, Any]) -> str | None:
    """The request's class (a LaneRequest's `request_class`: "realtime", "interactive", "batch"), or None."""
    request_class = extract_request_field(args, kwargs, REQUEST_CLASS_FIELD)
    return str(getattr(request_class, "value", request_class)) if request_class is not None else None


def extract_adapter_name(args: Sequence[Any], kwargs: Mapping[Any, Any]) -> str | None:
    """The name of the LoRA adapter the request runs under (a LaneRequest's `adapter`), or None: the base model."""
    adapter = extract_request_field(args, kwargs, ADAPTER_FIELD)
    if adapter is None:
        return None
    return adapter.get("name") if isinstance(adapter, Mapping) else getattr(adapter, "name", None)


def count_outcome(outcomes: dict[str, int] | None, outcome: str) -> None:
    """Tally one lookup outcome (the decision stats' `lookups`), when a tally is given."""
    if outcomes is not None:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1


async def lookup_with_budget(
    lookup: PrefixLookup | None, hashes: list[BlockHash], block_size: int, timeout_s: float,
    outcomes: dict[str, int] | None = None,
) -> dict[str, int] | None:
    """replica id -> matched tokens, or None when there is no lookup yet, it timed out or it failed. Each outcome
    (ok / unavailable / timeout / error) is counted in `outcomes` when given: "lookup_failed" has three causes."""

    if lookup is None:
        count_outcome(outcomes, "unavailable")
        return None
    try:
        matches = await asyncio.wait_for(lookup(hashes, block_size), timeout=timeout_s)
    except asyncio.TimeoutError:
        count_outcome(outcomes, "timeout")
        return None
    except Exception as error:  # a dead PrefixCache is routine here: route on load
        count_outcome(outcomes, "error")
        logger.debug("prefix lookup failed: %r", error)
        return None
    count_outcome(outcomes, "ok")
    return {str(replica_id): int(tokens) for replica_id, tokens in matches}


def mirror_lookup(mirror: IndexMirror | None, hashes: list[BlockHash], block_size: int,
                  outcomes: dict[str, int] | None = None) -> dict[str, int] | None:
    """replica id -> matched tokens from the local copy of the index, or None (no copy yet, or stale: load-only).
    Outcomes: ok / unavailable / stale."""
    if mirror is None:
        count_outcome(outcomes, "unavailable")
        return None
    matches = mirror.lookup(hashes, block_size)
    if matches is None:
        count_outcome(outcomes, "stale")
        return None
    count_outcome(outcomes, "ok")
    return {m.replica_id: m.matched_tokens for m in matches}


async def sync_mirror_forever(mirror: IndexMirror, pull: Callable[[str | None, int], Awaitable[dict[str, Any]]],
                              interval_s: float) -> None:
    """Pull the PrefixCache's changes into `mirror` every `interval_s`. Failures only age the mirror: once it is
    older than its staleness bound, lookups answer nothing and routing is load-only until a pull succeeds."""
    while True:
        try:
            changes = await asyncio.wait_for(pull(*mirror.cursor()), timeout=max(1.0, 10 * interval_s))
            try:
                mirror.apply(changes)
            except ValueError:  # another epoch's ops (a restart between two pulls): start over from a snapshot
                mirror.resync()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # a dead or slow PrefixCache is routine here
            mirror.sync_failed()
            logger.debug("prefix index mirror sync failed: %r", error)
        await asyncio.sleep(interval_s)


def rank_replicas(candidates: Sequence[Any], chosen_id: str, id_of: Callable[[Any], str],
                  fallback: Sequence[Any] = ()) -> list[list[Any]]:
    """Serve's ranks: the chosen replica first; if it rejects (queue full), the rest (Serve takes the shortest);
    then `fallback` (the other side of a realtime reserve), only if all of those reject too."""
    chosen = [c for c in candidates if id_of(c) == chosen_id]
    rest = [c for c in candidates if id_of(c) != chosen_id]
    return [rank for rank in (chosen, rest, list(fallback)) if rank]


# --- the Serve request router ------------------------------------------------------------------------------------
def _handle_routers_run_in_separate_loop() -> bool:
    """Whether this process's deployment handles route on Serve's own router loop (the default) or on the caller's."""
    from ray.serve._private.constants import RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP

    return bool(RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP)


class ReportsReplicaSet:
    """A lane's request router that reports the replicas it can route to (replica_sets.py) as Serve changes them:
    the controller's list of RUNNING replicas, and a replica dropped at once when a call to it found its actor dead."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        replicas_listed(self._deployment_id.name, (r.replica_id.to_full_id_str() for r in replicas))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        replica_died(self._deployment_id.name, replica_id.to_full_id_str())


class LaneRouter(ReportsReplicaSet, PowerOfTwoChoicesRequestRouter):
    """Serve's power-of-two-choices routing, for a lane without prefix affinity (one replica, or
    prefix_cache.routing "pow2"), reporting its replicas."""


class PrefixAffinityRouter(ReportsReplicaSet, RequestRouter):
    def initialize_state(
        self,
        settings: Mapping[str, Any] | PrefixCacheConfig,
        block_size: int,
        realtime_reserved_replicas: int,
        prefix_cache_deployment: str = PREFIX_CACHE_DEPLOYMENT,
        prefix_cache_app: str | None = None,
        seed: int | None = None,
    ) -> None:
        """Serve calls this with `request_router_kwargs`: `settings` is the app's `prefix_cache` block (a
        PrefixCacheConfig or its JSON dump), `block_size` the lane engine's, `realtime_reserved_replicas` the lane's
        share of admission.realtime_reserved_hot_replicas (0 off the hot lane)."""
        if not isinstance(settings, PrefixCacheConfig):
            settings = PrefixCacheConfig.model_validate(settings)
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        if realtime_reserved_replicas < 0:
            raise ValueError(f"realtime_reserved_replicas={realtime_reserved_replicas} must be >= 0")
        self.settings = settings
        self.realtime_reserved_replicas = realtime_reserved_replicas
        self.block_size = block_size
        self.lookup_mode = settings.lookup
        self.mirror_sync_interval_s = settings.mirror_sync_interval_s
        self.mirror_max_staleness_s = settings.mirror_max_staleness_s
        self.max_index_entries = settings.max_entries
        self._mirror: IndexMirror | None = None
        self.policy = AffinityPolicy.from_settings(settings)
        self.adapter_spread_at = settings.adapter_spread_at
        self.lookup_timeout_s = settings.lookup_timeout_s
        self._prefix_cache_deployment = prefix_cache_deployment
        self._prefix_cache_app = prefix_cache_app
        self._rng = random.Random(seed)
        self._lookup: PrefixLookup | None = None
        self._handle_creation: asyncio.Future | None = None
        self._lookup_injected = False
        self.stats = decision_stats(self._deployment_id.name)

    # Tests and the lead may inject the lookup (e.g. a function over a local PrefixIndex) instead of the handle.
    def set_prefix_lookup(self, lookup: PrefixLookup | None) -> None:
        """Use this instead of the PrefixCache handle (None: no prefix cache at all, always load-only)."""
        self._lookup = lookup
        self._lookup_injected = True

    def _uses_mirror(self) -> bool:
        return self.lookup_mode == "local_mirror" and not self._lookup_injected

    def _ensure_prefix_lookup(self) -> None:
        """Start creating the PrefixCache handle in a worker thread, once; until it exists, lookups "fail"."""
        if self._lookup_injected or self._lookup is not None or self._handle_creation is not None:
            return
        loop = asyncio.get_running_loop()
        if _handle_routers_run_in_separate_loop():
            self._handle_creation = loop.run_in_executor(None, self._create_prefix_cache_handle)
        else:
            # Serve routes handle calls on the caller's own loop (RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0, part of
            # RAY_SERVE_THROUGHPUT_OPTIMIZED=1): the handle must be made on this loop, and making it waits for nothing.
            self._handle_creation = loop.create_future()
            try:
                self._handle_creation.set_result(self._create_prefix_cache_handle())
            except Exception as error:
                self._handle_creation.set_exception(error)
        self._handle_creation.add_done_callback(self._on_handle_created)

    def _create_prefix_cache_handle(
        self,
    ) -> tuple[PrefixLookup, Callable[[str | None, int], Awaitable[dict[str, Any]]]]:
        # Runs in a worker thread when Serve runs handle routers on their own loop: initialising a handle there
        # creates its router and waits on that loop.
        from ray.serve.handle import DeploymentHandle

        app_name = self._prefix_cache_app if self._prefix_cache_app is not None else self._deployment_id.app_name
        handle = DeploymentHandle(self._prefix_cache_deployment, app_name)
        lookup_handle = handle.options(method_name=LOOKUP_METHOD)

        async def lookup(hashes: list[BlockHash], block_size: int) -> Sequence[tuple[str, int]]:
            return await lookup_handle.remote(hashes, block_size)

        changes_handle = handle.options(method_name=CHANGES_METHOD)

        async def pull_changes(epoch: str | None, seq: int) -> dict[str, Any]:
            return await changes_handle.remote(epoch, seq)

        return lookup, pull_changes

    def _on_handle_created(self, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            logger.warning("could not create the %s handle: %r; retrying on the next request",
                           self._prefix_cache_deployment, None if future.cancelled() else future.exception())
            self._handle_creation = None
            return
        self._lookup, pull_changes = future.result()
        if self.lookup_mode == "local_mirror":
            app_name = self._prefix_cache_app if self._prefix_cache_app is not None else self._deployment_id.app_name
            self._mirror, owner = shared_mirror(app_name, self._prefix_cache_deployment, self.max_index_entries,
                                                self.mirror_max_staleness_s)
            if owner:  # one sync loop per process, shared by the lanes' routers; the mirror keeps the task alive
                self._mirror.sync_task = asyncio.get_running_loop().create_task(
                    sync_mirror_forever(self._mirror, pull_changes, self.mirror_sync_interval_s),
                    name="prefix-index-mirror-sync")

    async def _candidate_loads(self, candidates: Sequence[RunningReplica]) -> list[tuple[RunningReplica, ReplicaLoad]]:
        """Queue lengths from Serve's cache, probing replicas it lacks; replicas that do not answer or are full are
        left out unless that leaves none."""
        queue_lens: dict[ReplicaID, int | None] = {}
        missing: list[RunningReplica] = []
        for replica in candidates:
            cached = None
            if self._use_replica_queue_len_cache:
                cached = self._replica_queue_len_cache.get(replica.replica_id)
            if cached is None:
                missing.append(replica)
            queue_lens[replica.replica_id] = cached
        if missing:
            for replica, queue_len in await self._probe_queue_lens(missing, 0):
                queue_lens[replica.replica_id] = queue_len
        loads = []
        for replica in candidates:
            queue_len = queue_lens.get(replica.replica_id)
            if queue_len is None or queue_len >= replica.max_ongoing_requests:
                continue
            kv_usage = float((replica.routing_stats or {}).get(KV_USAGE_STAT, 0.0))
            loads.append((replica, ReplicaLoad(replica.replica_id.to_full_id_str(), queue_len, kv_usage)))
        if not loads:  # nobody answered or all full: let Serve's retry/backoff sort it out among all of them
            loads = [(r, ReplicaLoad(r.replica_id.to_full_id_str(), queue_lens.get(r.replica_id) or 0,
                                     float((r.routing_stats or {}).get(KV_USAGE_STAT, 0.0)))) for r in candidates]
        return loads

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        started = time.perf_counter()
        # Create the PrefixCache handle at the first routed call of any kind (stats, short prompts), so it is
        # ready, with its replicas known, by the time the first long prompt needs a lookup.
        self._ensure_prefix_lookup()
        if pending_request is not None:
            # Back off between retries when every candidate is full instead of spinning (and re-looking-up).
            pending_request.routing_context.should_backoff = True
        token_ids = (
            extract_prompt_token_ids(pending_request.args, pending_request.kwargs) if pending_request else None
        ) or []
        adapter = extract_adapter_name(pending_request.args, pending_request.kwargs) if pending_request else None
        matched: dict[str, int] | None = None
        if len(token_ids) >= self.policy.min_prefix_tokens:
            hashes = block_hashes(token_ids, self.block_size, adapter_root_hash(adapter))
            if self._uses_mirror():
                # A local dictionary walk: nothing to wait for, so no budget and no event-loop round trip.
                matched = mirror_lookup(self._mirror, hashes, self.block_size, self.stats.lookup_outcomes)
                loads = await self._candidate_loads(candidate_replicas)
            else:
                matched, loads = await asyncio.gather(
                    lookup_with_budget(self._lookup, hashes, self.block_size, self.lookup_timeout_s,
                                       self.stats.lookup_outcomes),
                    self._candidate_loads(candidate_replicas),
                )
        else:
            loads = await self._candidate_loads(candidate_replicas)
        loads, fallback = self._apply_reserve(candidate_replicas, loads, pending_request)
        if adapter is not None:
            loads = self._narrow_for_adapter(adapter, loads)
        decision = decide(len(token_ids), [load for _, load in loads], matched, self.policy, self._rng)
        self.record_decision(decision, time.perf_counter() - started)
        replicas = [replica for replica, _ in loads]
        return rank_replicas(replicas, decision.replica_id, lambda r: r.replica_id.to_full_id_str(), fallback)

    def _narrow_for_adapter(self, adapter: str, loads: list[tuple[RunningReplica, ReplicaLoad]]
                            ) -> list[tuple[RunningReplica, ReplicaLoad]]:
        """The candidates a request for LoRA adapter `adapter` is routed among (adapter_affinity.py): those whose
        engines hold it, as their routing stats say."""
        held = {load.replica_id: (replica.routing_stats or {}).get(ADAPTERS_STAT) or {} for replica, load in loads}
        narrowing = narrow_for_adapter(adapter, [load.replica_id for _, load in loads], held, self.adapter_spread_at,
                                       {load.replica_id: load.queue_len for _, load in loads},
                                       self.policy.max_queue_imbalance)
        self.stats.count_adapter_routing(narrowing.reason.value)
        return [(replica, load) for replica, load in loads if load.replica_id in narrowing.replica_ids]

    def _apply_reserve(
        self, candidates: Sequence[RunningReplica], loads: list[tuple[RunningReplica, ReplicaLoad]],
        pending_request: PendingRequest | None,
    ) -> tuple[list[tuple[RunningReplica, ReplicaLoad]], list[RunningReplica]]:
        """(loads to choose among, replicas to fall back on) under the realtime reserve (realtime_reserve.py).
        The reserve is drawn from every live candidate, not only those with room, so a busy reserved replica stays
        reserved."""
        if not self.realtime_reserved_replicas:
            return loads, []
        request_class = (extract_request_class(pending_request.args, pending_request.kwargs)
                         if pending_request is not None else None)
        preferred, _ = split_by_reserve([r.replica_id.to_full_id_str() for r in candidates], request_class,
                                        self.realtime_reserved_replicas)
        own = [(replica, load) for replica, load in loads if load.replica_id in preferred]
        other = [replica for replica, load in loads if load.replica_id not in preferred]
        if own:
            self.stats.count_reserve_routing("preferred")
            return own, other
        self.stats.count_reserve_routing("fallback")
        return loads, []

    def record_decision(self, decision: RoutingDecision, elapsed_s: float) -> None:
        self.stats.observe(decision, elapsed_s)
        notify_decision_observers(self._deployment_id.name, decision, elapsed_s)
