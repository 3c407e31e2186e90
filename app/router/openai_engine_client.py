"""The engine client under vLLM's OpenAI serving classes at the Router (the OpenAI-surface adapter's other half,
beside app/router/openai_surface.py): its `generate()` launches each rendered prompt through the request pipeline
and hands vLLM's code the RequestOutputs that come back from the lane, as a local engine's would be.

`Scope` is one client request while vLLM's code handles it (the context variable SCOPE carries it into
`generate()`); `client_events` is the SSE stream handed to the client.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from app.lanes.engine import check_adapter
from app.lanes.types import AdapterRef
from app.router import openai_api as api
from app.router.endpoints import Generation
from app.router.handoff import handoff_blocker
from app.router.sse import line_safe

# Launches one Generation through the pipeline; returns the started LaneCall (its first chunk in hand).
Launch = Callable[[Generation], Awaitable[Any]]


@dataclass
class Scope:
    """One client request while vLLM's serving code handles it: how to launch its prompts, and what happened."""

    launch: Launch
    calls: list[Any] = field(default_factory=list)
    # Raised by a launch (before the answer started): the answer's status.
    error: BaseException | None = None
    # Raised by a lane call after its start: a stream ends with this error's event, not vLLM's generic one.
    stream_error: api.OpenAIError | None = None
    # The output generators handed to vLLM's code: closed with the answer, so a client who leaves ends its lane calls
    # now (vLLM's stream generator does not close the generators it reads).
    generators: list[Any] = field(default_factory=list)

    async def close(self) -> None:
        for generator in self.generators:
            try:
                await generator.aclose()
            except RuntimeError:  # still running in a task of vLLM's, which cancels it itself
                pass


SCOPE: contextvars.ContextVar[Scope] = contextvars.ContextVar("llm_lanes_openai_scope")


class LaneEngineClient:
    """The engine client vLLM's serving classes call: model and renderer from the Router's VllmConfig, and
    generate() through the request pipeline (the Scope of the request being served)."""

    errored = False
    dead_error = None
    is_running = True

    def __init__(self, vllm_config, renderer, max_lora_rank: int | None = None):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer
        # Engine-side input processing (logit_bias ids, max logprobs, grammar compile) happens in the lane's AsyncLLM.
        self.input_processor = None
        self.max_lora_rank = max_lora_rank  # the lanes' smallest (an adapter must fit every lane); None: no LoRA

    def check_admission(self, n: int = 1) -> None:
        """Admission is the pipeline's (per class, with 429 + Retry-After), at launch."""

    async def add_lora(self, lora_request) -> None:
        """vLLM's OpenAIServingModels asks before it lists an adapter whether it can be loaded: its files and rank
        here (check_adapter); the lanes' engines load it at the first request naming it."""
        check_adapter(lora_request.lora_name, lora_request.lora_path, self.max_lora_rank,
                      self.model_config.max_model_len)

    def generate(self, engine_input, sampling_params, request_id: str, **kwargs):
        if not engine_input.get("prompt_token_ids"):
            # The engine refuses it too, but only once the pipeline has admitted the request: under load the client
            # would be told 429 for a request that can never succeed. Raised here, before any prompt of the request
            # is launched (vLLM's serving code asks for every prompt's generator first).
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError("The decoder prompt cannot be empty", parameter="prompt")
        scope = SCOPE.get()
        outputs = lane_outputs(scope, engine_input, sampling_params, request_id, kwargs)
        scope.generators.append(outputs)
        return outputs


async def lane_outputs(scope: Scope, engine_input, params, request_id: str, kwargs: dict) -> AsyncIterator[Any]:
    """The RequestOutputs of one prompt, from the lane call the pipeline starts for it."""
    from vllm.sampling_params import RequestOutputKind

    token_ids = list(engine_input["prompt_token_ids"])
    engine_kwargs = {k: v for k, v in kwargs.items()
                     if k in ("reasoning_ended", "reasoning_parser_kwargs") and v is not None}
    lora = kwargs.get("lora_request")
    adapter = AdapterRef(lora.lora_name, lora.lora_int_id, lora.lora_path) if lora is not None else None
    generation = Generation(request_id=request_id, prompt_token_ids=token_ids, max_tokens=params.max_tokens,
                            stop=tuple(params.stop or ()), stream=params.output_kind != RequestOutputKind.FINAL_ONLY,
                            engine_params=params, engine_kwargs=engine_kwargs, handoff_blocker=handoff_blocker(params),
                            adapter=adapter)
    try:
        call = await scope.launch(generation)
    except BaseException as error:
        scope.error = error
        raise
    scope.calls.append(call)
    folded = None
    cached_tokens = None
    try:
        # Closed with this generator (client gone): the lane call ends, which aborts the engine request.
        async with contextlib.aclosing(call.chunks()) as chunks:
            async for chunk in chunks:
                for output in client_outputs(chunk, token_ids, cached_tokens):
                    if cached_tokens is None:
                        cached_tokens = output.num_cached_tokens
                    if generation.stream:
                        yield output
                    elif folded is None:
                        folded = output
                    else:
                        folded.add(output, aggregate=True)
    except api.OpenAIError as error:
        scope.stream_error = error
        raise
    if folded is not None:
        yield folded


def client_outputs(chunk, token_ids: list[int], cached_tokens: int | None) -> list[Any]:
    """A lane chunk's RequestOutput as the client's engine would have sent it."""
    output = chunk.output
    if output is None:
        return []
    # The lane strips the prompt from its outputs (one copy per chunk would cross Ray); a decode handoff's
    # continuation has the hot part's tokens in its prompt: the client's prompt is this one either way.
    output.prompt_token_ids = token_ids
    if cached_tokens is not None:
        output.num_cached_tokens = cached_tokens
    if chunk.finish_reason is None and output.finished:
        # The hot part of a decode handoff ended at the handoff point: the answer goes on.
        output.finished = False
        for completion in output.outputs:
            completion.finish_reason = completion.stop_reason = None
    return [output]


async def client_events(first: str | None, rest: AsyncIterator[str], scope: Scope) -> AsyncIterator[str]:
    """vLLM's SSE events, line-safe; a lane's failure mid-stream ends them with its own error event (status, code,
    Retry-After reason) in place of vLLM's generic one."""
    try:
        if first is not None:
            yield line_safe(first)
        async for event in rest:
            if scope.stream_error is not None and event.startswith("data: {\"error\""):
                yield f"data: {json.dumps(scope.stream_error.body())}\n\n"
                return
            yield line_safe(event)
    finally:
        await rest.aclose()
        await scope.close()
