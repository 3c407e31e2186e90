"""OpenAI request models, errors and response shapes. Pure: no Ray, no vLLM, no FastAPI app state."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class OpenAIError(Exception):
    """An error the client sees as OpenAI-shaped JSON: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# The seed range vLLM's own server accepts (a signed 64-bit integer); past 64 bits the engine's transport refuses it.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def has_lone_surrogate(value: Any) -> bool:
    """True if a string anywhere in `value` (str, or lists and dicts of them) holds a lone surrogate: JSON's \\ud800
    escapes parse into one, and it is no text: no tokenizer, template or UTF-8 encoder takes it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_lone_surrogate(v) for v in value)
    return False


def _text_only(value: Any) -> Any:
    if has_lone_surrogate(value):
        raise ValueError("holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text")
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    # Unknown OpenAI fields (logit_bias, user, ...) are accepted and ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    service_tier: str | None = None
    # vLLM extension, used by benchmarks to get fixed-length outputs.
    ignore_eos: bool = False

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        # The engine refuses an empty stop string (it would stop before the first character).
        if stop == "" or (isinstance(stop, list) and "" in stop):
            raise ValueError("stop strings must not be empty")
        return _text_only(stop)

    @field_validator("model", "service_tier")
    @classmethod
    def _names_are_text(cls, value: str | None) -> str | None:
        return _text_only(value)

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _content_is_text(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        return _text_only(content)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part type {part.get('type')!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_size(self) -> int:
        """Characters of message content, a cheap stand-in for the tokenization work this request needs."""
        return sum(len(m.content) if isinstance(m.content, str) else len(str(m.content or ""))
                   for m in self.messages)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]

    @field_validator("prompt")
    @classmethod
    def _prompt_is_text(cls, prompt: str | list[int] | list[str]) -> str | list[int] | list[str]:
        return _text_only(prompt)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_size(self) -> int:
        """Characters of the prompt (a token id counts as 4), a cheap stand-in for the tokenization work."""
        if isinstance(self.prompt, str):
            return len(self.prompt)
        return sum(len(p) if isinstance(p, str) else 4 for p in self.prompt)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_response(request_id: str, model: str, text: str, finish_reason: str | None, usage_: dict) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
             "finish_reason": finish_reason}
        ],
        "usage": usage_,
    }


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None,
               usage_: dict | None = None, with_choice: bool = True) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        if with_choice else [],
        "usage": usage_,
    }


def completion_response(request_id: str, model: str, text: str, finish_reason: str | None, usage_: dict) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage_,
    }


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None = None,
                     usage_: dict | None = None, with_choice: bool = True) -> dict:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
        if with_choice else [],
        "usage": usage_,
    }


# pydantic's errors for a value of the right type that is refused (out of range, not supported): 400, as vLLM's server
# answers; any other validation error (a wrong type, a missing field) is 422.
REFUSED_VALUE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal",
                                  "finite_number", "value_error", "too_short", "too_long"})
# The names pydantic gives a union's branches in an error's location (`stop.list[str]`): not parameters.
_UNION_BRANCHES = frozenset({"str", "int", "float", "bool", "none"})


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and ("[" in p or p in _UNION_BRANCHES))]
    return ".".join(parts) or None


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """pydantic/FastAPI validation errors -> one OpenAI error naming the first offending parameter."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                           code="invalid_json")
    param = _param(tuple(first.get("loc", ())))
    message = first["msg"].removeprefix("Value error, ")
    status = 400 if first.get("type") in REFUSED_VALUE_ERRORS else 422
    return OpenAIError(status, f"{param}: {message}" if param else message, param=param, code="invalid_value")
