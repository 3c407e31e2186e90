"""The OpenAI-surface adapter: vLLM's own OpenAI protocol code at the Router. With app/router/openai_engine_client.py
(the engine client under vLLM's serving classes), the only Router modules that import vllm.

Design. vLLM's server answers a chat or completion request in three steps: its protocol models validate the body
(`ChatCompletionRequest` / `CompletionRequest`), `OpenAIServingChat` / `OpenAIServingCompletion` render the prompt
(chat template, tools, `OnlineRenderer`), turn the request into `SamplingParams` (`to_sampling_params`: penalties,
logit_bias, top_k, seed, stop, n, logprobs, structured outputs from `response_format` and `tool_choice`), hand it to
an `EngineClient.generate()`, and render the `RequestOutput`s they get back (n choices, logprobs, echo, tool calls
through the configured `ToolParserManager` parser, reasoning content, usage). Ray Serve LLM runs those serving
classes next to the engine in its LLMServer replica. Here the engine is one hop away, behind the Router's own
mechanisms (classes, admission, prefix routing, spill, deadlines, decode handoff), so the Router runs vLLM's serving
classes over a `LaneEngineClient`: an engine client whose `generate()` is the request pipeline. The rendered token
ids and vLLM's SamplingParams travel in the LaneRequest (opaque to the lanes' types); the lane's engine adapter
(app/lanes/engine.py) hands them to its AsyncLLM unchanged and sends the RequestOutputs back in its LaneChunks; here
they go into vLLM's renderers as if from a local engine. Every field vLLM's server honours is thereby honoured with
the same meaning, and every body it refuses is refused with its status and parameter.

What the Router adds around vLLM's code: the bounds checked before any tokenization (`check_bounds`), the request
class from `service_tier` or the class header, the default max_tokens (`router.default_max_tokens` where vLLM's
server would use the whole context), and the `x-llm-lanes-*` headers. A request whose answer the decode handoff
cannot carry (more than one choice, logprobs, echo's prompt logprobs, structured output, penalties or a seed: the
continuation is a new engine request) skips the handoff, and `x-llm-lanes-degraded` says so (`handoff_skipped`).

vLLM versions. Written against vLLM 0.32 (the CPU build here); the GPU payload runs 0.26, whose wheel has the same
layout for the protocol models, serving classes and renderers (`vllm.entrypoints.openai.chat_completion` /
`completion` / `models`, `vllm.renderers.OnlineRenderer`). Where they differ: `load_chat_template` is in
`vllm.entrypoints.chat_utils` (0.32: `vllm.renderers.chat_utils`); `ErrorResponse` in
`vllm.entrypoints.openai.engine.protocol` (0.32: `vllm.entrypoints.serve.engine.protocol`); `create_error_response`
in `vllm.entrypoints.serve.utils.error_response` (0.32: `...serve.exception_handling.error_response`); 0.26 has no
`EngineArgs.create_structured_outputs_config` (merged here as its create_engine_config does); OnlineRenderer and
OpenAIServingChat lack 0.32's `tool_strict_level` and `trust_request_mm_kwargs`, so constructor arguments go
through `_accepted()`. The suite runs 0.32; `load_tests.surface_check` renders every differential request with
another vLLM's Python code and no engine (0.26 from the payload's wheel), and `load_tests.openai_differential` runs
the comparison with vLLM's own server wherever the app runs (load_tests/configs/gpu-tiny-differential.yaml).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from app.config import AppConfig
from app.lanes.engine import check_adapter, engine_args_dict
from app.lanes.types import AdapterRef
from app.router import openai_api as api
from app.router.endpoints import Answer, Endpoint
from app.router.openai_engine_client import SCOPE, LaneEngineClient, Launch, Scope, client_events

logger = logging.getLogger(__name__)



def _import_vllm():
    """vLLM's protocol and serving names (the same modules in 0.26 and 0.32)."""
    import vllm.sampling_params as sampling
    from vllm.entrypoints.openai.chat_completion import protocol as chat_protocol
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion import protocol as completion_protocol
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    return sampling, chat_protocol, completion_protocol, OpenAIServingChat, OpenAIServingCompletion


@functools.cache  # asked on every answer: an import statement per request costs ~1 % of a Router's CPU
def _error_response_type():
    try:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.openai.engine.protocol import ErrorResponse
    return ErrorResponse


def _create_error_response(error: Exception):
    try:
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.serve.utils.error_response import create_error_response
    return create_error_response(error)


def _load_chat_template(template: str | None):
    try:
        from vllm.renderers.chat_utils import load_chat_template
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.chat_utils import load_chat_template
    return load_chat_template(template)


def _accepted(constructor, **kwargs) -> dict[str, Any]:
    """The keyword arguments `constructor` takes (vLLM's constructors gain options between versions)."""
    parameters = inspect.signature(constructor).parameters
    return {name: value for name, value in kwargs.items() if name in parameters}


class _PipelineRefusalFilter(logging.Filter):
    """Drops vLLM's "Error in ... stream generator" records whose exception is the pipeline's own answer (a 429,
    503 or 504 with its OpenAI body, which the client gets): under overload every refusal would otherwise format
    and write a full traceback, on the Router's event loop, for an outcome that is not an error of the server."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, api.OpenAIError)


# The modules of vLLM's serving classes whose stream generators log an exception raised by generate().
_STREAM_GENERATOR_LOGGERS = ("vllm.entrypoints.openai.chat_completion.serving",
                             "vllm.entrypoints.openai.completion.serving")


def _quiet_pipeline_refusals() -> None:
    refusal_filter = _PipelineRefusalFilter()
    for name in _STREAM_GENERATOR_LOGGERS:
        stream_logger = logging.getLogger(name)
        if not any(isinstance(f, _PipelineRefusalFilter) for f in stream_logger.filters):
            stream_logger.addFilter(refusal_filter)



def _error_from_response(error_response) -> api.OpenAIError:
    """vLLM's ErrorResponse -> our OpenAIError (same status, message and parameter)."""
    info = error_response.error
    status = int(info.code)
    code = {400: "invalid_value", 404: "model_not_found"}.get(status)  # vLLM's code is the status itself
    return api.OpenAIError(status, info.message, type="invalid_request_error" if status < 500 else "server_error",
                           param=info.param, code=code)


def _error_from_exception(error: Exception) -> api.OpenAIError:
    """What vLLM's server answers for an exception its serving code raises (its exception handlers' mapping)."""
    return _error_from_response(_create_error_response(error))


def _structured_outputs_config(engine_args):
    """The engine arguments' structured-outputs config with the reasoning parser merged in. 0.32 has a method for
    it; 0.26 merges inside create_engine_config, which also builds the device and parallel configs the Router has no
    use for, so the same two assignments are made here."""
    if hasattr(engine_args, "create_structured_outputs_config"):
        return engine_args.create_structured_outputs_config()
    config = engine_args.structured_outputs_config
    if engine_args.reasoning_parser:
        config.reasoning_parser = engine_args.reasoning_parser
    if getattr(engine_args, "reasoning_parser_plugin", None):
        config.reasoning_parser_plugin = engine_args.reasoning_parser_plugin
    return config


class OpenAISurface:
    """vLLM's OpenAI serving classes over the request pipeline, for one served model."""

    def __init__(self, cfg: AppConfig):
        self.cfg = cfg
        (self._sampling, self._chat_protocol, self._completion_protocol, serving_chat,
         serving_completion) = _import_vllm()
        self._build_serving(serving_chat, serving_completion)
        _quiet_pipeline_refusals()
        import vllm

        self.vllm_version = vllm.__version__
        self.tokenizer = self.renderer.tokenizer
        # The longest text one token stands for: a prompt's token count is at least its length over this.
        self.max_token_chars = max(
            (len(t) for t in self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))), default=1)

    def _build_serving(self, serving_chat, serving_completion) -> None:
        """The Router's VllmConfig (model only: no engine here) and the serving classes over it, as vLLM's
        CPU-only render server builds them (vllm/entrypoints/launchers/render). 0.32's constructors."""
        from vllm import AsyncEngineArgs, envs
        from vllm.config import VllmConfig
        from vllm.entrypoints.openai.models.protocol import BaseModelPath, LoRAModulePath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
        from vllm.renderers import renderer_from_config
        from vllm.renderers.online_renderer import OnlineRenderer

        cfg, model = self.cfg, self.cfg.model
        args = engine_args_dict(cfg, cfg.hot_lane.engine)
        args.pop("kv_events_config", None)
        engine_args = AsyncEngineArgs(**args, reasoning_parser=model.reasoning_parser or "")
        model_config = engine_args.create_model_config()
        model_config.quantization = None  # rendering only: no kernels here
        envs.VLLM_CPU_KVCACHE_SPACE = 0  # no KV cache here either (silences the CPU platform's check)
        vllm_config = VllmConfig(model_config=model_config,
                                 structured_outputs_config=_structured_outputs_config(engine_args))
        self.renderer = renderer_from_config(vllm_config)
        self.engine_client = LaneEngineClient(vllm_config, self.renderer, cfg.max_lora_rank)
        chat_template = _load_chat_template(model.chat_template)
        self.models = OpenAIServingModels(
            engine_client=self.engine_client,
            base_model_paths=[BaseModelPath(name=model.served_name, model_path=model.source)],
            lora_modules=[LoRAModulePath(name=adapter.name, path=adapter.path, base_model_name=model.served_name)
                          for adapter in model.adapters] or None)
        common = dict(chat_template=chat_template, chat_template_content_format="auto",
                      enable_auto_tools=model.enable_auto_tool_choice, tool_parser=model.tool_call_parser,
                      reasoning_parser=model.reasoning_parser or "")
        self.online_renderer = OnlineRenderer(model_config, self.renderer, **_accepted(
            OnlineRenderer, request_logger=None, trust_request_chat_template=False, trust_request_mm_kwargs=False,
            exclude_tools_when_tool_choice_none=False, tool_strict_level="auto", default_chat_template_kwargs=None,
            log_error_stack=False, **common))
        if hasattr(self.online_renderer, "warmup"):  # 0.32: loads the template and parsers now, not at a request
            self.online_renderer.warmup()
        self.chat = serving_chat(self.engine_client, self.models, "assistant", **_accepted(
            serving_chat, online_renderer=self.online_renderer, request_logger=None,
            enable_prompt_tokens_details=True, **common))
        self.completion = serving_completion(self.engine_client, self.models, online_renderer=self.online_renderer,
                                             request_logger=None, enable_prompt_tokens_details=True)
        self.tokenization = ServingTokenization(self.models, self.online_renderer, request_logger=None,
                                                chat_template=chat_template, chat_template_content_format="auto")
        for serving in (self.chat, self.completion):
            # Without max_tokens the answer is router.default_max_tokens long at most, not the whole context.
            serving.default_sampling_params.setdefault("max_tokens", cfg.router.default_max_tokens)

    # ---- parse -----------------------------------------------------------------------------------------------------

    def request_model(self, endpoint: Endpoint):
        if endpoint.chat:
            return self._chat_protocol.ChatCompletionRequest
        return self._completion_protocol.CompletionRequest

    def parse(self, endpoint: Endpoint, body: Any):
        """A JSON body -> vLLM's request model; 400 naming the parameter for what vLLM's server refuses."""
        if not isinstance(body, dict):
            raise api.OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
        bad = next((key for key, value in body.items() if api.has_lone_surrogate(value)), None)
        if bad is not None:
            raise api.OpenAIError(400, f"{bad}: holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text",
                                  param=bad, code="invalid_value")
        try:
            request = self.request_model(endpoint).model_validate(body)
        except ValidationError as error:
            raise _validation_error(error, api.tool_calls_place(error.errors(), body.get("messages"))) from None
        except Exception as error:  # vLLM's own checks (VLLMValidationError and the like) outside pydantic's
            raise _error_from_exception(error) from None
        if endpoint.chat:
            api.check_messages(request.messages, body["messages"], api.content_part_types(type(request)),
                               _validation_error)
        api.refuse_unrecognized_fields(request, body, chat=endpoint.chat)
        if getattr(request, "priority", 0):
            # The request class sets the engine priority here (realtime, interactive, batch; spills adjust it).
            raise api.OpenAIError(400, "priority: the engine priority follows the request class here: ask for a "
                                       "class with service_tier or the X-Request-Class header",
                                  param="priority", code="unsupported_parameter")
        return request

    def check_bounds(self, endpoint: Endpoint, body: dict[str, Any]) -> None:
        """Refuse, before any tokenization, what is certainly over the limits: too many choices or messages, or a
        prompt whose text needs more than max_model_len tokens even if every token were the vocabulary's longest."""
        limit = self.cfg.model.max_model_len
        api.check_counts(body, chat=endpoint.chat, max_choices=self.cfg.router.max_choices,
                         max_messages=self.cfg.router.max_messages)
        chars = api.text_chars(body.get("messages") if endpoint.chat else body.get("prompt"))
        if chars // self.max_token_chars > limit:
            raise api.OpenAIError(400, f"this model's maximum context length is {limit} tokens and the "
                                       f"{endpoint.prompt_param} ({chars} characters) needs at least "
                                       f"{chars // self.max_token_chars}: shorten it",
                                  param=endpoint.prompt_param, code="context_length_exceeded")

    async def load_static_adapters(self) -> None:
        """List model.adapters; ValueError names the first that cannot be served (`LaneEngineClient.add_lora`)."""
        await self.models.init_static_loras()

    def check_adapter_folder(self, name: str, path: str) -> None:
        """ValueError naming adapter `name` and why, if its folder cannot be served here (files, rank)."""
        check_adapter(name, path, self.cfg.max_lora_rank, self.cfg.model.max_model_len)

    def set_runtime_adapters(self, adapters: Iterable[AdapterRef]) -> None:
        """The adapters loaded at run time (the store's ready ones) beside model.adapters, under the ids the store
        gave them: vLLM's serving models list them and serve the requests that name them; one no longer given is no
        longer served."""
        from vllm.lora.request import LoRARequest

        static = {adapter.name for adapter in self.cfg.model.adapters}
        wanted = {adapter.name: adapter for adapter in adapters if adapter.name not in static}
        served = self.models.lora_requests
        for name in [name for name in served if name not in static and name not in wanted]:
            del served[name]
        for name, adapter in wanted.items():
            if name not in served or served[name].lora_int_id != adapter.id:
                lora = LoRARequest(lora_name=name, lora_int_id=adapter.id, lora_path=adapter.path)
                lora.base_model_name = self.cfg.model.served_name
                served[name] = lora

    async def model_cards(self) -> list[dict[str, Any]]:
        """vLLM's GET /v1/models: the base model, then each adapter (parent: the base model, root: its folder)."""
        return [card.model_dump(mode="json") for card in (await self.models.show_available_models()).data]

    def serves_model(self, name: Any) -> bool:
        """Whether model `name` is served (none: the base model; or an adapter); else vLLM's code answers 404."""
        return not name or (isinstance(name, str) and (self.models.is_base_model(name)
                                                       or name in self.models.lora_requests))

    def check_sampling(self, endpoint: Endpoint, request, max_tokens: int) -> None:
        """Refuse (400, as vLLM's server does) what vLLM's serving code refuses of the request's sampling parameters,
        without rendering its prompt: for a request the load refuses before rendering (a 429), which must not be what
        the client's own mistake would be answered with."""
        serving = self.chat if endpoint.chat else self.completion
        try:
            request.to_sampling_params(max_tokens, serving.default_sampling_params)
        except Exception as error:
            raise _error_from_exception(error) from None

    # ---- answer ----------------------------------------------------------------------------------------------------

    async def answer(self, endpoint: Endpoint, request, launch: Launch) -> Answer:
        """vLLM's serving code on `request`, each prompt launched through `launch` (the pipeline). Raises
        OpenAIError with the status vLLM's server, or the pipeline (429, 503, 504...), answers."""
        scope = Scope(launch)
        token = SCOPE.set(scope)
        try:
            if endpoint.chat:
                result = await self.chat.create_chat_completion(request, None)
            else:
                result = await self.completion.create_completion(request, None)
        except api.OpenAIError:
            raise
        except Exception as error:
            if scope.error is not None:
                raise scope.error from None
            raise _error_from_exception(error) from None
        finally:
            SCOPE.reset(token)
        if scope.error is not None:
            raise scope.error
        if isinstance(result, _error_response_type()):
            raise _error_from_response(result)
        if hasattr(result, "model_dump"):
            return Answer(scope.calls, response=result.model_dump(mode="json", exclude_none=False))
        # A stream: its first event comes after the first prompt started on its lane (or failed to).
        try:
            first = await anext(result)
        except StopAsyncIteration:
            first = None
        if scope.error is not None:
            await result.aclose()
            await scope.close()
            raise scope.error
        return Answer(scope.calls, events=client_events(first, result, scope))

    # ---- tokenize / detokenize -------------------------------------------------------------------------------------

    async def tokenize(self, body: Any) -> dict[str, Any]:
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest

        model = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
        return await self._tokenization_call(model, body, self.tokenization.create_tokenize)

    async def detokenize(self, body: Any) -> dict[str, Any]:
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

        return await self._tokenization_call(DetokenizeRequest, body, self.tokenization.create_detokenize)

    async def _tokenization_call(self, model, body: Any, call) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise api.OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
        if api.has_lone_surrogate(body):
            raise api.OpenAIError(400, "the body holds a lone UTF-16 surrogate, which is not text")
        try:
            request = model.model_validate(body)
            if "messages" in model.model_fields:
                api.check_messages(request.messages, body["messages"], api.content_part_types(model),
                                   _validation_error)
            unrecognized = api.unrecognized_arguments(dict(api.extra_fields(request)), honoured=frozenset(),
                                                       completion_request=False)
            if unrecognized is not None:
                raise unrecognized
            result = await call(request, None)
        except ValidationError as error:
            raise _validation_error(error) from None
        except api.OpenAIError:
            raise
        except Exception as error:
            raise _error_from_exception(error) from None
        if isinstance(result, _error_response_type()):
            raise _error_from_response(result)
        return result.model_dump(mode="json")



def _validation_error(error: ValidationError, prefix: tuple = ()) -> api.OpenAIError:
    """pydantic's errors on vLLM's request model -> one 400 naming the first parameter, as vLLM's server does; of a
    union, the errors of the member the value was meant for (`messages.0.role`, not each message type's). `prefix`:
    where the value that failed sits in the request."""
    from vllm.exceptions import VLLMValidationError

    errors = api.narrow_union_errors([{**e, "loc": prefix + tuple(e["loc"])} for e in error.errors()])
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    context_error = (first.get("ctx") or {}).get("error")
    param = getattr(context_error, "parameter", None) if isinstance(context_error, VLLMValidationError) else None
    if param is None:
        param = api.error_param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return api.OpenAIError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")
