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

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.batch import openai_shapes as batch_shapes
from app.batch.store import BatchStoreError, ClaimedLine, ConflictError, NotFoundError
from app.config import load_app_config
from app.lanes.types import LaneChunk, LaneRequest, SamplingOptions
from app.router import openai_api as api
from app.router.classes import REQUEST_CLASS_HEADER, UnknownRequestClass, classify, policy_for

logger = logging.getLogger(__name__)

fastapi_app = FastAPI(title="llm-lanes", docs_url="/docs", openapi_url="/openapi.json")


@fastapi_app.exception_handler(api.OpenAIError)
async def _openai_error(_: Request, error: api.OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


@fastapi_app.exception_handler(BatchStoreError)
async def _batch_store_error(_: Request, error: BatchStoreError) -> JSONResponse:
    status = 404 if isinstance(error, NotFoundError) else 409 if isinstance(error, ConflictError) else 400
    converted = api.OpenAIError(status, str(error), code={404: "not_found", 409: "conflict"}.get(status))
    return JSONResponse(converted.body(), status_code=status)


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


class CreateBatchRequest(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


@serve.deployment(name="Router")
@serve.ingress(fastapi_app)
class Router:
    async def __init__(self, app_args: dict[str, Any], hot_lane, cold_lane, prefix_cache):
        from transformers import AutoTokenizer

        from app.batch.dispatcher import BatchDispatcher
        from app.batch.store import open_batch_store
        from app.batch.window import ConcurrencyWindow

        self.cfg = load_app_config(app_args)
        self.lanes = {"hot": hot_lane, "cold": cold_lane}
        self.prefix_cache = prefix_cache
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.tokenizer_source)
        batch = self.cfg.batch
        self.batch_store = await asyncio.to_thread(open_batch_store, batch.store)
        # Every Router replica drains the durable queue; the store's leases keep two from running the same line.
        self.dispatcher = BatchDispatcher(
            self.batch_store, self._execute_batch_line,
            window=ConcurrencyWindow(min_size=batch.window_min, max_size=batch.window_max,
                                     target_latency_per_token_s=batch.target_latency_per_token_s,
                                     interval_s=batch.window_interval_s),
            lease_s=batch.lease_s, poll_interval_s=batch.poll_interval_s, max_attempts=batch.max_attempts,
        )
        self._dispatcher_task = asyncio.create_task(self.dispatcher.run())

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
        return await self._serve(body, request, kind="chat")

    @fastapi_app.post("/v1/completions")
    async def completions(self, body: api.CompletionRequest, request: Request):
        return await self._serve(body, request, kind="completion")

    def _chat_token_ids(self, body: api.ChatCompletionRequest) -> list[int]:
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
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _completion_token_ids(self, body: api.CompletionRequest) -> list[int]:
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
        return token_ids

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

    def _prepare(self, body, kind: str, class_header: str | None) -> tuple[LaneRequest, str]:
        """Validate, tokenize once, classify: everything before a lane is involved. Raises OpenAIError."""
        self._check_model(body.model)
        token_ids = self._chat_token_ids(body) if kind == "chat" else self._completion_token_ids(body)
        try:
            request_class = classify(body.service_tier, class_header)
        except UnknownRequestClass as error:
            raise api.OpenAIError(400, str(error), param=error.param, code="invalid_request_class") from None
        policy = policy_for(request_class)
        max_tokens = self._max_tokens(body, len(token_ids))
        lane_request = LaneRequest(
            request_id=api.new_id("chatcmpl" if kind == "chat" else "cmpl"),
            prompt_token_ids=token_ids,
            sampling=SamplingOptions(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                     stop=body.stop_list, seed=body.seed, ignore_eos=body.ignore_eos),
            request_class=request_class.value,
            priority=policy.priority,
        )
        return lane_request, policy.lane.value

    async def _start(self, lane: str, lane_request: LaneRequest):
        """Send to the lane and wait for the first chunk, so a failing lane still gets a proper status code."""
        stream = self.lanes[lane].options(stream=True).generate.remote(lane_request)
        try:
            return await stream.__anext__(), stream
        except StopAsyncIteration:
            raise api.OpenAIError(500, "the engine returned no output", type="server_error") from None
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as error:
            stream.cancel()
            logger.warning("lane %s failed request %s: %s", lane, lane_request.request_id, error)
            raise api.OpenAIError(503, f"the {lane} lane could not serve the request; retry shortly",
                                  type="server_error", code="lane_unavailable", headers={"Retry-After": "1"}) from None

    async def _serve(self, body, request: Request, kind: str):
        lane_request, lane = self._prepare(body, kind, request.headers.get(REQUEST_CLASS_HEADER))
        headers = {"x-llm-lanes-lane": lane, "x-llm-lanes-request-class": lane_request.request_class}
        first, stream = await self._start(lane, lane_request)
        model, request_id = self.cfg.model.served_name, lane_request.request_id
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._sse_events(kind, request_id, model, first, stream, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(await self._collect(kind, request_id, model, first, stream), headers=headers)

    # ---- batch API (OpenAI Files + Batches) ---------------------------------------------------------------

    @fastapi_app.post("/v1/files")
    async def upload_file(self, file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:
        if purpose != "batch":
            raise api.OpenAIError(400, f"purpose {purpose!r} is not supported: use 'batch'", param="purpose")
        limit = self.cfg.batch.max_file_bytes
        content = await file.read(limit + 1)
        if len(content) > limit:
            raise api.OpenAIError(413, f"file is larger than the {limit}-byte limit: split it into several batches",
                                  param="file", code="file_too_large")
        record = await asyncio.to_thread(self.batch_store.create_file, purpose, file.filename or "batch.jsonl",
                                         content)
        return batch_shapes.file_object(record)

    @fastapi_app.get("/v1/files/{file_id}")
    async def get_file(self, file_id: str) -> dict[str, Any]:
        return batch_shapes.file_object(await asyncio.to_thread(self.batch_store.get_file, file_id))

    @fastapi_app.get("/v1/files/{file_id}/content")
    async def get_file_content(self, file_id: str) -> Response:
        content = await asyncio.to_thread(self.batch_store.file_content, file_id)
        return Response(content, media_type="application/jsonl")

    @fastapi_app.post("/v1/batches")
    async def create_batch(self, body: CreateBatchRequest) -> dict[str, Any]:
        record = await asyncio.to_thread(self.batch_store.create_batch, body.input_file_id, body.endpoint,
                                         body.completion_window, body.metadata)
        return batch_shapes.batch_object(record)

    @fastapi_app.get("/v1/batches/{batch_id}")
    async def get_batch(self, batch_id: str) -> dict[str, Any]:
        return batch_shapes.batch_object(await asyncio.to_thread(self.batch_store.get_batch, batch_id))

    @fastapi_app.get("/v1/batches")
    async def list_batches(self, after: str | None = None, limit: int = Query(20, ge=1, le=100)) -> dict[str, Any]:
        page = await asyncio.to_thread(self.batch_store.list_batches, after, limit)
        return batch_shapes.list_object([batch_shapes.batch_object(b) for b in page.data], page.has_more)

    @fastapi_app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(self, batch_id: str) -> dict[str, Any]:
        record = await asyncio.to_thread(self.batch_store.cancel_batch, batch_id)
        return batch_shapes.batch_object(record)

    async def _execute_batch_line(self, line: ClaimedLine) -> dict[str, Any]:
        """One batch line through the same validation and lane path as an HTTP request, at batch class."""
        kind = "chat" if line.url == "/v1/chat/completions" else "completion"
        model = api.ChatCompletionRequest if kind == "chat" else api.CompletionRequest
        try:
            body = model.model_validate({**line.body, "stream": False, "service_tier": "flex"})
            lane_request, lane = self._prepare(body, kind, None)
            first, stream = await self._start(lane, lane_request)
            response = await self._collect(kind, lane_request.request_id, self.cfg.model.served_name, first, stream)
            return {"status_code": 200, "body": response, "request_id": lane_request.request_id}
        except ValidationError as error:
            converted = api.validation_error(error.errors())
            return {"status_code": converted.status, "body": converted.body()}
        except api.OpenAIError as error:
            return {"status_code": error.status, "body": error.body()}

    async def __del__(self):
        # Graceful shutdown: let in-flight lines finish recording; anything left is re-leased after lease_s.
        self.dispatcher.stop()
        try:
            await asyncio.wait_for(self._dispatcher_task, timeout=10)
        except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
            pass

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
