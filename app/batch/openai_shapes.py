"""OpenAI Files/Batches wire shapes as pure functions: parse and validate batch input lines, build output and
error lines, and render file/batch objects exactly as the OpenAI API documents them.

No I/O here; the store and the HTTP routes call these so every shape is defined once.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

SUPPORTED_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
BATCH_FILE_PURPOSE = "batch"
BATCH_OUTPUT_PURPOSE = "batch_output"
# OpenAI only documents "24h"; other whole-hour windows are accepted so tests can use short ones.
COMPLETION_WINDOW_PATTERN = re.compile(r"^([1-9][0-9]*)h$")
# Rough prompt-size estimate when no tokenizer is at hand: ~4 characters per token for English BPE vocabularies.
CHARS_PER_TOKEN_ESTIMATE = 4

BATCH_STATUSES = (
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled",
)
TERMINAL_BATCH_STATUSES = ("failed", "completed", "expired", "cancelled")


MAX_FILENAME_CHARS = 255


def safe_filename(filename: str) -> str:
    """An uploaded file's name as stored and shown: its last path component (either separator), without control
    characters, at most 255 characters; "file" when nothing is left. `../../etc/passwd` -> `passwd`."""
    name = filename.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(ch for ch in name if ch.isprintable()).strip()
    if name in ("", ".", ".."):
        return "file"
    return name[:MAX_FILENAME_CHARS]


class BatchLineError(ValueError):
    """One input line is unusable; it fails alone and is reported in the batch's error file."""

    def __init__(self, code: str, message: str, custom_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.custom_id = custom_id


@dataclass(frozen=True)
class ParsedLine:
    line_no: int  # 1-based position in the input file, counting blank lines, so it matches an editor's view
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class RejectedLine:
    line_no: int
    custom_id: str | None
    code: str
    message: str


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(16)


def new_batch_request_id() -> str:
    return "batch_req_" + secrets.token_hex(16)


def completion_window_seconds(window: str) -> int:
    """'24h' -> 86400; raises ValueError for anything else."""
    match = COMPLETION_WINDOW_PATTERN.match(window or "")
    if not match:
        raise ValueError(f"completion_window={window!r} is not supported: use '24h'")
    return int(match.group(1)) * 3600


def check_endpoint(endpoint: str) -> None:
    if endpoint not in SUPPORTED_ENDPOINTS:
        raise ValueError(f"endpoint={endpoint!r} is not supported: use one of {list(SUPPORTED_ENDPOINTS)}")


# What a line of a batch input file holds (OpenAI's format); anything else is refused, not ignored.
LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})


def parse_batch_line(raw: str | bytes, line_no: int, endpoint: str) -> ParsedLine:
    """Validate one JSONL line against the batch's endpoint; raises BatchLineError naming what is wrong."""
    try:
        item = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise BatchLineError("invalid_json", f"line {line_no} is not valid JSON: {error}") from None
    if not isinstance(item, dict):
        raise BatchLineError("invalid_json", f"line {line_no} must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchLineError(
            "missing_custom_id", f"line {line_no}: custom_id is required and must be a non-empty string"
        )
    unknown = sorted(set(item) - LINE_FIELDS)
    if unknown:
        raise BatchLineError("unrecognized_argument", f"line {line_no}: unknown field(s) {unknown}: a line has "
                                                      f"{sorted(LINE_FIELDS)}", custom_id)
    method = item.get("method")
    if method != "POST":
        raise BatchLineError("invalid_method", f"line {line_no}: method must be 'POST', got {method!r}", custom_id)
    url = item.get("url")
    if url != endpoint:
        raise BatchLineError(
            "invalid_url", f"line {line_no}: url must equal the batch endpoint {endpoint!r}, got {url!r}", custom_id
        )
    body = item.get("body")
    if not isinstance(body, dict):
        raise BatchLineError("invalid_body", f"line {line_no}: body must be a JSON object", custom_id)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BatchLineError("missing_model", f"line {line_no}: body.model is required", custom_id)
    if endpoint == "/v1/chat/completions" and not isinstance(body.get("messages"), list):
        raise BatchLineError("invalid_body", f"line {line_no}: body.messages must be a list", custom_id)
    if endpoint == "/v1/completions" and not isinstance(body.get("prompt"), (str, list)):
        raise BatchLineError("invalid_body", f"line {line_no}: body.prompt must be a string or list", custom_id)
    if body.get("stream"):
        raise BatchLineError("invalid_body", f"line {line_no}: stream is not allowed in a batch", custom_id)
    return ParsedLine(line_no=line_no, custom_id=custom_id, method=method, url=url, body=body)


def parse_batch_file(content: bytes, endpoint: str) -> tuple[list[ParsedLine], list[RejectedLine]]:
    """Split a JSONL file into valid lines and rejected ones. Blank lines are skipped (they still count in line_no);
    a repeated custom_id rejects the later line only, so every custom_id in the output file is unique."""
    valid: list[ParsedLine] = []
    rejected: list[RejectedLine] = []
    seen: set[str] = set()
    for index, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            parsed = parse_batch_line(raw, index, endpoint)
        except BatchLineError as error:
            rejected.append(RejectedLine(index, error.custom_id, error.code, error.message))
            continue
        if parsed.custom_id in seen:
            rejected.append(
                RejectedLine(
                    index, parsed.custom_id, "duplicate_custom_id",
                    f"line {index}: custom_id {parsed.custom_id!r} is already used by an earlier line",
                )
            )
            continue
        seen.add(parsed.custom_id)
        valid.append(parsed)
    return valid, rejected


def estimate_line_tokens(body: Mapping[str, Any], default_max_tokens: int) -> int:
    """Tokens a line will cost the engine (prompt estimate + completion budget): the autoscaler's backlog unit.
    An estimate on purpose: the store must not need the model's tokenizer. `default_max_tokens`: the completion
    length of a line that sets none (the Router's router.default_max_tokens)."""
    if "messages" in body and isinstance(body["messages"], list):
        text = "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in body["messages"])
    else:
        text = json.dumps(body.get("prompt", ""))
    prompt_tokens = max(1, len(text) // CHARS_PER_TOKEN_ESTIMATE)
    completion = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    try:
        completion_tokens = max(0, int(completion))
    except (TypeError, ValueError):
        completion_tokens = default_max_tokens
    return prompt_tokens + completion_tokens


TokenEstimator = Callable[[Mapping[str, Any]], int]


def output_line(custom_id: str, status_code: int, body: Any, request_id: str | None = None,
                line_id: str | None = None) -> dict[str, Any]:
    """One line of a batch's output file (a request that got a response)."""
    return {
        "id": line_id or new_batch_request_id(),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id or "", "body": body},
        "error": None,
    }


def error_line(custom_id: str | None, code: str, message: str, *, status_code: int | None = None,
               body: Any = None, request_id: str | None = None, line_id: str | None = None) -> dict[str, Any]:
    """One line of a batch's error file: `response` is null when the request never got an HTTP answer."""
    response = None
    if status_code is not None:
        response = {"status_code": status_code, "request_id": request_id or "", "body": body}
    return {
        "id": line_id or new_batch_request_id(),
        "custom_id": custom_id,
        "response": response,
        "error": {"code": code, "message": message},
    }


def jsonl(items: Iterable[Mapping[str, Any]]) -> bytes:
    return b"".join(json.dumps(item, separators=(",", ":")).encode() + b"\n" for item in items)


def file_object(record: Any) -> dict[str, Any]:
    """OpenAI file object for a FileRecord (duck-typed: id, bytes, created_at, filename, purpose)."""
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(record: Any) -> dict[str, Any]:
    """OpenAI batch object for a BatchRecord (duck-typed, see app.batch.store.BatchRecord)."""
    errors = None
    if record.errors:
        errors = {"object": "list", "data": list(record.errors)}
    return {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "errors": errors,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "created_at": record.created_at,
        "in_progress_at": record.in_progress_at,
        "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at,
        "completed_at": record.completed_at,
        "failed_at": record.failed_at,
        "expired_at": record.expired_at,
        "cancelling_at": record.cancelling_at,
        "cancelled_at": record.cancelled_at,
        "request_counts": {
            "total": record.request_counts.total,
            "completed": record.request_counts.completed,
            "failed": record.request_counts.failed,
        },
        "metadata": record.metadata,
    }


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI cursor page: `after=<last_id>` fetches the next page."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
