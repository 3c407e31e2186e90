"""The OpenAI surface on whatever vLLM is importable, without an engine: every request of the OpenAI differential
(load_tests/openai_differential.py) is parsed, rendered and turned into sampling parameters by that vLLM's code, the
launch hands back engine outputs made with that vLLM's own RequestOutput / CompletionOutput (a tool call where the
request has tools), and the answer is rendered by its serving classes, streamed and not; every bad request must be
refused before launch or reach it (the engine's own checks refuse the rest), every malformed message must be refused
before launch naming its place, and the engine adapter must read that vLLM's own refusal errors as the client's. It
finds API differences between vLLM versions on a machine without their engine, e.g. the GPU payload's vLLM 0.26 on
the CPU host:

    mkdir -p /tmp/vllm026 && unzip -q -o .gpu/cache/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl 'vllm/*' \
        -d /tmp/vllm026
    PYTHONPATH=/tmp/vllm026:$PWD .venv/bin/python -m load_tests.surface_check

(a vLLM build for another device cannot infer one here, so the check runs it on vLLM's CPU platform). Prints what
failed and exits 1 if anything did. Rendering only: what the engine does with the parameters is the differential's
to compare.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PLAIN_TEXT = " the event loop runs"
LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")


class Refused(Exception):
    """The launch of a request that should have been refused before it."""


class FakeCall:
    """A lane call whose chunks hold engine outputs made with the importable vLLM's own classes."""

    def __init__(self, generation: Any, token_ids: list[int], tokenizer: Any):
        self.generation, self.token_ids, self.tokenizer = generation, token_ids, tokenizer

    def headers(self) -> dict[str, str]:
        return {}

    def _output(self, ids: list[int], finished: bool) -> Any:
        from vllm.outputs import CompletionOutput, RequestOutput

        completions = [CompletionOutput(index=i, text=self.tokenizer.decode(ids), token_ids=ids,
                                        cumulative_logprob=None, logprobs=None,
                                        finish_reason="length" if finished else None)
                       for i in range(self.generation.engine_params.n)]
        return RequestOutput(self.generation.request_id, None, None, None, completions, finished=finished,
                             num_cached_tokens=0)

    async def chunks(self):
        from app.lanes.types import LaneChunk

        ids, prompt = self.token_ids, len(self.generation.prompt_token_ids)
        half = len(ids) // 2 if self.generation.stream else 0
        if half:
            yield LaneChunk(text="", completion_tokens=half, prompt_tokens=prompt,
                            output=self._output(ids[:half], finished=False))
        yield LaneChunk(text="", completion_tokens=len(ids), prompt_tokens=prompt, finish_reason="length",
                        output=self._output(ids[half:], finished=True))


def rendered_requests() -> list[tuple[str, dict]]:
    """The differential's requests this check can answer: those without engine logprobs (the differential compares
    those)."""
    from load_tests.openai_differential import REQUESTS

    return [(path, body) for path, body in REQUESTS
            if not any(field in body for field in LOGPROB_FIELDS) and not body.get("echo")]


def _surface():
    try:
        from vllm.config import DeviceConfig

        DeviceConfig(device="auto")
    except RuntimeError:  # a build for a device this host lacks: render on vLLM's CPU platform
        import vllm.platforms as platforms
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()
    from app.config import AppConfig
    from app.router.openai_surface import OpenAISurface

    document = yaml.safe_load((REPO / "serve_configs" / "local.yaml").read_text(encoding="utf-8"))
    args = document["applications"][0]["args"]
    args["model"]["source"] = str(REPO / args["model"]["source"])
    return OpenAISurface(AppConfig.model_validate(args))


async def check(surface) -> tuple[int, list[str]]:
    """(requests answered, problems)."""
    from app.router import openai_api as api
    from app.router.endpoints import ENDPOINTS_BY_PATH
    from load_tests.openai_differential import BAD_REQUESTS, PLACED, expanded

    model, tokenizer = surface.cfg.model.served_name, surface.tokenizer
    answered, problems = 0, []
    for path, body in rendered_requests():
        for stream in (False, True):
            path, request_body = expanded(path, {**body, "stream": stream}, model)
            endpoint = ENDPOINTS_BY_PATH[path]
            wants_call = bool(request_body.get("tools")) and request_body.get("tool_choice") != "none"
            token_ids = tokenizer.encode(TOOL_CALL_TEXT if wants_call else PLAIN_TEXT, add_special_tokens=False)

            async def launch(generation, token_ids=token_ids):
                return FakeCall(generation, token_ids, tokenizer)

            what = f"stream={stream} {json.dumps(request_body)[:200]}"
            try:
                surface.check_bounds(endpoint, request_body)
                answer = await surface.answer(endpoint, surface.parse(endpoint, request_body), launch)
                if answer.events is not None:
                    events = [event async for event in answer.events]
                    if events[-1].strip() != "data: [DONE]" or any('"error"' in e for e in events):
                        problems.append(f"{what}: stream ended {events[-2:]}")
                        continue
                else:
                    choices = answer.response["choices"]
                    if wants_call and endpoint.chat and not choices[0]["message"].get("tool_calls"):
                        problems.append(f"{what}: no tool_calls in {choices[0]['message']}")
                        continue
                answered += 1
            except Exception as error:  # noqa: BLE001 - every failure is reported, the check goes on
                problems.append(f"{what}: {error!r}"[:500])

    async def refuse(generation):
        raise Refused

    for path, body in BAD_REQUESTS:
        path, request_body = expanded(path, body, model)
        endpoint = ENDPOINTS_BY_PATH[path]
        try:
            surface.check_bounds(endpoint, request_body)
            await surface.answer(endpoint, surface.parse(endpoint, request_body), refuse)
            problems.append(f"bad request answered: {json.dumps(request_body)[:200]}")
        except api.OpenAIError as error:
            if error.status >= 500:
                problems.append(f"bad request {json.dumps(request_body)[:160]}: {error.status} {error}")
        except Refused:
            pass  # reached the engine, whose own input checks refuse it (the differential compares those)
    for place, (path, body) in PLACED:
        path, request_body = expanded(path, body, model)
        endpoint = ENDPOINTS_BY_PATH[path]
        try:
            await surface.answer(endpoint, surface.parse(endpoint, request_body), refuse)
            problems.append(f"malformed message answered: {json.dumps(request_body)[:200]}")
        except api.OpenAIError as error:
            if (error.status, error.param) != (400, place):
                problems.append(f"malformed message {json.dumps(request_body)[:160]}: {error.status} {error.param} "
                                f"{error}, not 400 naming {place}")
        except Refused:
            problems.append(f"malformed message launched: {json.dumps(request_body)[:200]}")
    return answered, problems


def engine_refusal_problems() -> list[str]:
    """The engine adapter's reading of the errors this vLLM's engine raises for a request it refuses (a logprobs
    count over its maximum, a token id outside the vocabulary): the client's 400 naming the parameter, never the
    lane's failure."""
    from vllm.exceptions import VLLMValidationError

    from app.lanes.engine import request_invalid

    refusals = [(VLLMValidationError("Requested sample logprobs of 1000, which is greater than max allowed: 20",
                                     parameter="logprobs", value=1000), "logprobs"),
                (ValueError("Token id 99999 is out of vocabulary"), None)]
    problems = []
    for error, param in refusals:
        invalid = request_invalid(error)
        if invalid is None or invalid.param != param:
            problems.append(f"engine refusal {error!r} read as {invalid!r}, not the client's error on {param}")
    return problems


def main() -> int:
    import vllm

    answered, problems = asyncio.run(check(_surface()))
    problems += engine_refusal_problems()
    for problem in problems:
        print("FAILED", problem)
    print(f"vLLM {vllm.__version__}: {answered} requests answered, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
