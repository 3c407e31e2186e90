"""The gRPC surface: llm_lanes.v1.LlmLanes and grpc.health.v1.Health, through Serve's gRPC proxy.

Serve calls the method named like the RPC, with the request proto and (by this parameter name) `grpc_context`. Each
proto request becomes the OpenAI body an HTTP client would send and takes the request pipeline from there (same
validation, classes, admission, limits); an error sets the status on grpc_context. Unary RPCs then return an empty
reply (Serve sends the status, details and trailing metadata); streaming RPCs raise after setting it (Serve keeps the
code and details, trailing metadata is lost on that path).

`GrpcApi` is a plain class mixed into the Router deployment; it expects `pipeline`, `control`, `admin_stats()` and
the BatchApi's `submit_batch` / `batch_with_output`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc

from app.batch.store import BatchStoreError
from app.observability.tracing import carrier_from_grpc_metadata
from app.proto import convert
from app.proto.llm_lanes.v1 import llm_lanes_pb2 as pb
from app.router import openai_api as api
from app.router.auth import Principal, require_admin
from app.router.batch_api import openai_error_from_store
from app.router.endpoints import CHAT, COMPLETION, Answer, Endpoint
from app.router.pipeline import RequestPipeline
from app.router.sse import sse_json

# grpc.health.v1 Watch: how often the serving status is re-checked for a change.
HEALTH_WATCH_INTERVAL_S = 1.0
# grpc.health.v1 service names the Router answers for ("" is the server as a whole).
HEALTH_SERVICES = ("", "llm_lanes.v1.LlmLanes")


class ProtoShapes:
    """How one endpoint's requests and answers cross between proto and OpenAI JSON."""

    def __init__(self, to_openai, response, chunk, empty_response):
        self.to_openai = to_openai
        self.response = response
        self.chunk = chunk
        self.empty_response = empty_response


PROTO_SHAPES = {
    CHAT.name: ProtoShapes(convert.chat_request_to_openai, convert.chat_response_from_openai,
                           convert.chat_chunk_from_openai, pb.ChatCompletionResponse),
    COMPLETION.name: ProtoShapes(convert.completion_request_to_openai, convert.completion_response_from_openai,
                                 convert.completion_chunk_from_openai, pb.CompletionResponse),
}


def set_grpc_error(grpc_context, error: api.OpenAIError | BatchStoreError) -> convert.GrpcError:
    """Put an OpenAI error (or a batch store error, mapped as HTTP maps it) on the gRPC context."""
    if isinstance(error, BatchStoreError):
        error = openai_error_from_store(error)
    retry_after = error.headers.get("Retry-After")
    grpc_error = convert.grpc_error_from_openai(error.status, error.body(),
                                                float(retry_after) if retry_after else None, error.headers)
    if grpc_context is not None:
        convert.apply_grpc_error(grpc_context, grpc_error)
    return grpc_error


class GrpcApi:
    pipeline: RequestPipeline

    def authenticate_grpc(self, grpc_context, admin: bool = False) -> Principal:
        """The caller of an RPC, from its `authorization` metadata (UNAUTHENTICATED; PERMISSION_DENIED for a
        non-admin key on an admin RPC). Raises OpenAIError."""
        metadata = grpc_context.invocation_metadata() if grpc_context is not None else ()
        principal = self.keyring.authenticate_metadata(metadata)
        if admin:
            require_admin(principal)
        return principal

    def check_size(self, request, limit: int | None = None) -> None:
        """A message over router.max_request_bytes is refused before anything reads it (RESOURCE_EXHAUSTED)."""
        limit = limit or self.pipeline.cfg.router.max_request_bytes
        if request.ByteSize() > limit:
            raise api.OpenAIError(413, f"the request message is larger than the {limit}-byte limit",
                                  code="request_too_large")

    async def Generate(self, request: pb.CompletionRequest, grpc_context=None) -> AsyncIterator[pb.CompletionChunk]:
        # aclosing: a client that leaves closes the whole chain at once (lane call cancelled, outcome counted).
        async with contextlib.aclosing(self._stream(COMPLETION, request, grpc_context)) as messages:
            async for message in messages:
                yield message

    async def Complete(self, request: pb.CompletionRequest, grpc_context=None) -> pb.CompletionResponse:
        return await self._unary(COMPLETION, request, grpc_context)

    async def ChatComplete(self, request: pb.ChatCompletionRequest, grpc_context=None) -> pb.ChatCompletionResponse:
        return await self._unary(CHAT, request, grpc_context)

    async def ChatCompleteStream(self, request: pb.ChatCompletionRequest,
                                 grpc_context=None) -> AsyncIterator[pb.ChatCompletionChunk]:
        async with contextlib.aclosing(self._stream(CHAT, request, grpc_context)) as messages:
            async for message in messages:
                yield message

    async def GetStats(self, request: pb.GetStatsRequest, grpc_context=None) -> pb.GetStatsResponse:
        try:
            self.authenticate_grpc(grpc_context, admin=True)
        except api.OpenAIError as error:
            set_grpc_error(grpc_context, error)
            return pb.GetStatsResponse()
        # Through JSON first: the Struct takes only str keys and JSON values.
        return convert.stats_response_from_dict(json.loads(json.dumps(await self.admin_stats(), default=str)))

    async def SubmitBatch(self, request: pb.SubmitBatchRequest, grpc_context=None) -> pb.Batch:
        """POST /v1/files + POST /v1/batches in one call."""
        try:
            principal = self.authenticate_grpc(grpc_context)
            # The batch file itself is bounded by batch.max_file_bytes (413 below, naming it).
            limits = self.pipeline.cfg
            self.check_size(request, limits.batch.max_file_bytes + limits.router.max_request_bytes)
            try:
                submission = convert.submit_batch_from_proto(request)
            except convert.InvalidProtoRequest as error:
                raise api.OpenAIError(400, str(error), param=error.param) from None
            batch = await self.submit_batch(principal, "grpc-batch.jsonl", submission.input_content,
                                            submission.endpoint, submission.completion_window,
                                            submission.metadata or None)
            return convert.batch_from_openai(batch)
        except (api.OpenAIError, BatchStoreError) as error:
            set_grpc_error(grpc_context, error)
            return pb.Batch()

    async def GetBatch(self, request: pb.GetBatchRequest, grpc_context=None) -> pb.GetBatchResponse:
        try:
            principal = self.authenticate_grpc(grpc_context)
            batch, output, error_lines = await self.batch_with_output(principal, request.batch_id,
                                                                      request.include_output)
            return convert.get_batch_response(batch, output, error_lines)
        except (api.OpenAIError, BatchStoreError) as error:
            set_grpc_error(grpc_context, error)
            return pb.GetBatchResponse()

    # ---- grpc.health.v1 -------------------------------------------------------------------------------------------

    def _health_status(self, service: str) -> int:
        from grpc_health.v1 import health_pb2

        if service not in HEALTH_SERVICES:
            return health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        # Serving while no lane's circuit breaker is open (every lane can take requests).
        can_route = all(state != "open" for state in self.pipeline.control.breaker_states().values())
        return health_pb2.HealthCheckResponse.SERVING if can_route else health_pb2.HealthCheckResponse.NOT_SERVING

    async def Check(self, request, grpc_context=None):
        """grpc.health.v1.Health/Check (grpc_health_probe, Kubernetes gRPC probes)."""
        from grpc_health.v1 import health_pb2

        status = self._health_status(request.service)
        if status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
            if grpc_context is not None:
                grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
                grpc_context.set_details(f"unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request, grpc_context=None):
        """grpc.health.v1.Health/List: every service this server reports on."""
        from grpc_health.v1 import health_pb2

        return health_pb2.HealthListResponse(statuses={
            service: health_pb2.HealthCheckResponse(status=self._health_status(service)) for service in HEALTH_SERVICES
        })

    async def Watch(self, request, grpc_context=None):
        """grpc.health.v1.Health/Watch: the status now, then each change, until the client goes away."""
        from grpc_health.v1 import health_pb2

        last = None
        while True:
            status = self._health_status(request.service)
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status)
            await asyncio.sleep(HEALTH_WATCH_INTERVAL_S)

    # ---- generation -----------------------------------------------------------------------------------------------

    def _body(self, endpoint: Endpoint, request, stream: bool) -> tuple[dict[str, Any], str | None]:
        """A proto request -> (the OpenAI JSON body, the class its enum asks for). Raises OpenAIError. `model` is
        required as on HTTP: an empty one names no model (404, as HTTP answers `"model": ""`)."""
        try:
            converted = PROTO_SHAPES[endpoint.name].to_openai(request, stream=stream)
        except convert.InvalidProtoRequest as error:
            raise api.OpenAIError(400, str(error), param=error.param) from None
        if not request.model:
            raise api.OpenAIError(404, f"model '' does not exist: this server serves {self.pipeline.model!r}",
                                  param="model", code="model_not_found")
        body = {**converted.body, "model": request.model}
        if stream:
            # Cumulative usage in every chunk: each proto chunk says how many tokens it adds.
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return body, converted.request_class

    async def _answer(self, endpoint: Endpoint, request, grpc_context, stream: bool) -> Answer:
        pipeline = self.pipeline
        carrier = None
        if pipeline.tracing.enabled and grpc_context is not None:
            carrier = carrier_from_grpc_metadata(grpc_context.invocation_metadata())
        principal = self.authenticate_grpc(grpc_context)
        self.check_size(request)
        body, request_class = self._body(endpoint, request, stream)
        answer = await pipeline.answer(endpoint, body, class_header=request_class,
                                       record=pipeline.new_record(endpoint, carrier), principal=principal)
        # The key's rate-limit state, as HTTP's x-ratelimit-* headers say it (Serve sends the context's trailing
        # metadata with the reply, and on a stream with its messages).
        metadata = convert.metadata_from_headers(answer.headers())
        if metadata and grpc_context is not None:
            grpc_context.set_trailing_metadata(metadata)
        return answer

    @staticmethod
    def _serving(call) -> pb.ServingInfo:
        return convert.serving_info(call.lane.value, call.request_class.value, call.context.reasons)

    async def _unary(self, endpoint: Endpoint, request, grpc_context):
        shapes = PROTO_SHAPES[endpoint.name]
        try:
            answer = await self._answer(endpoint, request, grpc_context, stream=False)
        except api.OpenAIError as error:
            set_grpc_error(grpc_context, error)
            return shapes.empty_response()
        return shapes.response(answer.response, self._serving(answer.calls[0]))

    async def _stream(self, endpoint: Endpoint, request, grpc_context):
        """Generate / ChatCompleteStream: the SSE path's chunks as proto messages. The first message carries
        `serving` (and the assistant role for chat), the one with finish_reason carries `usage`."""
        shapes = PROTO_SHAPES[endpoint.name]
        try:
            answer = await self._answer(endpoint, request, grpc_context, stream=True)
        except api.OpenAIError as error:
            raise RuntimeError(set_grpc_error(grpc_context, error).details) from None
        serving, sent_tokens, usage_sent = self._serving(answer.calls[0]), 0, False
        async with contextlib.aclosing(answer.events) as events:
            async for event in events:
                chunk = sse_json(event)
                if chunk is None:
                    continue
                if "error" in chunk and "choices" not in chunk:
                    error = chunk["error"]
                    raise RuntimeError(set_grpc_error(grpc_context, api.OpenAIError(
                        int(error.get("code") or 500), error.get("message", ""), type=error.get("type", "")
                    )).details)
                usage = chunk.get("usage") or {}
                total = usage.get("completion_tokens", sent_tokens)
                num_tokens, sent_tokens = total - sent_tokens, total
                choices = chunk.get("choices") or []
                if not choices and usage_sent:
                    continue  # vLLM's usage-only last chunk: the finishing chunk carried the usage already
                if choices and not any(c.get("finish_reason") for c in choices):
                    chunk["usage"] = None  # usage travels with the finishing chunk (or a usage-only one)
                usage_sent = usage_sent or bool(chunk.get("usage"))
                yield shapes.chunk(chunk, serving, num_tokens)
                serving = None
