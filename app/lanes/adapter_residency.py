"""Which LoRA adapters a lane engine holds in host memory, and how many requests found theirs there. Pure, no vLLM.

What it mirrors: vLLM 0.32's LRUCacheWorkerLoRAManager (vllm/lora/worker_manager.py) keeps at most
`max_cpu_loras` adapters read from disk in an LRU cache (LRUCacheLoRAModelManager's registered adapters). An
adapter is used, and becomes the most recent, when the engine's add_lora loads or touches it and at every engine step
that runs one of its requests (set_active_adapters -> add_adapter). A step that needs an adapter the cache lacks reads
it from disk first; with the cache full, the least recently used one is evicted.

The replica sees requests, not engine steps, so this keeps the same cache from what it does see:

- A request naming an adapter "found it loaded" when the adapter is in the cache as the replica hands the request to
  the engine; else it "had to load" it (the engine's add_lora before the request, or vLLM's load inside a step).
- An adapter with requests running is used at every step, so it stays more recent than any idle one: eviction takes
  the least recently used adapter with nothing running (the oldest of all only when every one runs; vLLM then holds
  the new request back until a slot frees, and evicts at that point).
- An adapter's last use is when its last request finished.
- On a CPU host the base model's requests run under the identity adapter (app/lanes/engine.py): it takes a place in
  the cache like any adapter, but those requests are not counted.

The engine's own order can differ by a step or two (a request waiting in the engine's queue has its adapter loaded
when it is scheduled, not when it is handed over), so the counts are a close mirror, not the engine's own figures.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from app.config import AppConfig
from app.lanes.types import BASE_ADAPTER_NAME


class AdapterResidency:
    def __init__(self, capacity: int, base_adapter: str | None = None):
        """`capacity`: the engine's max_cpu_loras. `base_adapter`: the adapter the base model's requests run under
        (None: they run without one)."""
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self.capacity = capacity
        self.base_adapter = base_adapter
        # Adapter name -> None, least recently used first.
        self._cache: OrderedDict[str, None] = OrderedDict()
        self._running: Counter[str] = Counter()
        self.found_loaded = 0
        self.had_to_load = 0

    def loaded(self, adapter: str) -> None:
        """The engine loaded (or touched) `adapter` outside a request: at start, or a run-time load's try."""
        self._use(adapter)

    def started(self, adapter: str | None) -> bool | None:
        """A request for `adapter` (None: the base model) is handed to the engine. Whether it found its adapter
        loaded; None for the base model's requests, which are not counted."""
        name = adapter or self.base_adapter
        if name is None:
            return None
        found = name in self._cache
        if adapter is not None:
            if found:
                self.found_loaded += 1
            else:
                self.had_to_load += 1
        self._running[name] += 1
        self._use(name)
        return found if adapter is not None else None

    def finished(self, adapter: str | None) -> None:
        """A request started with started(`adapter`) left the engine (finished, aborted or failed)."""
        name = adapter or self.base_adapter
        if name is None or not self._running[name]:
            return
        self._running[name] -= 1
        if not self._running[name]:
            del self._running[name]
        if name in self._cache:
            self._cache.move_to_end(name)

    def held(self) -> list[str]:
        """The adapters in the cache, least recently used first."""
        return list(self._cache)

    def stats(self) -> dict[str, Any]:
        counted = self.found_loaded + self.had_to_load
        return {"found_loaded": self.found_loaded, "had_to_load": self.had_to_load,
                "found_loaded_share": round(self.found_loaded / counted, 4) if counted else None}

    def _use(self, name: str) -> None:
        if name in self._cache:
            self._cache.move_to_end(name)
            return
        if len(self._cache) >= self.capacity:
            idle = next((held for held in self._cache if not self._running[held]), None)
            del self._cache[idle if idle is not None else next(iter(self._cache))]
        self._cache[name] = None


def lane_adapter_residency(cfg: AppConfig, lane: str) -> AdapterResidency | None:
    """The residency of one lane's engine as it starts (None: the lane runs no LoRA): its engine has loaded the
    identity adapter on a CPU host, then model.adapters in their order (VllmEngine._load_configured_adapters)."""
    lora = cfg.lane(lane).engine.lora
    if lora is None:
        return None
    base = BASE_ADAPTER_NAME if cfg.device == "cpu" else None
    # vLLM sizes the cache at max_loras when max_cpu_loras is unset.
    residency = AdapterResidency(lora.max_cpu_loras or lora.max_loras, base)
    for name in ([base] if base else []) + [adapter.name for adapter in cfg.model.adapters]:
        residency.loaded(name)
    return residency
