"""AdapterResidency: the mirror of a lane engine's host-memory LoRA cache, its found-loaded counts, and the lane
replica reporting them in its stats."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from app.classes import RequestClass
from app.config import load_app_config
from app.lanes.adapter_residency import AdapterResidency, lane_adapter_residency
from app.lanes.replica_stats import ADAPTER_RESIDENCY_STAT
from app.lanes.types import BASE_ADAPTER_NAME, AdapterRef, EngineStats, LaneChunk, LaneRequest, SamplingOptions
from tests.fakes import cpu_args

LORA = {"max_loras": 1, "max_lora_rank": 8, "max_cpu_loras": 2}


def lora_args(**extra):
    args = cpu_args(**extra)
    for lane in ("hot_lane", "cold_lane"):
        args[lane]["engine"]["lora"] = dict(LORA)
    return args


def test_a_request_finds_its_adapter_only_while_the_cache_holds_it():
    residency = AdapterResidency(2)
    assert residency.started("a") is False  # read from disk for this request
    residency.finished("a")
    assert residency.started("a") is True
    residency.finished("a")
    for name in ("b", "c"):  # c evicts a, the least recently used
        residency.started(name)
        residency.finished(name)
    assert residency.held() == ["b", "c"]
    assert residency.started("a") is False
    residency.finished("a")
    assert residency.stats() == {"found_loaded": 1, "had_to_load": 4, "found_loaded_share": 0.2}


def test_use_makes_an_adapter_the_most_recent():
    residency = AdapterResidency(2)
    residency.loaded("a")
    residency.loaded("b")
    residency.started("a")
    residency.finished("a")
    residency.loaded("c")  # evicts b: a was used since
    assert residency.held() == ["a", "c"]


def test_an_adapter_with_requests_running_is_not_evicted_while_another_is_idle():
    residency = AdapterResidency(2)
    residency.started("a")  # runs on: used at every engine step
    residency.started("b")
    residency.finished("b")  # b's last use is after a's start, yet a runs and b does not
    residency.started("c")
    assert residency.held() == ["a", "c"]
    # Every adapter running: the oldest goes (vLLM would hold the request back until a slot frees).
    residency.started("d")
    assert residency.held() == ["c", "d"]


def test_finishing_counts_as_the_adapters_last_use():
    residency = AdapterResidency(2)
    residency.started("a")
    residency.started("b")
    residency.finished("b")
    residency.finished("a")  # a ran after b's last step
    residency.loaded("c")
    assert residency.held() == ["a", "c"]
    residency.finished("a")  # a finish without a start changes nothing
    assert residency.held() == ["a", "c"]


def test_the_base_models_identity_adapter_takes_a_place_but_is_not_counted():
    residency = AdapterResidency(2, base_adapter=BASE_ADAPTER_NAME)
    assert residency.started(None) is None
    residency.finished(None)
    residency.started("a")
    residency.finished("a")
    residency.started("b")  # evicts the identity adapter, the least recently used
    residency.finished("b")
    assert residency.held() == ["a", "b"]
    assert residency.stats()["found_loaded"] + residency.stats()["had_to_load"] == 2
    # Without an identity adapter (a GPU host) the base model's requests take no place.
    bare = AdapterResidency(1)
    assert bare.started(None) is None and bare.held() == []
    assert bare.stats() == {"found_loaded": 0, "had_to_load": 0, "found_loaded_share": None}


def test_capacity_must_hold_an_adapter():
    with pytest.raises(ValueError, match="capacity"):
        AdapterResidency(0)


def test_a_lane_starts_with_what_its_engine_loaded_at_start(tmp_path):
    args = lora_args()
    args["model"]["adapters"] = [{"name": f"a{i}", "path": str(tmp_path / f"a{i}")} for i in range(3)]
    residency = lane_adapter_residency(load_app_config(args), "cold")
    # The identity adapter first, then model.adapters in order: the last max_cpu_loras remain.
    assert residency.capacity == 2 and residency.held() == ["a1", "a2"]
    assert residency.base_adapter == BASE_ADAPTER_NAME
    assert lane_adapter_residency(load_app_config(cpu_args()), "cold") is None
    # max_cpu_loras unset: vLLM sizes the cache at max_loras.
    args = lora_args()
    del args["cold_lane"]["engine"]["lora"]["max_cpu_loras"]
    assert lane_adapter_residency(load_app_config(args), "cold").capacity == 1


class LoraEngine:
    """An engine that streams two chunks per request and loads any adapter."""

    async def start(self):
        pass

    async def generate(self, request):
        for i in range(2):
            await asyncio.sleep(0)
            yield LaneChunk(text="x", completion_tokens=i + 1, prompt_tokens=4, finish_reason="stop" if i else None)

    async def abort(self, request_id):
        pass

    async def load_adapter(self, adapter):
        pass

    async def held_adapters(self):
        return frozenset()

    def stats(self):
        return EngineStats(kv_cache_usage=0.0)

    def shutdown(self):
        pass


async def test_the_lane_replica_reports_found_loaded_counts(monkeypatch):
    import ray.serve

    from app.lanes import replica as replica_module
    from app.observability import metrics as metrics_module
    from app.observability.metrics import LlmLanesMetrics
    from app.prefix_cache.replica_feed import ReplicaPrefixFeed
    from tests.fakes import FakeMetricsModule

    monkeypatch.setattr(ray.serve, "get_replica_context", lambda: SimpleNamespace(
        replica_id=SimpleNamespace(unique_id="r1", to_full_id_str=lambda: "llm-lanes#ColdLane#r1")))
    monkeypatch.setattr(metrics_module, "LlmLanesMetrics", lambda: LlmLanesMetrics(metrics_module=FakeMetricsModule()))

    class ColdReplica(replica_module.LaneReplica):
        lane = "cold"

    replica = object.__new__(ColdReplica)
    await replica.__init__(lora_args(), None, ReplicaPrefixFeed, engine_factory=lambda *a, **k: LoraEngine())
    try:
        def request(adapter: str | None) -> LaneRequest:
            return LaneRequest(request_id="cmpl-1", prompt_token_ids=[1, 2, 3, 4],
                               sampling=SamplingOptions(max_tokens=2), request_class=RequestClass.BATCH,
                               priority=10, stream=True,
                               adapter=AdapterRef(adapter, 7, "/x") if adapter else None)

        assert await replica.try_adapter(AdapterRef("a", 7, "/x")) is None  # a run-time load's try
        for adapter in ("a", None, "b", "a"):
            [chunk async for chunk in replica.generate(request(adapter))]
        stats = await replica.stats()
        # a found (loaded by the try), b loaded, a evicted by the base model's identity adapter and b, loaded again.
        assert stats[ADAPTER_RESIDENCY_STAT] == {"found_loaded": 1, "had_to_load": 2, "found_loaded_share": 0.3333}
    finally:
        replica.__del__()
