"""The OpenAI Files + Batches surface, and the executor that runs one batch line through the request pipeline.

`BatchApi` is a plain class whose methods become FastAPI routes on the Router deployment (BATCH_ROUTES); it expects
the deployment to set `pipeline`, `batch_store` and `dispatcher`. The gRPC surface uses `submit_batch` and
`batch_with_output`; store errors map to OpenAI errors in one place (`openai_error_from_store`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Literal

from fastapi import File, Form, Query, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from app.batch import openai_shapes as batch_shapes
from app.batch.store import BatchStoreError, ClaimedLine, ConflictError, NotFoundError
from app.classes import RequestClass
from app.proto.convert import DEFAULT_BATCH_COMPLETION_WINDOW
from app.router import openai_api as api
from app.router.auth import OPEN_PRINCIPAL, Principal, check_class
from app.router.endpoints import ENDPOINTS_BY_PATH
from app.router.pipeline import RequestPipeline

# 503 codes that mean "the lane is down for now", not "this request is bad": a batch line waits them out.
LANE_DOWN_CODES = {"lane_unavailable", "lanes_saturated", "cold_breaker_open", "hot_breaker_open"}
BATCH_LANE_DOWN_RETRY_S = 1.0
BATCH_LANE_DOWN_MAX_WAIT_S = 600.0


class CreateBatchRequest(BaseModel):
    # A field OpenAI's Batches API does not have is refused naming it, not ignored (a misspelt completion_window).
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str = DEFAULT_BATCH_COMPLETION_WINDOW
    metadata: dict[str, str] | None = None


def openai_error_from_store(error: BatchStoreError) -> api.OpenAIError:
    status = 404 if isinstance(error, NotFoundError) else 409 if isinstance(error, ConflictError) else 400
    return api.OpenAIError(status, str(error), param=error.param,
                           code={404: "not_found", 409: "conflict"}.get(status))


async def execute_batch_line(pipeline: RequestPipeline, line: ClaimedLine,
                             adapters: frozenset[str] | None = None) -> dict[str, Any]:
    """One batch line through the same validation and lane path as an HTTP request, at batch class. `adapters`: the
    LoRA adapters the batch's tenant may use (None: every one).

    Batch work is never refused for load: while its lane is unavailable (breaker open, replica restarting) the
    line waits here, its lease renewed by the dispatcher, instead of spending its attempts in seconds.
    """
    waited_s = 0.0
    while True:
        result = await _execute_batch_line_once(pipeline, line, adapters)
        error = result["body"].get("error") if isinstance(result["body"], dict) else None
        lane_down = result["status_code"] == 503 and error and error.get("code") in LANE_DOWN_CODES
        if not lane_down or waited_s >= BATCH_LANE_DOWN_MAX_WAIT_S:
            return result
        await asyncio.sleep(BATCH_LANE_DOWN_RETRY_S)
        waited_s += BATCH_LANE_DOWN_RETRY_S


async def _execute_batch_line_once(pipeline: RequestPipeline, line: ClaimedLine,
                                   adapters: frozenset[str] | None = None) -> dict[str, Any]:
    endpoint = ENDPOINTS_BY_PATH[line.url]
    # The batch's tenant (its key's batch class was checked when the batch was created; no rate limit: batch work
    # waits, it is never refused).
    principal = dataclasses.replace(OPEN_PRINCIPAL, tenant=line.tenant, label="batch", admin=False,
                                    adapters=adapters)
    body = {**line.body, "service_tier": "flex"} if isinstance(line.body, dict) else line.body
    try:
        answer = await pipeline.answer(endpoint, body, stream=False, principal=principal)
        return {"status_code": 200, "body": answer.response, "request_id": answer.calls[0].context.request_id}
    except api.OpenAIError as error:
        return {"status_code": error.status, "body": error.body()}


class BatchApi:
    """Every file and batch belongs to the tenant of the key that created it; other tenants get 404 for it."""

    pipeline: RequestPipeline

    async def upload_file(self, request: Request, file: UploadFile = File(...),
                          purpose: str = Form(...)) -> dict[str, Any]:
        tenant = self.authenticate_http(request).tenant
        if purpose != "batch":
            raise api.OpenAIError(400, f"purpose {purpose!r} is not supported: use 'batch'", param="purpose")
        limit = self.pipeline.cfg.batch.max_file_bytes
        content = await file.read(limit + 1)
        if len(content) > limit:
            raise api.OpenAIError(413, f"file is larger than the {limit}-byte limit: split it into several batches",
                                  param="file", code="file_too_large")
        record = await asyncio.to_thread(self.batch_store.create_file, purpose, file.filename or "batch.jsonl",
                                         content, tenant)
        return batch_shapes.file_object(record)

    async def get_file(self, file_id: str, request: Request) -> dict[str, Any]:
        tenant = self.authenticate_http(request).tenant
        return batch_shapes.file_object(await asyncio.to_thread(self.batch_store.get_file, file_id, tenant))

    async def list_files(self, request: Request, purpose: str | None = None,
                         limit: int = Query(10_000, ge=1, le=10_000), after: str | None = None,
                         order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
        tenant = self.authenticate_http(request).tenant
        page = await asyncio.to_thread(self.batch_store.list_files, purpose, limit, tenant, after, order)
        return batch_shapes.list_object([batch_shapes.file_object(record) for record in page.data], page.has_more)

    async def delete_file(self, file_id: str, request: Request) -> dict[str, Any]:
        tenant = self.authenticate_http(request).tenant
        await asyncio.to_thread(self.batch_store.delete_file, file_id, tenant)
        return {"id": file_id, "object": "file", "deleted": True}

    async def get_file_content(self, file_id: str, request: Request) -> Response:
        tenant = self.authenticate_http(request).tenant
        content = await asyncio.to_thread(self.batch_store.file_content, file_id, tenant)
        return Response(content, media_type="application/jsonl")

    async def create_batch(self, body: CreateBatchRequest, request: Request) -> dict[str, Any]:
        principal = self.authenticate_http(request)
        check_class(principal, RequestClass.BATCH, param="endpoint")
        record = await asyncio.to_thread(self.batch_store.create_batch, body.input_file_id, body.endpoint,
                                         body.completion_window, body.metadata, principal.tenant)
        self.dispatcher.notify_new_work()
        return batch_shapes.batch_object(record)

    async def get_batch(self, batch_id: str, request: Request) -> dict[str, Any]:
        tenant = self.authenticate_http(request).tenant
        return batch_shapes.batch_object(await asyncio.to_thread(self.batch_store.get_batch, batch_id, tenant))

    async def list_batches(self, request: Request, after: str | None = None,
                           limit: int = Query(20, ge=1, le=100)) -> dict[str, Any]:
        tenant = self.authenticate_http(request).tenant
        page = await asyncio.to_thread(self.batch_store.list_batches, after, limit, tenant)
        return batch_shapes.list_object([batch_shapes.batch_object(b) for b in page.data], page.has_more)

    async def cancel_batch(self, batch_id: str, request: Request) -> dict[str, Any]:
        tenant = self.authenticate_http(request).tenant
        record = await asyncio.to_thread(self.batch_store.cancel_batch, batch_id, tenant)
        return batch_shapes.batch_object(record)

    async def submit_batch(self, principal: Principal, filename: str, content: bytes, endpoint: str,
                           completion_window: str, metadata: dict[str, str] | None) -> dict[str, Any]:
        """Upload + create in one step (gRPC SubmitBatch). Raises OpenAIError or BatchStoreError."""
        check_class(principal, RequestClass.BATCH, param="endpoint")
        limit = self.pipeline.cfg.batch.max_file_bytes
        if len(content) > limit:
            raise api.OpenAIError(413, f"input_content is larger than the {limit}-byte limit: split it into several "
                                       "batches", param="input_content", code="file_too_large")
        file = await asyncio.to_thread(self.batch_store.create_file, "batch", filename, content, principal.tenant)
        record = await asyncio.to_thread(self.batch_store.create_batch, file.id, endpoint, completion_window,
                                         metadata, principal.tenant)
        self.dispatcher.notify_new_work()
        return batch_shapes.batch_object(record)

    async def batch_with_output(self, principal: Principal, batch_id: str,
                                include_output: bool) -> tuple[dict[str, Any], bytes, bytes]:
        """A batch object and, when asked, its output and error files' contents (gRPC GetBatch)."""
        store, tenant = self.batch_store, principal.tenant
        batch = batch_shapes.batch_object(await asyncio.to_thread(store.get_batch, batch_id, tenant))
        output = error_lines = b""
        if include_output:
            if batch.get("output_file_id"):
                output = await asyncio.to_thread(store.file_content, batch["output_file_id"], tenant)
            if batch.get("error_file_id"):
                error_lines = await asyncio.to_thread(store.file_content, batch["error_file_id"], tenant)
        return batch, output, error_lines


BATCH_ROUTES = {
    "upload_file": lambda app: app.post("/v1/files"),
    "list_files": lambda app: app.get("/v1/files"),
    "get_file": lambda app: app.get("/v1/files/{file_id}"),
    "delete_file": lambda app: app.delete("/v1/files/{file_id}"),
    "get_file_content": lambda app: app.get("/v1/files/{file_id}/content"),
    "create_batch": lambda app: app.post("/v1/batches"),
    "get_batch": lambda app: app.get("/v1/batches/{batch_id}"),
    "list_batches": lambda app: app.get("/v1/batches"),
    "cancel_batch": lambda app: app.post("/v1/batches/{batch_id}/cancel"),
}
