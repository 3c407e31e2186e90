"""LoRA adapters at the Router: vLLM's serving code lists them, checks each one's files and rank when it is listed,
knows their names as models, and the pipeline hands the adapter to the lane with the request. vLLM's real serving
classes over the tiny model; fake lanes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from app.config import load_app_config
from app.lanes.types import AdapterRef
from app.observability import tracing as tr
from app.observability.metrics import LlmLanesMetrics
from app.router import openai_api as api
from app.router.auth import OPEN_PRINCIPAL
from app.router.control import TrafficControl
from app.router.endpoints import CHAT, COMPLETION
from app.router.openai_surface import OpenAISurface
from app.router.pipeline import RequestPipeline
from app.tools.make_tiny_lora import make_tiny_lora
from tests.fakes import TINY_MODEL, FakeLane, FakeLanes, FakeMetricsModule, cpu_args, openai_surface


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    openai_surface(load_app_config(cpu_args()))  # generates the tiny model if needed
    root = tmp_path_factory.mktemp("adapters")
    for name, seed, rank in (("tiny-a", 1, 8), ("tiny-wide", 3, 16)):
        make_tiny_lora(TINY_MODEL, root / name, seed, rank)
    (root / "empty").mkdir()
    return {path.name: path for path in root.iterdir()}


def lora_config(adapters: dict[str, Path], max_lora_rank: int = 8):
    args = cpu_args()
    args["model"]["adapters"] = [{"name": name, "path": str(path)} for name, path in adapters.items()]
    for lane in ("hot_lane", "cold_lane"):
        args[lane]["engine"]["lora"] = {"max_loras": 2, "max_lora_rank": max_lora_rank}
    return load_app_config(args)


def pipeline_over(cfg, surface: OpenAISurface) -> tuple[RequestPipeline, dict[str, FakeLane]]:
    """The request pipeline over `surface` and fake lanes that record what they are handed."""
    lanes = {"hot": FakeLane("hot"), "cold": FakeLane("cold")}
    pipeline = RequestPipeline(cfg, surface, TrafficControl(cfg), FakeLanes(lanes),
                               LlmLanesMetrics(metrics_module=FakeMetricsModule()),
                               tr.setup_tracing({"exporter": "none"}, component="Router"))
    return pipeline, lanes


async def test_adapters_are_listed_under_the_base_model_and_served_by_name(adapter_dirs):
    surface = OpenAISurface(lora_config({"tiny-a": adapter_dirs["tiny-a"]}))
    await surface.load_static_adapters()
    cards = await surface.model_cards()
    assert [(card["id"], card["parent"]) for card in cards] == [("tiny", None), ("tiny-a", "tiny")]
    assert cards[1]["root"] == str(adapter_dirs["tiny-a"])
    assert surface.serves_model("tiny-a") and surface.serves_model("tiny") and surface.serves_model(None)
    assert not surface.serves_model("tiny-b")


@pytest.mark.parametrize("adapter, max_rank, message", [
    ("tiny-wide", 8, r"LoRA adapter 'tiny-wide': LoRA rank 16 is greater than max_lora_rank 8"),
    ("empty", 8, r"LoRA adapter 'empty': no adapter_config.json in"),
])
async def test_an_adapter_that_cannot_be_served_is_refused_naming_it_and_why(adapter_dirs, adapter, max_rank,
                                                                            message):
    surface = OpenAISurface(lora_config({adapter: adapter_dirs[adapter]}, max_lora_rank=max_rank))
    with pytest.raises(ValueError, match=message):
        await surface.load_static_adapters()


async def test_the_pipeline_hands_the_named_adapter_to_the_lane_and_none_for_the_base_model(adapter_dirs):
    cfg = lora_config({"tiny-a": adapter_dirs["tiny-a"]})
    surface = OpenAISurface(cfg)
    await surface.load_static_adapters()
    pipeline, lanes = pipeline_over(cfg, surface)
    for endpoint, body in ((COMPLETION, {"prompt": "Hello", "max_tokens": 2}),
                           (CHAT, {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})):
        answer = await pipeline.answer(endpoint, {**body, "model": "tiny-a"})
        assert answer.response["model"] == "tiny-a"
        await pipeline.answer(endpoint, {**body, "model": "tiny"})
    named = [request.adapter for request in lanes["hot"].requests]
    assert [a.name if a else None for a in named] == ["tiny-a", None, "tiny-a", None]
    assert named[0].path == str(adapter_dirs["tiny-a"]) and named[0].id == named[2].id >= 1
    with pytest.raises(api.OpenAIError) as refused:
        await pipeline.answer(COMPLETION, {"prompt": "Hello", "max_tokens": 2, "model": "tiny-b"})
    assert refused.value.status == 404


async def test_adapters_loaded_at_run_time_are_served_under_the_stores_ids_beside_the_configured_ones(adapter_dirs):
    surface = OpenAISurface(lora_config({"tiny-a": adapter_dirs["tiny-a"]}, max_lora_rank=16))
    await surface.load_static_adapters()
    wide = AdapterRef("tiny-wide", 1_000_000, str(adapter_dirs["tiny-wide"]))
    surface.set_runtime_adapters([wide, AdapterRef("tiny-a", 1_000_001, "/elsewhere")])
    cards = {card["id"]: card for card in await surface.model_cards()}
    assert cards["tiny-wide"]["parent"] == "tiny" and cards["tiny-wide"]["root"] == wide.path
    assert surface.models.lora_requests["tiny-wide"].lora_int_id == 1_000_000
    # A configured adapter keeps its folder and id: the store cannot replace it.
    assert surface.models.lora_requests["tiny-a"].lora_int_id == 1 and cards["tiny-a"]["root"] != "/elsewhere"
    surface.set_runtime_adapters([])
    assert not surface.serves_model("tiny-wide") and surface.serves_model("tiny-a")


async def test_a_key_limited_to_adapters_finds_no_other_adapter_but_always_the_base_model(adapter_dirs):
    cfg = lora_config({"tiny-a": adapter_dirs["tiny-a"], "tiny-wide": adapter_dirs["tiny-wide"]}, max_lora_rank=16)
    surface = OpenAISurface(cfg)
    await surface.load_static_adapters()
    pipeline, lanes = pipeline_over(cfg, surface)
    limited = dataclasses.replace(OPEN_PRINCIPAL, adapters=frozenset({"tiny-a"}))
    body = {"prompt": "Hello", "max_tokens": 2}
    for model in ("tiny-a", "tiny", None):
        await pipeline.answer(COMPLETION, {**body, **({"model": model} if model else {})}, principal=limited)
    with pytest.raises(api.OpenAIError) as refused:
        await pipeline.answer(COMPLETION, {**body, "model": "tiny-wide"}, principal=limited)
    assert (refused.value.status, refused.value.param) == (404, "model")
    assert "tiny-wide" in str(refused.value) and len(lanes["hot"].requests) == 3
