"""Speculative decoding, as prod.yaml turns it on for the cold lane (ngram, 4 tokens): the engine adapter with it
gives the same greedy text as without, and its drafted and accepted tokens reach the lane's stats. Real vLLM engines
on CPU with the tiny model, through the engine adapter (app/lanes/engine.py) the lane replicas run, without Serve:
nothing here is Serve's."""

from __future__ import annotations

import asyncio

import pytest

from app.classes import RequestClass
from app.config import load_app_config
from app.lanes.engine import VllmEngine
from app.lanes.types import LaneRequest, SamplingOptions
from tests.fakes import cpu_args

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
# Prompts that repeat themselves, so the prompt-lookup drafter has n-grams to propose.
PROMPTS = [[11, 12, 13, 14, 15] * 8, [40, 41, 42] * 10 + [40, 41], list(range(100, 130)) * 2]


async def greedy(engine: VllmEngine, prompt: list[int], request_id: str) -> tuple[int, ...]:
    request = LaneRequest(request_id=request_id, prompt_token_ids=prompt,
                          sampling=SamplingOptions(max_tokens=24, temperature=0.0, ignore_eos=True),
                          request_class=RequestClass.BATCH, priority=20, stream=False, return_token_ids=True)
    tokens: list[int] = []
    async for chunk in engine.generate(request):
        tokens.extend(chunk.token_ids)
    return tuple(tokens)


async def answers(speculative_config: dict | None) -> tuple[list[tuple[int, ...]], VllmEngine]:
    cfg = load_app_config(cpu_args())
    # Eager, as local.yaml's engines: no compile, so each engine starts in seconds.
    settings = cfg.cold_lane.engine.model_copy(update={"speculative_config": speculative_config, "enforce_eager": True})
    engine = VllmEngine(cfg, settings, "cold", f"spec-{bool(speculative_config)}")
    await engine.start()
    try:
        outputs = [await greedy(engine, prompt, f"r{i}") for i, prompt in enumerate(PROMPTS)]
        return outputs, engine
    except BaseException:
        engine.shutdown()
        raise


@pytest.mark.timeout(600)
def test_ngram_speculation_gives_the_same_greedy_text_and_its_acceptance_reaches_the_stats():
    async def run():
        plain, engine = await answers(None)
        plain_stats = engine.stats()
        engine.shutdown()
        speculative, engine = await answers(NGRAM)
        stats = engine.stats()
        engine.shutdown()
        return plain, plain_stats, speculative, stats

    plain, plain_stats, speculative, stats = asyncio.run(run())
    assert speculative == plain
    assert plain_stats.spec_draft_tokens == 0 and plain_stats.spec_acceptance_rate is None
    assert stats.spec_draft_tokens > 0 and 0 <= stats.spec_accepted_tokens <= stats.spec_draft_tokens
    print(f"ngram speculation: {stats.spec_accepted_tokens} of {stats.spec_draft_tokens} drafted tokens accepted "
          f"({stats.spec_acceptance_rate:.0%})")
