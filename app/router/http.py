"""Router: the ingress deployment. OpenAI-compatible HTTP routes under FastAPI (`@serve.ingress`).

Per request: tokenize once with the model's own tokenizer (chat template applied here), classify, pick the lane,
stream the lane's answer back. Decisions live in plain modules (classes.py, openai_api.py); this is glue.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace
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
from app.lanes.types import LaneChunk, LaneRequest, LaneSaturated, SamplingOptions
from app.router import openai_api as api
from app.router.classes import REQUEST_CLASS_HEADER, Lane, RequestClass, UnknownRequestClass, classify, policy_for
from app.router.control import REASON_KV_HEADROOM, Outcome, TrafficControl
from app.router.spill import RouteDecision, RouteRefusal

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


class Generation:
    """One request on its lane: start (first chunk), then chunks under the class deadline, then bookkeeping once.

    Cancellation anywhere (client gone, deadline) cancels the lane call, which aborts the engine request.
    """

    def __init__(self, router: "Router", lane_request: LaneRequest, request_class: RequestClass, route: RouteDecision,
                 timeout_s: float):
        self.router = router
        self.request_class = request_class
        self.route = route
        self.reasons = list(route.reasons)
        self.lane = route.lane
        self.lane_request = replace(lane_request, priority=route.priority,
                                    sampling=replace(lane_request.sampling, max_tokens=route.max_tokens),
                                    may_spill=router.control.may_spill(request_class, route.lane))
        self.timeout_s = timeout_s
        self.started_at = time.monotonic()
        self.deadline = self.started_at + timeout_s
        self.stream = None
        self.last: LaneChunk | None = None
        self._first: LaneChunk | None = None
        self._done = False

    def headers(self) -> dict[str, str]:
        headers = {"x-llm-lanes-lane": self.lane.value, "x-llm-lanes-request-class": self.request_class.value}
        if self.reasons:
            headers["x-llm-lanes-degraded"] = ",".join(self.reasons)
        return headers

    def _remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def start(self) -> None:
        control = self.router.control
        if not control.allow(self.lane):
            raise api.OpenAIError(503, f"the {self.lane.value} lane is failing; retry shortly", type="server_error",
                                  code=f"{self.lane.value}_breaker_open", headers={"Retry-After": "1"})
        try:
            self._first = await self._open_stream()
        except LaneSaturated:
            # The hot replica keeps its KV headroom for realtime: this interactive request goes to the cold lane.
            control.hot_refused_for_kv()
            control.finished(self.request_class, self.lane, Outcome(ok=True), None)
            self.lane = Lane.COLD
            self.reasons.append(REASON_KV_HEADROOM)
            self.lane_request = replace(self.lane_request, may_spill=False)
            if not control.allow(self.lane):
                raise api.OpenAIError(503, "both lanes are saturated or failing; retry shortly", type="server_error",
                                      code="lanes_saturated", headers={"Retry-After": "1"}) from None
            self._first = await self._open_stream()
        self.last = self._first

    async def _open_stream(self) -> LaneChunk:
        self.stream = self.router.lanes[self.lane.value].options(stream=True).generate.remote(self.lane_request)
        try:
            return await asyncio.wait_for(self.stream.__anext__(), timeout=self._remaining())
        except LaneSaturated:
            self.stream.cancel()
            raise
        except BaseException as error:
            self._fail(error)
            raise self._as_openai_error(error) from None

    async def chunks(self) -> AsyncIterator[LaneChunk]:
        try:
            if self._first is not None:
                yield self._first
            while self.last.finish_reason is None:
                try:
                    chunk = await asyncio.wait_for(anext(self.stream), timeout=self._remaining())
                except StopAsyncIteration:
                    break
                except BaseException as error:
                    self._fail(error)
                    raise self._as_openai_error(error) from None
                self.last = chunk
                yield chunk
            self._finish(ok=True)
        finally:
            # Done, failed or abandoned by the client: cancelling the lane call aborts the engine request.
            self.stream.cancel()
            if not self._done:
                self._done = True
                self.router.control.finished(self.request_class, self.lane, Outcome(ok=True), None)

    def _finish(self, ok: bool, timed_out: bool = False) -> None:
        if self._done:
            return
        self._done = True
        e2e = time.monotonic() - self.started_at if ok else None
        self.router.control.finished(self.request_class, self.lane, Outcome(ok=ok, timed_out=timed_out), e2e)

    def _fail(self, error: BaseException) -> None:
        if self.stream is not None:
            self.stream.cancel()
        if isinstance(error, asyncio.CancelledError):
            return  # the client went away: not the lane's fault
        timed_out = isinstance(error, asyncio.TimeoutError)
        logger.warning("request %s on the %s lane failed: %r", self.lane_request.request_id, self.lane.value, error)
        self._finish(ok=False, timed_out=timed_out)

    def _as_openai_error(self, error: BaseException) -> BaseException:
        if isinstance(error, asyncio.CancelledError):
            return error
        if isinstance(error, asyncio.TimeoutError):
            return api.OpenAIError(504, f"the request exceeded its {self.timeout_s:.0f} s deadline for the "
                                        f"{self.request_class.value} class and was aborted", type="timeout_error",
                                   code="deadline_exceeded")
        return api.OpenAIError(503, f"the {self.lane.value} lane could not serve the request; retry shortly",
                               type="server_error", code="lane_unavailable", headers={"Retry-After": "1"})


@serve.deployment(name="Router")
@serve.ingress(fastapi_app)
class Router:
    async def __init__(self, app_args: dict[str, Any], hot_lane, cold_lane, prefix_cache):
        from transformers import AutoTokenizer

        from app.batch.dispatcher import BatchDispatcher
        from app.batch.store import open_batch_store
        from app.batch.window import ConcurrencyWindow

        self.cfg = load_app_config(app_args)
        self.lanes = {"hot": hot_lane, "cold": cold_lane} if cold_lane is not None else {"hot": hot_lane}
        self.control = TrafficControl(self.cfg)
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

        names = list(self.lanes)
        *lanes, prefix = await asyncio.gather(*(ask(self.lanes[n]) for n in names), ask(self.prefix_cache))
        return {
            "lanes": {name: [stats] for name, stats in zip(names, lanes)},
            "prefix_cache": prefix,
            "router": {"breakers": self.control.breaker_states(), "queued_by_class": self.control.queue_depths(),
                       "batch_window": self.dispatcher.window.size},
        }

    # ---- the request path ---------------------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.cfg.model.served_name:
            raise api.OpenAIError(404, f"model {model!r} does not exist: this server serves "
                                       f"{self.cfg.model.served_name!r}", param="model", code="model_not_found")

    def _prepare(self, body, kind: str, class_header: str | None) -> tuple[LaneRequest, RequestClass]:
        """Validate, tokenize once, classify: everything before admission. Raises OpenAIError."""
        self._check_model(body.model)
        token_ids = self._chat_token_ids(body) if kind == "chat" else self._completion_token_ids(body)
        try:
            request_class = classify(body.service_tier, class_header)
        except UnknownRequestClass as error:
            raise api.OpenAIError(400, str(error), param=error.param, code="invalid_request_class") from None
        limit = self.cfg.model.max_model_len
        if len(token_ids) >= limit:
            raise api.OpenAIError(400, f"this model's maximum context length is {limit} tokens and the prompt has "
                                       f"{len(token_ids)}: shorten the prompt", param="messages" if kind == "chat"
                                  else "prompt", code="context_length_exceeded")
        requested = body.requested_max_tokens
        max_tokens = requested if requested is not None else min(self.cfg.router.default_max_tokens,
                                                                 limit - len(token_ids))
        lane_request = LaneRequest(
            request_id=api.new_id("chatcmpl" if kind == "chat" else "cmpl"),
            prompt_token_ids=token_ids,
            sampling=SamplingOptions(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                     stop=body.stop_list, seed=body.seed, ignore_eos=body.ignore_eos),
            request_class=request_class.value,
            priority=policy_for(request_class).priority,
            stream=body.stream,
        )
        return lane_request, request_class

    async def _begin(self, lane_request: LaneRequest, request_class: RequestClass) -> "Generation":
        """Admit, route, send to a lane and wait for the first chunk. Raises OpenAIError with the right status."""
        admitted = self.control.admit(request_class)
        if not admitted.admitted:
            raise api.OpenAIError(429, f"too many {request_class.value} requests are waiting ({admitted.reason}); "
                                       f"retry in {admitted.retry_after_s} s", type="rate_limit_error",
                                  code="queue_full", headers={"Retry-After": str(admitted.retry_after_s)})
        started = False
        try:
            route = self.control.route(request_class, len(lane_request.prompt_token_ids),
                                       lane_request.sampling.max_tokens)
            if isinstance(route, RouteRefusal):
                headers = {"Retry-After": str(route.retry_after_s)} if route.retry_after_s else None
                raise api.OpenAIError(route.status, route.message, code=route.code,
                                      param="max_tokens" if route.status == 400 else None,
                                      type="invalid_request_error" if route.status == 400 else "server_error",
                                      headers=headers)
            generation = Generation(self, lane_request, request_class, route, self.control.timeout_s(request_class))
            await generation.start()
            started = True
            self.control.started(request_class)
            return generation
        finally:
            if not started:
                self.control.abandoned_before_start(request_class)

    async def _serve(self, body, request: Request, kind: str):
        lane_request, request_class = self._prepare(body, kind, request.headers.get(REQUEST_CLASS_HEADER))
        generation = await self._begin(lane_request, request_class)
        headers = generation.headers()
        model, request_id = self.cfg.model.served_name, lane_request.request_id
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._sse_events(kind, request_id, model, generation, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(await self._collect(kind, request_id, model, generation), headers=headers)

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
            lane_request, request_class = self._prepare(body, kind, None)
            generation = await self._begin(lane_request, request_class)
            response = await self._collect(kind, lane_request.request_id, self.cfg.model.served_name, generation)
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

    async def _collect(self, kind: str, request_id: str, model: str, generation: "Generation") -> dict[str, Any]:
        pieces = []
        async for chunk in generation.chunks():
            pieces.append(chunk.text)
        last = generation.last
        usage = api.usage(last.prompt_tokens, last.completion_tokens, last.cached_prompt_tokens)
        build = api.chat_response if kind == "chat" else api.completion_response
        return build(request_id, model, "".join(pieces), last.finish_reason, usage)

    async def _sse_events(self, kind: str, request_id: str, model: str, generation: "Generation",
                          include_usage: bool) -> AsyncIterator[str]:
        try:
            if kind == "chat":
                yield _sse(api.chat_chunk(request_id, model, {"role": "assistant", "content": ""}))
            async for chunk in generation.chunks():
                if kind == "chat":
                    delta = {"content": chunk.text} if chunk.text else {}
                    yield _sse(api.chat_chunk(request_id, model, delta, chunk.finish_reason))
                else:
                    yield _sse(api.completion_chunk(request_id, model, chunk.text, chunk.finish_reason))
            if include_usage:
                last = generation.last
                usage = api.usage(last.prompt_tokens, last.completion_tokens, last.cached_prompt_tokens)
                build = api.chat_chunk if kind == "chat" else api.completion_chunk
                empty = {} if kind == "chat" else ""
                yield _sse(build(request_id, model, empty, None, usage, with_choice=False))
            yield _sse("[DONE]")
        except api.OpenAIError as error:
            # Headers are gone once streaming started: the error travels as an SSE event, then the stream ends.
            yield _sse(error.body())
