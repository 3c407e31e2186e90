"""Router: the ingress deployment. OpenAI-compatible HTTP routes under FastAPI (`@serve.ingress`).

Per request: tokenize once with the model's own tokenizer (chat template applied here), classify, pick the lane,
stream the lane's answer back. Decisions live in plain modules (classes.py, openai_api.py); this is glue.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.config import load_app_config
from app.lanes.types import LaneChunk, LaneRequest, SamplingOptions
from app.router import openai_api as api
from app.router.classes import REQUEST_CLASS_HEADER, UnknownRequestClass, classify, policy_for

logger = logging.getLogger(__name__)

fastapi_app = FastAPI(title="llm-lanes", docs_url="/docs", openapi_url="/openapi.json")


@fastapi_app.exception_handler(api.OpenAIError)
async def _openai_error(_: Request, error: api.OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


@fastapi_app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    converted = api.validation_error(list(error.errors()))
    return JSONResponse(converted.body(), status_code=converted.status)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    converted = api.OpenAIError(error.status_code, str(error.detail), code="not_found" if error.status_code == 404
                                else None)
    return JSONResponse(converted.body(), status_code=error.status_code)


@fastapi_app.exception_handler(Exception)
async def _unexpected_error(_: Request, error: Exception) -> JSONResponse:
    # Never a stack trace to the client; the log has it.
    logger.exception("unhandled error")
    return JSONResponse(api.OpenAIError(500, "internal server error", type="server_error").body(), status_code=500)


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@serve.deployment(name="Router")
@serve.ingress(fastapi_app)
class Router:
    def __init__(self, app_args: dict[str, Any], hot_lane, cold_lane, prefix_cache):
        from transformers import AutoTokenizer

        self.cfg = load_app_config(app_args)
        self.lanes = {"hot": hot_lane, "cold": cold_lane}
        self.prefix_cache = prefix_cache
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.tokenizer_source)

    # ---- routes -------------------------------------------------------------------------------------------

    @fastapi_app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @fastapi_app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.cfg.model.served_name, "object": "model", "created": 0, "owned_by": "llm-lanes",
                      "max_model_len": self.cfg.model.max_model_len}],
        }

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, body: api.ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        if not body.messages:
            raise api.OpenAIError(400, "messages must hold at least one message", param="messages",
                                  code="empty_prompt")
        try:
            conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as error:
            raise api.OpenAIError(400, str(error), param="messages") from None
        if not any(m["content"].strip() for m in conversation):
            raise api.OpenAIError(400, "every message is empty: send some content", param="messages",
                                  code="empty_prompt")
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return await self._serve(body, request, token_ids, kind="chat")

    @fastapi_app.post("/v1/completions")
    async def completions(self, body: api.CompletionRequest, request: Request):
        self._check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise api.OpenAIError(400, "send one prompt per request (a list of several is not supported)",
                                      param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise api.OpenAIError(400, "prompt is empty", param="prompt", code="empty_prompt")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            token_ids = list(prompt)
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in token_ids):
                raise api.OpenAIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not token_ids:
            raise api.OpenAIError(400, "prompt is empty", param="prompt", code="empty_prompt")
        return await self._serve(body, request, token_ids, kind="completion")

    @fastapi_app.get("/v1/admin/stats")
    async def admin_stats(self) -> dict[str, Any]:
        async def ask(handle):
            try:
                return await asyncio.wait_for(handle.stats.remote(), timeout=5)
            except Exception as error:
                return {"error": str(error)}

        hot, cold, prefix = await asyncio.gather(ask(self.lanes["hot"]), ask(self.lanes["cold"]),
                                                 ask(self.prefix_cache))
        return {"lanes": {"hot": [hot], "cold": [cold]}, "prefix_cache": prefix}

    # ---- the request path ---------------------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.cfg.model.served_name:
            raise api.OpenAIError(404, f"model {model!r} does not exist: this server serves "
                                       f"{self.cfg.model.served_name!r}", param="model", code="model_not_found")

    def _max_tokens(self, body, prompt_tokens: int) -> int:
        limit = self.cfg.model.max_model_len
        requested = body.requested_max_tokens
        if prompt_tokens >= limit or (requested is not None and prompt_tokens + requested > limit):
            raise api.OpenAIError(
                400,
                f"this model's maximum context length is {limit} tokens; the request has {prompt_tokens} prompt "
                f"tokens and asks for {requested if requested is not None else 'at least 1'} completion tokens: "
                "shorten the prompt or lower max_tokens",
                param="max_tokens" if requested is not None and prompt_tokens < limit else "messages",
                code="context_length_exceeded",
            )
        if requested is not None:
            return requested
        return min(self.cfg.router.default_max_tokens, limit - prompt_tokens)

    async def _serve(self, body, request: Request, token_ids: list[int], kind: str):
        try:
            request_class = classify(body.service_tier, request.headers.get(REQUEST_CLASS_HEADER))
        except UnknownRequestClass as error:
            raise api.OpenAIError(400, str(error), param=error.param, code="invalid_request_class") from None
        policy = policy_for(request_class)
        max_tokens = self._max_tokens(body, len(token_ids))
        request_id = api.new_id("chatcmpl" if kind == "chat" else "cmpl")
        lane_request = LaneRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling=SamplingOptions(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                     stop=body.stop_list, seed=body.seed, ignore_eos=body.ignore_eos),
            request_class=request_class.value,
            priority=policy.priority,
        )
        lane = policy.lane.value
        headers = {"x-llm-lanes-lane": lane, "x-llm-lanes-request-class": request_class.value}
        stream = self.lanes[lane].options(stream=True).generate.remote(lane_request)
        try:
            # Wait for the first chunk before answering, so a failing lane still gets a proper status code.
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise api.OpenAIError(500, "the engine returned no output", type="server_error") from None
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as error:
            stream.cancel()
            logger.warning("lane %s failed request %s: %s", lane, request_id, error)
            raise api.OpenAIError(503, f"the {lane} lane could not serve the request; retry shortly",
                                  type="server_error", code="lane_unavailable", headers={"Retry-After": "1"}) from None
        model = self.cfg.model.served_name
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._sse_events(kind, request_id, model, first, stream, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(await self._collect(kind, request_id, model, first, stream), headers=headers)

    async def _collect(self, kind: str, request_id: str, model: str, first: LaneChunk, stream) -> dict[str, Any]:
        pieces, last = [first.text], first
        try:
            async for chunk in stream:
                pieces.append(chunk.text)
                last = chunk
        finally:
            stream.cancel()
        usage = api.usage(last.prompt_tokens, last.completion_tokens, last.cached_prompt_tokens)
        build = api.chat_response if kind == "chat" else api.completion_response
        return build(request_id, model, "".join(pieces), last.finish_reason, usage)

    async def _sse_events(self, kind: str, request_id: str, model: str, first: LaneChunk, stream,
                          include_usage: bool) -> AsyncIterator[str]:
        last = first
        try:
            if kind == "chat":
                yield _sse(api.chat_chunk(request_id, model, {"role": "assistant", "content": ""}))
            chunk: LaneChunk | None = first
            while chunk is not None:
                last = chunk
                if kind == "chat":
                    delta = {"content": chunk.text} if chunk.text else {}
                    yield _sse(api.chat_chunk(request_id, model, delta, chunk.finish_reason))
                else:
                    yield _sse(api.completion_chunk(request_id, model, chunk.text, chunk.finish_reason))
                chunk = await anext(stream, None)
            if include_usage:
                usage = api.usage(last.prompt_tokens, last.completion_tokens, last.cached_prompt_tokens)
                build = api.chat_chunk if kind == "chat" else api.completion_chunk
                empty = {} if kind == "chat" else ""
                yield _sse(build(request_id, model, empty, None, usage, with_choice=False))
            yield _sse("[DONE]")
        except Exception as error:
            logger.warning("stream %s failed: %s", request_id, error)
            yield _sse(api.OpenAIError(503, "the lane failed mid-stream", type="server_error").body())
        finally:
            # Client gone or stream done: cancelling propagates to the lane replica, which aborts the engine request.
            stream.cancel()
