"""The engine adapter (app/lanes/engine.py) the lane replicas run, on real vLLM engines on CPU with the tiny model,
without Serve (nothing here is Serve's). One engine with neither LoRA nor speculation gives every reference answer.

- Multi-LoRA: an adapter changes the greedy answer; the base model's answer with LoRA on is the one without, also
  while adapter requests share its engine steps (vLLM's CPU kernels would give it the last slot's adapter, so the
  base model runs under an identity adapter, app/lanes/identity_adapter.py); an adapter the engine refuses (another
  model's shapes, a rank too large, no files) is refused naming why, before any request, and the engine goes on
  serving.
- Speculative decoding, as prod.yaml turns it on for the cold lane (ngram, 4 tokens): the same greedy text as
  without, and its drafted and accepted tokens reach the lane's stats.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil

import pytest

from app.classes import RequestClass
from app.config import load_app_config
from app.lanes.engine import VllmEngine
from app.lanes.types import AdapterRef, LaneRequest, LaneRequestInvalid, SamplingOptions
from app.tools.make_tiny_lora import make_tiny_lora
from tests.fakes import TINY_MODEL, cpu_args

LORA_PROMPTS = [[45, 619, 359, 17, 295, 94, 643, 298], list(range(300, 340))]
LORA = {"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
# Prompts that repeat themselves, so the prompt-lookup drafter has n-grams to propose.
SPECULATION_PROMPTS = [[11, 12, 13, 14, 15] * 8, [40, 41, 42] * 10 + [40, 41], list(range(100, 130)) * 2]


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


async def started(lora: dict | None = None, adapters: list[dict] | None = None,
                  speculative_config: dict | None = None) -> VllmEngine:
    # No Ray here: vLLM's Ray metrics logger would register the engine's ray_vllm_* series from this process (in a
    # test session where a test app's cluster runs, beside the lane replicas' own).
    args = cpu_args(observability={"vllm_metrics": False})
    args["model"]["adapters"] = adapters or []
    for lane in ("hot_lane", "cold_lane"):
        args[lane]["engine"]["lora"] = lora
    cfg = load_app_config(args)
    # Eager, as local.yaml's engines: no compile, so each engine starts in seconds.
    settings = cfg.cold_lane.engine.model_copy(update={"enforce_eager": True, "speculative_config": speculative_config})
    engine = VllmEngine(cfg, settings, "cold", f"lora-{bool(lora)}-spec-{bool(speculative_config)}")
    await engine.start()
    return engine


class EngineOnLoop:
    """An engine started on an event loop of its own, kept for a module's tests."""

    def __init__(self, **start_args):
        self.loop = asyncio.new_event_loop()
        self.engine = self.loop.run_until_complete(started(**start_args))

    def run(self, coroutine_function):
        return self.loop.run_until_complete(coroutine_function(self.engine))

    def close(self) -> None:
        """Shut the engine down on its loop, then end what it left there, as asyncio.run does: its client's output
        task holds a ZeroMQ socket, and a socket left open makes the context's garbage collection (in whatever test
        runs then) wait for it forever."""
        async def shutdown() -> None:
            self.engine.shutdown()
            left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

        try:
            self.loop.run_until_complete(shutdown())
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
        # Collected here, not in a later test: a context still waiting on a socket would hang this module.
        gc.collect()


@pytest.fixture(scope="module")
def plain_engine():
    """The reference: neither LoRA nor speculation."""
    engine = EngineOnLoop()
    yield engine
    engine.close()


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
    """An engine with LoRA on and adapters "a" and "b" configured, shared by the LoRA tests."""
    configured = [{"name": "a", "path": adapters["a"]}, {"name": "b", "path": adapters["b"]}]
    engine = EngineOnLoop(lora=LORA, adapters=configured)
    yield engine
    engine.close()


@pytest.mark.timeout(900)
def test_adapters_answer_their_own_and_the_base_model_keeps_its_answer_beside_them(adapters, lora_engine,
                                                                                    plain_engine):
    async def without_lora(engine: VllmEngine):
        return [await greedy(engine, prompt, f"plain{i}") for i, prompt in enumerate(LORA_PROMPTS)]

    async def with_lora(engine: VllmEngine):
        a, b = AdapterRef("a", 1, adapters["a"]), AdapterRef("b", 2, adapters["b"])
        base = [await greedy(engine, prompt, f"base{i}") for i, prompt in enumerate(LORA_PROMPTS)]
        alone = {ref.name: await greedy(engine, LORA_PROMPTS[0], f"alone-{ref.name}", ref) for ref in (a, b)}
        mixed = await asyncio.gather(*(greedy(engine, prompt, f"mixed{i}") for i, prompt in enumerate(LORA_PROMPTS)),
                                     greedy(engine, LORA_PROMPTS[0], "mixed-a", a),
                                     greedy(engine, LORA_PROMPTS[0], "mixed-b", b))
        return base, alone, mixed, await engine.held_adapters()

    base, alone, mixed, held = lora_engine.run(with_lora)
    plain = plain_engine.run(without_lora)
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
        with pytest.raises(LaneRequestInvalid) as invalid:
            await greedy(engine, LORA_PROMPTS[0], "bad", AdapterRef("other", 20, adapters["other"]))
        after = await greedy(engine, LORA_PROMPTS[0], "after", AdapterRef("a", 1, adapters["a"]))
        return refusals, invalid.value, after

    refusals, invalid, after = lora_engine.run(run)
    assert "LoRA adapter 'other'" in refusals["other"] and "must match the size" in refusals["other"]
    assert "LoRA rank 16 is greater than max_lora_rank 8" in refusals["wide"]
    assert "LoRA adapter 'empty'" in refusals["empty"]
    assert invalid.param == "model" and "'other'" in str(invalid)
    assert len(after) == 24


@pytest.mark.timeout(600)
def test_ngram_speculation_gives_the_same_greedy_text_and_its_acceptance_reaches_the_stats(plain_engine):
    async def answers(engine: VllmEngine):
        return [await greedy(engine, prompt, f"r{i}") for i, prompt in enumerate(SPECULATION_PROMPTS)]

    plain = plain_engine.run(answers)
    plain_stats = plain_engine.engine.stats()
    speculating = EngineOnLoop(speculative_config=NGRAM)
    try:
        speculative = speculating.run(answers)
        stats = speculating.engine.stats()
    finally:
        speculating.close()
    assert speculative == plain
    assert plain_stats.spec_draft_tokens == 0 and plain_stats.spec_acceptance_rate is None
    assert stats.spec_draft_tokens > 0 and 0 <= stats.spec_accepted_tokens <= stats.spec_draft_tokens
    print(f"ngram speculation: {stats.spec_accepted_tokens} of {stats.spec_draft_tokens} drafted tokens accepted "
          f"({stats.spec_acceptance_rate:.0%})")
