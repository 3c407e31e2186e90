"""Per-replica stats for the admin endpoint: one live answer merged with the PrefixCache's registry."""

from __future__ import annotations

from typing import Any

# The key of a lane replica's record_routing_stats() dict that the prefix-affinity request router weighs.
KV_USAGE_STAT = "kv_usage"
# The key under which it reports the LoRA adapters its engine holds: {adapter name: its requests running there}
# (app/prefix_cache/adapter_affinity.py routes on it).
ADAPTERS_STAT = "adapters"
# The key of a lane replica's stats() (GET /v1/admin/stats) with its requests for an adapter that found it in the
# engine's host-memory cache and those that had to load it (app/lanes/adapter_residency.py).
ADAPTER_RESIDENCY_STAT = "adapter_residency"


def merge_replica_stats(live: dict[str, Any], registry: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every replica of a lane, the one that answered the live handle call first (fresh), then the others as they
    last reported themselves (a couple of seconds old, `stats_age_s` says how much). A live error with no registry
    entries is kept as the lane's only entry so the failure stays visible."""
    if "error" in live and registry:
        return list(registry)
    live_id = live.get("replica_id")
    return [live] + [entry for entry in registry if entry.get("replica_id") != live_id]
