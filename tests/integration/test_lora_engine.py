"""vLLM's multi-LoRA through the engine adapter (app/lanes/engine.py) on CPU, without Serve: an adapter changes the
greedy answer; the base model's answer with LoRA on is the one without, also while adapter requests share its engine
steps (vLLM's CPU kernels would give it the last slot's adapter, so the base model runs under an identity adapter); an
adapter the engine refuses (another model's shapes, a rank too large, no files) is refused naming why, before any
request, and the engine goes on serving."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from app.classes import RequestClass
from app.config import load_app_config
from app.lanes.engine import VllmEngine
from app.lanes.types import AdapterRef, LaneRequest, LaneRequestInvalid, SamplingOptions
from app.tools.make_tiny_lora import make_tiny_lora
from tests.fakes import TINY_MODEL, cpu_args

PROMPTS = [[45, 619, 359, 17, 295, 94, 643, 298], list(range(300, 340))]
LORA = {"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4}


async def greedy(engine: VllmEngine, prompt: list[int], request_id: str,
                 adapter: AdapterRef | None = None) -> tuple[int, ...]:
    request = LaneRequest(request_id=request_id, prompt_token_ids=prompt,
                          sampling=SamplingOptions(max_tokens=24, temperature=0.0, ignore_eos=True),
                          request_class=RequestClass.BATCH, priority=20, stream=False, return_token_ids=True,
                          adapter=adapter)
    tokens: list[int] = []
    async for chunk in engine.generate(request):
        tokens.extend(chunk.token_ids)
    return tuple(tokens)


async def started(lora: dict | None, adapters: list[dict] | None = None) -> VllmEngine:
    args = cpu_args()
    args["model"]["adapters"] = adapters or []
    for lane in ("hot_lane", "cold_lane"):
        args[lane]["engine"]["lora"] = lora
    cfg = load_app_config(args)
    # Eager, as local.yaml's engines: no compile, so each engine starts in seconds.
    settings = cfg.cold_lane.engine.model_copy(update={"enforce_eager": True})
    engine = VllmEngine(cfg, settings, "cold", f"lora-{bool(lora)}")
    await engine.start()
    return engine


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    make_tiny_lora(TINY_MODEL, root / "a", seed=1)
    make_tiny_lora(TINY_MODEL, root / "b", seed=2)
    make_tiny_lora(TINY_MODEL, root / "wide", seed=3, rank=16)
    other = root / "other-model"
    other.mkdir()
    config = json.loads((TINY_MODEL / "config.json").read_text())
    config.update(hidden_size=2 * config["hidden_size"], intermediate_size=2 * config["intermediate_size"])
    (other / "config.json").write_text(json.dumps(config))
    make_tiny_lora(other, root / "other", seed=4)
    (root / "empty").mkdir()
    yield {path.name: str(path) for path in root.iterdir()}
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def lora_engine(adapters):
    """(event loop, engine with LoRA on and adapters "a" and "b" configured), shared by the module's tests."""
    loop = asyncio.new_event_loop()
    configured = [{"name": "a", "path": adapters["a"]}, {"name": "b", "path": adapters["b"]}]
    engine = loop.run_until_complete(started(LORA, configured))
    yield loop, engine
    engine.shutdown()
    loop.close()


@pytest.mark.timeout(900)
def test_adapters_answer_their_own_and_the_base_model_keeps_its_answer_beside_them(adapters, lora_engine):
    async def without_lora():
        engine = await started(None)
        try:
            return [await greedy(engine, prompt, f"plain{i}") for i, prompt in enumerate(PROMPTS)]
        finally:
            engine.shutdown()

    async def with_lora(engine: VllmEngine):
        a, b = AdapterRef("a", 1, adapters["a"]), AdapterRef("b", 2, adapters["b"])
        base = [await greedy(engine, prompt, f"base{i}") for i, prompt in enumerate(PROMPTS)]
        alone = {ref.name: await greedy(engine, PROMPTS[0], f"alone-{ref.name}", ref) for ref in (a, b)}
        # The base model's requests in the same steps as both adapters' (all sent at once).
        mixed = await asyncio.gather(*(greedy(engine, prompt, f"mixed{i}") for i, prompt in enumerate(PROMPTS)),
                                     greedy(engine, PROMPTS[0], "mixed-a", a),
                                     greedy(engine, PROMPTS[0], "mixed-b", b))
        return base, alone, mixed, await engine.held_adapters()

    loop, engine = lora_engine
    base, alone, mixed, held = loop.run_until_complete(with_lora(engine))
    plain = asyncio.run(without_lora())
    assert base == plain
    assert alone["a"] != plain[0] and alone["b"] != plain[0] and alone["a"] != alone["b"]
    assert list(mixed) == [*plain, alone["a"], alone["b"]]
    assert held == {"a", "b"}


@pytest.mark.timeout(900)
def test_an_adapter_the_engine_refuses_is_refused_naming_why_and_the_engine_goes_on(adapters, lora_engine):
    async def run(engine: VllmEngine):
        refusals = {}
        for name in ("other", "wide", "empty"):
            with pytest.raises(ValueError) as refused:
                await engine.load_adapter(AdapterRef(name, 10 + len(refusals), adapters[name]))
            refusals[name] = str(refused.value)
        # A request naming one is refused as the client's (400 naming `model`), before the engine runs it.
        with pytest.raises(LaneRequestInvalid) as invalid:
            await greedy(engine, PROMPTS[0], "bad", AdapterRef("other", 20, adapters["other"]))
        after = await greedy(engine, PROMPTS[0], "after", AdapterRef("a", 1, adapters["a"]))
        return refusals, invalid.value, after

    loop, engine = lora_engine
    refusals, invalid, after = loop.run_until_complete(run(engine))
    assert "LoRA adapter 'other'" in refusals["other"] and "must match the size" in refusals["other"]
    assert "LoRA rank 16 is greater than max_lora_rank 8" in refusals["wide"]
    assert "LoRA adapter 'empty'" in refusals["empty"]
    assert invalid.param == "model" and "'other'" in str(invalid)
    assert len(after) == 24
