"""Pure conversions between the llm_lanes.v1 gRPC messages and the OpenAI-shaped dicts the Router already handles.

The Router serves gRPC by turning each proto request into the same dict an HTTP client would have POSTed (so
validation, classification, admission and limits are the HTTP path's, not a second copy), and turns the OpenAI
response dicts / stream chunks it produces back into proto messages. Errors travel the same way: the HTTP status
and OpenAI error body become a gRPC status code, details and trailing metadata.

No Ray and no grpc server imports here beyond `grpc.StatusCode`, so all of it is unit-tested directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from google.protobuf import json_format, struct_pb2

from app.proto.llm_lanes.v1 import llm_lanes_pb2 as pb

# The import paths Ray Serve's gRPC proxy needs in `grpc_options.grpc_servicer_functions`.
LLM_LANES_SERVICER_FUNCTION = "app.proto.llm_lanes.v1.llm_lanes_pb2_grpc.add_LlmLanesServicer_to_server"
# Standard grpc.health.v1 (package grpcio-health-checking); the Router implements Check / Watch.
HEALTH_SERVICER_FUNCTION = "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"
# Ray Serve picks the application from this metadata key (optional while only one application runs).
APPLICATION_METADATA_KEY = "application"

# Request-class values as app.classes.RequestClass spells them (kept as strings so this module does not
# depend on the router package; test_proto checks the two agree).
REQUEST_CLASS_FROM_PROTO: dict[int, str] = {
    pb.REQUEST_CLASS_REALTIME: "realtime",
    pb.REQUEST_CLASS_INTERACTIVE: "interactive",
    pb.REQUEST_CLASS_BATCH: "batch",
}
REQUEST_CLASS_TO_PROTO: dict[str, int] = {name: number for number, name in REQUEST_CLASS_FROM_PROTO.items()}

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
# A batch that names no completion window gets OpenAI's (the only one it documents), on both surfaces: the gRPC
# SubmitBatch here and the HTTP Batches API (app.router.batch_api imports it).
DEFAULT_BATCH_COMPLETION_WINDOW = "24h"


class InvalidProtoRequest(ValueError):
    """A proto request that cannot become a valid OpenAI body; the Router answers INVALID_ARGUMENT."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ConvertedRequest:
    """An OpenAI request body plus the class the client asked for by enum.

    `request_class` plays the role of the HTTP `X-Request-Class` header: pass it as `header_value` to
    app.classes.classify(body.get("service_tier"), request_class), so an explicit enum wins over service_tier.
    """

    body: dict[str, Any]
    request_class: str | None


def _request_class_value(request_class: int) -> str | None:
    if request_class == pb.REQUEST_CLASS_UNSPECIFIED:
        return None
    try:
        return REQUEST_CLASS_FROM_PROTO[request_class]
    except KeyError:
        # proto3 enums are open: an unknown number from a newer client arrives as a plain int.
        raise InvalidProtoRequest(f"unknown request_class {request_class}", param="request_class") from None


def _sampling_fields(sampling: pb.SamplingParams) -> dict[str, Any]:
    """Only the fields the client set: an unset field must fall back to the server default, not to proto's zero."""
    fields: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        if sampling.HasField(name):
            fields[name] = getattr(sampling, name)
    if sampling.stop:
        fields["stop"] = list(sampling.stop)
    return fields


def _common_fields(request: pb.CompletionRequest | pb.ChatCompletionRequest, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if request.HasField("openai_fields"):
        body.update(json_format.MessageToDict(request.openai_fields))
    if request.model:
        body["model"] = request.model
    body.update(_sampling_fields(request.sampling))
    if request.HasField("service_tier"):
        body["service_tier"] = request.service_tier
    if request.user:
        body["user"] = request.user
    body["stream"] = stream
    if stream:
        # The last chunk then carries usage, which the final proto chunk reports.
        body["stream_options"] = {"include_usage": True}
    return body


def completion_request_to_openai(request: pb.CompletionRequest, *, stream: bool) -> ConvertedRequest:
    """Generate (stream=True) and Complete (stream=False) -> a /v1/completions body."""
    body = _common_fields(request, stream)
    body["prompt"] = request.prompt
    return ConvertedRequest(body=body, request_class=_request_class_value(request.request_class))


def chat_request_to_openai(request: pb.ChatCompletionRequest, *, stream: bool) -> ConvertedRequest:
    """ChatCompleteStream (stream=True) and ChatComplete (stream=False) -> a /v1/chat/completions body."""
    messages: list[dict[str, Any]] = []
    for message in request.messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.HasField("name"):
            entry["name"] = message.name
        messages.append(entry)
    body = _common_fields(request, stream)
    body["messages"] = messages
    return ConvertedRequest(body=body, request_class=_request_class_value(request.request_class))


def serving_info(
    lane: str = "", request_class: str | None = None, degraded_reasons: Sequence[str] = ()
) -> pb.ServingInfo:
    """Where a request was served. `request_class` is a RequestClass value ("realtime", ...)."""
    info = pb.ServingInfo(lane=lane, degraded_reasons=list(degraded_reasons))
    if request_class is not None:
        info.request_class = REQUEST_CLASS_TO_PROTO[str(request_class)]
    return info


def _attach_usage_and_serving(message, usage: Mapping[str, Any] | None, serving: pb.ServingInfo | None) -> None:
    """Every response and chunk message carries optional `usage` and `serving` fields the same way."""
    converted = usage_from_openai(usage)
    if converted is not None:
        message.usage.CopyFrom(converted)
    if serving is not None:
        message.serving.CopyFrom(serving)


def _attach_openai(message, document: Mapping[str, Any]) -> None:
    """The whole OpenAI JSON beside the typed fields (n choices, logprobs, tool calls)."""
    json_format.ParseDict(dict(document), message.openai)


def usage_from_openai(usage: Mapping[str, Any] | None) -> pb.Usage | None:
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return pb.Usage(
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        total_tokens=int(usage.get("total_tokens") or 0),
        cached_prompt_tokens=int(details.get("cached_tokens") or 0),
    )


def _first_choice(response: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = response.get("choices") or []
    return choices[0] if choices else {}


def _delta_token_count(choice: Mapping[str, Any], num_tokens: int | None) -> int:
    # OpenAI chunks do not count tokens; vLLM adds `token_ids` to a choice when asked to return them.
    if num_tokens is not None:
        return num_tokens
    return len(choice.get("token_ids") or ())


def completion_response_from_openai(
    response: Mapping[str, Any], serving: pb.ServingInfo | None = None
) -> pb.CompletionResponse:
    choice = _first_choice(response)
    message = pb.CompletionResponse(
        id=response.get("id", ""),
        model=response.get("model", ""),
        created=int(response.get("created") or 0),
        text=choice.get("text") or "",
        finish_reason=choice.get("finish_reason") or "",
    )
    _attach_usage_and_serving(message, response.get("usage"), serving)
    _attach_openai(message, response)
    return message


def completion_chunk_from_openai(
    chunk: Mapping[str, Any], serving: pb.ServingInfo | None = None, num_tokens: int | None = None
) -> pb.CompletionChunk:
    """One /v1/completions stream chunk; the usage-only last chunk (choices == []) keeps text empty."""
    choice = _first_choice(chunk)
    message = pb.CompletionChunk(
        id=chunk.get("id", ""),
        model=chunk.get("model", ""),
        created=int(chunk.get("created") or 0),
        text=choice.get("text") or "",
        num_tokens=_delta_token_count(choice, num_tokens),
        finish_reason=choice.get("finish_reason") or "",
    )
    _attach_usage_and_serving(message, chunk.get("usage"), serving)
    _attach_openai(message, chunk)
    return message


def chat_response_from_openai(
    response: Mapping[str, Any], serving: pb.ServingInfo | None = None
) -> pb.ChatCompletionResponse:
    choice = _first_choice(response)
    reply = choice.get("message") or {}
    message = pb.ChatCompletionResponse(
        id=response.get("id", ""),
        model=response.get("model", ""),
        created=int(response.get("created") or 0),
        message=pb.ChatMessage(role=reply.get("role") or "assistant", content=reply.get("content") or ""),
        finish_reason=choice.get("finish_reason") or "",
    )
    _attach_usage_and_serving(message, response.get("usage"), serving)
    _attach_openai(message, response)
    return message


def chat_chunk_from_openai(
    chunk: Mapping[str, Any], serving: pb.ServingInfo | None = None, num_tokens: int | None = None
) -> pb.ChatCompletionChunk:
    choice = _first_choice(chunk)
    delta = choice.get("delta") or {}
    message = pb.ChatCompletionChunk(
        id=chunk.get("id", ""),
        model=chunk.get("model", ""),
        created=int(chunk.get("created") or 0),
        role=delta.get("role") or "",
        content=delta.get("content") or "",
        num_tokens=_delta_token_count(choice, num_tokens),
        finish_reason=choice.get("finish_reason") or "",
    )
    _attach_usage_and_serving(message, chunk.get("usage"), serving)
    _attach_openai(message, chunk)
    return message


def stats_response_from_dict(stats: Mapping[str, Any]) -> pb.GetStatsResponse:
    """The GET /v1/admin/stats document as a Struct (numbers become doubles: Struct has no integers)."""
    struct = struct_pb2.Struct()
    struct.update(dict(stats))
    return pb.GetStatsResponse(stats=struct)


@dataclass(frozen=True)
class BatchSubmission:
    input_content: bytes
    endpoint: str
    completion_window: str
    metadata: dict[str, str] = field(default_factory=dict)


def submit_batch_from_proto(request: pb.SubmitBatchRequest) -> BatchSubmission:
    """The fields the batch store needs; the batch layer validates the JSONL lines themselves."""
    if not request.input_content:
        raise InvalidProtoRequest("input_content is empty: send the JSONL batch input", param="input_content")
    if request.endpoint not in (COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH):
        raise InvalidProtoRequest(
            f"endpoint {request.endpoint!r} is not one of {[COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH]}",
            param="endpoint",
        )
    return BatchSubmission(
        input_content=bytes(request.input_content),
        endpoint=request.endpoint,
        completion_window=request.completion_window or DEFAULT_BATCH_COMPLETION_WINDOW,
        metadata=dict(request.metadata),
    )


def batch_from_openai(batch: Mapping[str, Any]) -> pb.Batch:
    """An OpenAI batch object dict -> pb.Batch (None ids become empty strings)."""
    counts = batch.get("request_counts") or {}
    message = pb.Batch(
        id=batch.get("id", ""),
        status=batch.get("status", ""),
        endpoint=batch.get("endpoint", ""),
        completion_window=batch.get("completion_window") or "",
        created_at=int(batch.get("created_at") or 0),
        request_counts=pb.BatchRequestCounts(
            total=int(counts.get("total") or 0),
            completed=int(counts.get("completed") or 0),
            failed=int(counts.get("failed") or 0),
        ),
        input_file_id=batch.get("input_file_id") or "",
        output_file_id=batch.get("output_file_id") or "",
        error_file_id=batch.get("error_file_id") or "",
        metadata={str(k): str(v) for k, v in (batch.get("metadata") or {}).items()},
    )
    if batch.get("completed_at") is not None:
        message.completed_at = int(batch["completed_at"])
    return message


def get_batch_response(
    batch: Mapping[str, Any], output_content: bytes = b"", error_content: bytes = b""
) -> pb.GetBatchResponse:
    return pb.GetBatchResponse(
        batch=batch_from_openai(batch), output_content=output_content, error_content=error_content
    )


# HTTP status -> gRPC status. The choices that are not one-to-one:
#   409 -> FAILED_PRECONDITION: our 409s mean "not in a state for that" (e.g. a batch that already finished);
#          retrying the same call does not help, and ABORTED would invite retries.
#   413 -> INVALID_ARGUMENT, not RESOURCE_EXHAUSTED: the same request will never fit, and RESOURCE_EXHAUSTED is
#          the code retry policies retry (we keep it for 429, which does succeed later).
#   422 -> INVALID_ARGUMENT: a body that failed validation is the client's to fix, like 400.
#   499 -> CANCELLED: the client went away.
HTTP_TO_GRPC_STATUS: dict[int, grpc.StatusCode] = {
    200: grpc.StatusCode.OK,
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.FAILED_PRECONDITION,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def grpc_code_for_http_status(status: int) -> grpc.StatusCode:
    if status in HTTP_TO_GRPC_STATUS:
        return HTTP_TO_GRPC_STATUS[status]
    if 200 <= status < 300:
        return grpc.StatusCode.OK
    if 400 <= status < 500:
        return grpc.StatusCode.FAILED_PRECONDITION
    if 500 <= status < 600:
        return grpc.StatusCode.INTERNAL
    return grpc.StatusCode.UNKNOWN


@dataclass(frozen=True)
class GrpcError:
    code: grpc.StatusCode
    details: str
    # gRPC has no Retry-After header or error body: both travel as trailing metadata.
    trailing_metadata: tuple[tuple[str, str], ...] = ()


def _ascii_metadata_value(value: Any) -> str:
    # Non "-bin" metadata values must be printable ASCII.
    return str(value).encode("ascii", "replace").decode("ascii")


def grpc_error_from_openai(
    status: int, error_body: Mapping[str, Any] | None, retry_after_s: float | None = None,
    metadata_headers: Mapping[str, str] | None = None,
) -> GrpcError:
    """An HTTP status plus OpenAI error body ({"error": {"message", "type", "param", "code"}}) -> a gRPC error.
    `metadata_headers`: HTTP headers of the answer that gRPC callers get as trailing metadata too (the
    x-ratelimit-* ones)."""
    error = (error_body or {}).get("error") or {}
    details = str(error.get("message") or f"HTTP {status}")
    metadata: list[tuple[str, str]] = [("http-status", str(status))]
    for key in ("type", "param", "code"):
        if error.get(key) is not None:
            metadata.append((f"error-{key}", _ascii_metadata_value(error[key])))
    if retry_after_s is not None:
        metadata.append(("retry-after", _ascii_metadata_value(int(round(retry_after_s)))))
    metadata.extend(metadata_from_headers(metadata_headers or {}))
    return GrpcError(code=grpc_code_for_http_status(status), details=details, trailing_metadata=tuple(metadata))


# HTTP answer headers that gRPC callers get as metadata: OpenAI's rate-limit headers.
METADATA_HEADER_PREFIXES = ("x-ratelimit-",)


def metadata_from_headers(headers: Mapping[str, str]) -> list[tuple[str, str]]:
    """The headers of an answer that travel as gRPC metadata (lower-case keys, as gRPC requires)."""
    return [(name.lower(), _ascii_metadata_value(value)) for name, value in headers.items()
            if name.lower().startswith(METADATA_HEADER_PREFIXES)]


class GrpcContextLike(Protocol):
    """The part of ray.serve.grpc_util.RayServegRPCContext the Router uses."""

    def set_code(self, code: grpc.StatusCode) -> None: ...

    def set_details(self, details: str) -> None: ...

    def set_trailing_metadata(self, trailing_metadata: list[tuple[str, str]]) -> None: ...


def apply_grpc_error(grpc_context: GrpcContextLike, error: GrpcError) -> None:
    """Set the status on Ray's gRPC context. Then return an empty response (unary) or stop yielding (streaming):
    Ray's proxy sends the code and details the context holds. RayServegRPCContext.set_trailing_metadata keeps
    Serve's request_id entry, so setting ours does not drop it."""
    grpc_context.set_code(error.code)
    grpc_context.set_details(error.details)
    if error.trailing_metadata:
        grpc_context.set_trailing_metadata(list(error.trailing_metadata))
