"""Process-wide record of prefix-affinity routing decisions, and hooks for metrics. Pure Python, no Ray.

Lives apart from request_router.py on purpose: Ray Serve pickles the request-router module by value, so state kept
there would be copied into each process as a separate namespace. This module is imported by reference everywhere,
so a hook registered here (e.g. the lead's Ray metric) sees every router's decisions in this process.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from app.prefix_cache.policy import RoutingDecision

logger = logging.getLogger(__name__)

# Decision-time buckets (milliseconds) for the in-process histogram; the last bucket is everything above.
DECISION_TIME_BUCKETS_MS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0)
# Recent decision times kept for percentiles.
DECISION_TIME_WINDOW = 4096

DecisionObserver = Callable[[str, RoutingDecision, float], None]


@dataclass
class DecisionStats:
    """Routing decisions of one deployment: time histogram, recent-window percentiles, counts by reason."""

    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(DECISION_TIME_BUCKETS_MS) + 1))
    recent_ms: deque = field(default_factory=lambda: deque(maxlen=DECISION_TIME_WINDOW))
    reasons: dict[str, int] = field(default_factory=dict)
    # Prefix-index lookups by outcome: ok / unavailable (no handle yet) / timeout / error.
    lookup_outcomes: dict[str, int] = field(default_factory=dict)
    # With a realtime reserve (realtime_reserve.py): requests routed within their own set ("preferred") or, with
    # none of it able to take them, to the other set ("fallback"). Fallbacks mean the reserve is too small or down.
    reserve_routing: dict[str, int] = field(default_factory=dict)
    # Requests naming a LoRA adapter, by adapter_affinity's reason (loaded, spread, not loaded): how often one found
    # its adapter already in the engine it was routed to.
    adapter_routing: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, decision: RoutingDecision, elapsed_s: float) -> None:
        elapsed_ms = elapsed_s * 1000.0
        with self._lock:
            self.bucket_counts[bisect.bisect_left(DECISION_TIME_BUCKETS_MS, elapsed_ms)] += 1
            self.recent_ms.append(elapsed_ms)
            self.reasons[decision.reason.value] = self.reasons.get(decision.reason.value, 0) + 1

    def count_reserve_routing(self, outcome: str) -> None:
        with self._lock:
            self.reserve_routing[outcome] = self.reserve_routing.get(outcome, 0) + 1

    def count_adapter_routing(self, reason: str) -> None:
        with self._lock:
            self.adapter_routing[reason] = self.adapter_routing.get(reason, 0) + 1

    def percentile_ms(self, q: float) -> float | None:
        with self._lock:
            window = sorted(self.recent_ms)
        if not window:
            return None
        return window[min(len(window) - 1, int(q * len(window)))]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            buckets = dict(zip([*map(str, DECISION_TIME_BUCKETS_MS), "+Inf"], self.bucket_counts))
            reasons = dict(self.reasons)
            lookups = dict(self.lookup_outcomes)
            reserve = dict(self.reserve_routing)
            adapters = dict(self.adapter_routing)
        return {
            "p50_ms": self.percentile_ms(0.5),
            "p99_ms": self.percentile_ms(0.99),
            "buckets_ms": buckets,
            "reasons": reasons,
            "lookups": lookups,
            "reserve_routing": reserve,
            "adapter_routing": adapters,
        }


_STATS: dict[str, DecisionStats] = {}
_OBSERVERS: list[DecisionObserver] = []
_REGISTRY_LOCK = threading.Lock()


def decision_stats(deployment_name: str) -> DecisionStats:
    """The stats shared by every router of `deployment_name` in this process."""
    with _REGISTRY_LOCK:
        return _STATS.setdefault(deployment_name, DecisionStats())


def all_decision_stats() -> dict[str, dict[str, Any]]:
    """deployment -> snapshot, for every deployment routed from this process."""
    with _REGISTRY_LOCK:
        stats = dict(_STATS)
    return {name: value.snapshot() for name, value in sorted(stats.items())}


def add_decision_observer(observer: DecisionObserver) -> None:
    """`observer(deployment_name, decision, elapsed_s)` after every routing decision made in this process."""
    with _REGISTRY_LOCK:
        if observer not in _OBSERVERS:
            _OBSERVERS.append(observer)


def remove_decision_observer(observer: DecisionObserver) -> None:
    with _REGISTRY_LOCK:
        if observer in _OBSERVERS:
            _OBSERVERS.remove(observer)


def notify_decision_observers(deployment_name: str, decision: RoutingDecision, elapsed_s: float) -> None:
    for observer in list(_OBSERVERS):
        try:
            observer(deployment_name, decision, elapsed_s)
        except Exception:  # an observer (metrics) must never break routing
            logger.exception("decision observer failed")
