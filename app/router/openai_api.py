"""OpenAI-shaped errors, and what the Router checks of a body before vLLM's protocol models see it. Pure: no Ray,
no vLLM, no FastAPI app state. Requests and answers themselves are vLLM's (app/router/openai_surface.py)."""

from __future__ import annotations

from typing import Any


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
