"""The `model` label of the per-model metrics (llm_lanes_model_*): the name a request was served under, from a
bounded set. No Ray.

Every distinct label value is one more series of each per-model metric in every Prometheus that scrapes it, and
adapters can be loaded while the app runs, each under a name its loader chooses. So a Router replica gives the first
`limit` adapter names it sees a value of their own and every later one OTHER_MODELS; the base model always has its
served name. The adapters of the serve config (model.adapters) take their values first, so every replica labels them
alike. A name keeps its value for the replica's life, so a series never changes meaning under a dashboard.
"""

from __future__ import annotations

from collections.abc import Iterable

# The shared label of the adapters past the limit.
OTHER_MODELS = "other"


class ModelLabels:
    def __init__(self, base_model: str, limit: int, configured: Iterable[str] = ()):
        if limit < 1:
            raise ValueError(f"the model label limit must be at least 1, got {limit}")
        self.base_model = base_model
        self.limit = limit
        self._adapters: set[str] = set()
        for adapter in configured:
            self.label(adapter)

    def label(self, adapter: str | None) -> str:
        """The label of a request served under `adapter` (None: the base model)."""
        if adapter is None or adapter == self.base_model:
            return self.base_model
        if adapter in self._adapters:
            return adapter
        if len(self._adapters) < self.limit:
            self._adapters.add(adapter)
            return adapter
        return OTHER_MODELS
