"""OpenAI-shaped errors, and what the Router checks of a body around vLLM's protocol models: before them (lone
surrogates, choices, messages, text length), and after them (the fields they kept aside as unknown, the messages'
content parts and tool calls they left to be validated later, which member of a union an error is reported for).
Pure: no Ray, no vLLM import (vLLM's models are passed in), no FastAPI app state. Requests and answers themselves are
vLLM's (app/router/openai_surface.py)."""

from __future__ import annotations

import functools
import json
import re
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError


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
# The names pydantic gives a union's branches in an error's location (`stop.str`): not parameters. Its validators'
# names are bracketed (`function-after[f()]`, `list[str]`). Words such as `arguments` or `call`, which are pydantic's
# names elsewhere, are fields here (`tool_calls.0.function.arguments`).
_UNION_BRANCHES = frozenset({"str", "int", "float", "bool", "none", "bytes", "list", "dict", "tuple", "set"})
_VALIDATOR_NAME = re.compile(r"[\[\]{}()]")


def error_param(loc: tuple) -> str | None:
    """The parameter a pydantic error's location names, dotted (`messages.1.content.0.text`), or None."""
    # FastAPI puts where a parameter was ("body", "query", "path") first: the client knows it by its name alone.
    loc = loc[1:] if loc and loc[0] in ("body", "query", "path") else loc
    parts = [str(p) for p in loc if not (isinstance(p, str) and (_VALIDATOR_NAME.search(p) or p in _UNION_BRANCHES))]
    return ".".join(parts) or None


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """pydantic/FastAPI validation errors -> one OpenAI error naming the first offending parameter."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                           code="invalid_json")
    param = error_param(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        unknown = [error_param(tuple(e.get("loc", ()))) for e in errors if e.get("type") == "extra_forbidden"]
        return unrecognized_arguments(dict.fromkeys(unknown), honoured=frozenset(), completion_request=False)
    message = first["msg"].removeprefix("Value error, ")
    status = 400 if first.get("type") in REFUSED_VALUE_ERRORS else 422
    return OpenAIError(status, f"{param}: {message}" if param else message, param=param, code="invalid_value")


# A union's member in an error's location: pydantic names a TypedDict or model member by its class
# ("ChatCompletionUserMessageParam"); the fields of a request are snake_case.
_UNION_MEMBER = re.compile(r"[A-Z][A-Za-z0-9_]*")


def _member_at(loc: tuple) -> int | None:
    return next((i for i, part in enumerate(loc) if isinstance(part, str) and _UNION_MEMBER.fullmatch(part)), None)


def _one_of(choices: list[str]) -> str:
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"


def narrow_union_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """pydantic's errors for a value that matched no member of a union list every member's errors, each under the
    member's class name: a content part without its `text` is seven errors, one or two per kind of part, the first
    about an image. Kept: the errors of the member the value was meant for (one whose own literal, `role` or `type`,
    the value does not contradict; of those, the one with the fewest errors), the class name dropped from their
    location; where the value contradicts every member's literal, one error saying what that field may be."""
    errors = list(errors)
    while True:
        at = next(((tuple(e["loc"][:i]), i) for e in errors
                   if (i := _member_at(tuple(e.get("loc", ())))) is not None), None)
        if at is None:
            return errors
        prefix, i = at
        in_union = [e for e in errors if tuple(e["loc"][:i]) == prefix and _member_at(tuple(e["loc"])) == i]
        members: dict[str, list[dict[str, Any]]] = {}
        for error in in_union:
            members.setdefault(error["loc"][i], []).append(error)

        def own_literals(member_errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [e for e in member_errors if e.get("type") == "literal_error" and len(e["loc"]) == i + 2]

        meant = [member_errors for member_errors in members.values() if not own_literals(member_errors)]
        if meant:
            narrowed = [{**e, "loc": prefix + tuple(e["loc"][i + 1:])} for e in min(meant, key=len)]
        else:
            literals = [e for member_errors in members.values() for e in own_literals(member_errors)]
            field = literals[0]["loc"][-1]
            expected = list(dict.fromkeys((e.get("ctx") or {}).get("expected", "") for e in literals
                                          if e["loc"][-1] == field))
            narrowed = [{**literals[0], "loc": prefix + (field,), "msg": f"Input should be {_one_of(expected)}"}]
        grouped = {id(e) for e in in_union}
        before = errors.index(in_union[0])
        rest = [e for e in errors if id(e) not in grouped]
        errors = rest[:before] + narrowed + rest[before:]


# pydantic's lazily validating iterator: what a field typed `Iterable[...]` holds after validation.
_LAZY_ITERABLE = type(TypeAdapter(Iterable[int]).validate_python(()))


@functools.cache
def content_part_types(request_model: type) -> dict[str, TypeAdapter]:
    """The content parts of the message types of vLLM's request model, by the `type` each names: "text" -> a
    validator of its TypedDict."""
    parts: dict[str, TypeAdapter] = {}
    for message_type in filter(_is_typed_dict, _named_types(request_model.model_fields["messages"].annotation)):
        content = typing.get_type_hints(message_type).get("content")
        for part in filter(_is_typed_dict, _named_types(content)):
            kind = typing.get_type_hints(part).get("type")
            if typing.get_origin(kind) is typing.Literal:
                for name in typing.get_args(kind):
                    if name not in parts:
                        parts[name] = TypeAdapter(part)
    return parts


def check_messages(messages: Any, raw_messages: list, part_types: dict[str, TypeAdapter],
                   refusal: Callable[[ValidationError, tuple], Exception]) -> None:
    """Raise `refusal(error, place)` for a malformed content part or tool call, naming its place
    (`messages.0.content.0.text`). OpenAI's message types take `content` and `tool_calls` as Iterables, which pydantic
    validates lazily, when vLLM's renderer reads them: their errors came without the message's place and with every
    kind of content part's ("7 validation errors for ValidatorIterator"); they are read into lists here, as the
    renderer would read them (`raw_messages`: the body's, to tell an object pydantic iterated by its keys). And where
    vLLM's own message type took a content list, a part of a known `type` is checked against it: one without its
    `text` had passed as a part of no type, skipped with a warning in the log."""
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        for key, value in message.items():
            if isinstance(value, _LAZY_ITERABLE):
                try:
                    message[key] = list(value)
                except ValidationError as error:
                    if isinstance(raw_messages[index].get(key), dict):
                        # An Iterable takes an object as its keys: say what the field takes instead.
                        place = f"messages.{index}.{key}"
                        raise OpenAIError(400, f"{place}: Input should be a string or a list, not an object",
                                          param=place, code="invalid_value") from None
                    raise refusal(error, ("messages", index, key)) from None
        content = message.get("content")
        for part_index, part in enumerate(content if isinstance(content, list) else ()):
            part_type = part_types.get(part.get("type")) if isinstance(part, dict) else None
            if part_type is not None:
                try:
                    part_type.validate_python(part)
                except ValidationError as error:
                    raise refusal(error, ("messages", index, "content", part_index)) from None


def tool_calls_place(errors: list[dict[str, Any]], messages: Any) -> tuple:
    """Where errors without a place come from: vLLM's chat request model reads each assistant message's `tool_calls`
    into a list in a validator of its own, whose errors start at the call's index (`0.function.arguments`). The place
    is the message whose `tool_calls` hold the value one of them names; () for errors that have their place."""
    if not errors or not errors[0].get("loc") or not isinstance(errors[0]["loc"][0], int):
        return ()
    for error in errors:
        for index, message in enumerate(messages if isinstance(messages, list) else ()):
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            if isinstance(calls, list) and any(call is error.get("input") for call in calls):
                return ("messages", index, "tool_calls")
    return ()


# Fields outside vLLM's request models that the Router honours itself: the request class.
ROUTER_FIELDS = frozenset({"service_tier"})
# A body of thousands of unknown fields gets an error of a few names, not a copy of the body.
_NAMES_LISTED = 5
# What to use instead, for OpenAI fields that vLLM's models lack.
_INSTEAD = {"functions": "use tools", "function_call": "use tool_choice",
            "store": "this server stores no completions", "metadata": "it tags stored completions, and none are stored",
            "best_of": "this server returns the n choices it samples, no more: set n"}


# OpenAI fields that vLLM's models lack and that change no answer: an end user's id for abuse monitoring (as `user`,
# which vLLM's models have) and a hint for which requests share a cache (prefix-affinity routing finds those itself).
_NO_EFFECT_ON_THE_ANSWER = frozenset({"safety_identifier", "prompt_cache_key"})


def _asks_for_what_is_done(name: str, value: Any, n: int) -> bool:
    """An OpenAI field vLLM's models lack, set to what this server does anyway: `store: false` (no completion is
    stored), `best_of` equal to `n` (no candidates beyond the choices returned), `modalities: ["text"]`; or one that
    changes no answer (a string in `_NO_EFFECT_ON_THE_ANSWER`)."""
    if name in _NO_EFFECT_ON_THE_ANSWER:
        return isinstance(value, str)
    if name == "modalities":
        return value == ["text"]
    if name == "store":
        return value is False or value is None
    if name == "best_of":
        return value is None or (_is_number(value) and value == n)
    return False


def unrecognized_arguments(extra: dict[str, Any], honoured: frozenset[str] = ROUTER_FIELDS,
                           n: int = 1, completion_request: bool = True) -> OpenAIError | None:
    """The client's fields that vLLM's request model does not know (its `model_extra`): vLLM's server ignores them
    with a warning in its log; here they are refused, as OpenAI's API refuses them, so a misspelt `temprature` or an
    OpenAI feature this server lacks does not silently change the answer. None when every field is honoured.
    `honoured`: the fields the Router reads itself on this endpoint; `n`: the request's number of choices;
    `completion_request`: a chat or completion body, where OpenAI fields set to what is done anyway are taken."""
    unknown = sorted(name for name, value in extra.items() if name not in honoured
                     and not (completion_request and _asks_for_what_is_done(name, value, n)))
    if not unknown:
        return None
    first = unknown[0]
    listed = ", ".join(unknown[:_NAMES_LISTED]) + (f" and {len(unknown) - _NAMES_LISTED} more"
                                                   if len(unknown) > _NAMES_LISTED else "")
    message = (f"Unrecognized request argument supplied: {listed}" if len(unknown) == 1
               else f"Unrecognized request arguments supplied: {listed}")
    if first in _INSTEAD:
        message += f" ({first}: {_INSTEAD[first]})"
    return OpenAIError(400, message, param=first, code="unrecognized_argument")


def extra_fields(model: BaseModel, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, value) of every field that vLLM's request models kept aside as unknown (their `extra="allow"`),
    at any depth: `frobnicate`, `stream_options.include_usag`, `tools.0.x`."""
    for name, value in (model.model_extra or {}).items():
        yield f"{path}{name}", value
    for name in _fields_holding_models(type(model)):
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from extra_fields(value, f"{path}{name}.")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from extra_fields(item, f"{path}{name}.{index}.")


@functools.cache
def _fields_holding_models(model_type: type[BaseModel]) -> tuple[str, ...]:
    """The fields of `model_type` whose type names a pydantic model anywhere (a request model has ~70 fields and
    a handful of them can hold one: walking only those keeps the check to a few microseconds per request)."""
    def names_a_model(annotation: Any) -> bool:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return True
        return any(names_a_model(arg) for arg in typing.get_args(annotation))

    return tuple(name for name, field in model_type.model_fields.items() if names_a_model(field.annotation))


def _named_types(annotation: Any) -> Iterator[Any]:
    """The types a union, Optional or Iterable annotation names, at any depth, in order."""
    pending = [annotation]
    while pending:
        member = pending.pop(0)
        args = typing.get_args(member)
        if args:
            pending.extend(args)
        else:
            yield member


def _is_typed_dict(member: Any) -> bool:
    return hasattr(member, "__required_keys__")


@functools.cache
def message_keys(request_model: type) -> frozenset[str]:
    """Every key a chat message may have in vLLM's request model: those of the message types its `messages` union
    names (TypedDicts, or pydantic models with their aliases). vLLM validates a message against that union and drops
    the keys none of them has."""
    keys: set[str] = set()
    for member in _named_types(request_model.model_fields["messages"].annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            keys.update(name for name in member.model_fields)
            keys.update(field.alias for field in member.model_fields.values() if field.alias)
        elif _is_typed_dict(member):
            keys.update(member.__required_keys__ | member.__optional_keys__)
    return frozenset(keys)


def unknown_message_keys(messages: Any, known: frozenset[str]) -> Iterator[tuple[str, Any]]:
    """(`messages.<i>.<key>`, value) for each message key no message type has (a misspelt `contnet`)."""
    if not isinstance(messages, list):
        return
    for index, message in enumerate(messages):
        if isinstance(message, dict):
            for key in message.keys() - known:
                yield f"messages.{index}.{key}", message[key]


def _is_number(value: Any) -> bool:
    """A JSON number of either type (gRPC's openai_fields carry every number as a double), not a boolean."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def text_chars(value: Any) -> int:
    """Characters of text in a prompt or messages (strings anywhere inside; token ids count as none)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(text_chars(v) for v in value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    return 0


def check_counts(body: dict[str, Any], *, chat: bool, max_choices: int, max_messages: int) -> None:
    """Refuse, before rendering, a request for more choices (`n`) or a chat of more messages than the Router takes
    (router.max_choices, router.max_messages)."""
    choices = body.get("n")
    if _is_number(choices) and choices > max_choices:
        raise OpenAIError(400, f"n: {choices} choices is more than this server generates for one request "
                               f"({max_choices}, router.max_choices)", param="n", code="too_many_choices")
    messages = body.get("messages")
    if chat and isinstance(messages, list) and len(messages) > max_messages:
        raise OpenAIError(400, f"messages: {len(messages)} messages is more than this server takes "
                               f"({max_messages}, router.max_messages)", param="messages", code="too_many_messages")


def refuse_unrecognized_fields(request: BaseModel, body: dict[str, Any], *, chat: bool) -> None:
    """Raise the refusal of every field of a chat or completion body that vLLM's validated `request` kept aside as
    unknown, or (chat) a message key no message type of its model has."""
    unknown = dict(extra_fields(request))
    if chat:
        unknown.update(unknown_message_keys(body.get("messages"), message_keys(type(request))))
    unrecognized = unrecognized_arguments(unknown, n=getattr(request, "n", None) or 1)
    if unrecognized is not None:
        raise unrecognized


# What a chat template adds to the messages' text at most (role markers, a default system prompt, the generation
# prompt), and a completion prompt at most (BOS and the like), in tokens: bounds, not estimates.
CHAT_TEMPLATE_TOKENS_BOUND = 512
COMPLETION_EXTRA_TOKENS_BOUND = 8
_TEXT_PART_TYPES = frozenset({"text", "input_text"})


def prompt_tokens_bound(body: dict[str, Any], *, chat: bool) -> int | None:
    """At most how many tokens the body's prompt renders to, from the body alone (a BPE token covers at least one byte
    of UTF-8 text), or None where the body alone cannot say: content other than text (an image's tokens are not its
    URL's bytes), a chat template of the client's own, prompt embeddings, and an empty prompt (vLLM's code refuses
    it once rendered: the answer is its 400). For a completion of several prompts: the longest one's (each runs as a
    request of its own)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or body.get("chat_template") is not None:
            return None
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(not isinstance(part, dict) or part.get("type") not in _TEXT_PART_TYPES
                                                 for part in content):
                return None
        # The messages' and tools' JSON holds every text the template renders, and more (keys, quotes, escapes).
        rendered = [messages, body.get("tools"), body.get("documents"), body.get("chat_template_kwargs")]
        return len(json.dumps(rendered, ensure_ascii=False).encode()) + CHAT_TEMPLATE_TOKENS_BOUND
    if body.get("prompt_embeds") is not None:
        return None
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
    longest = 0
    for one in prompts:
        if not one:
            return None
        if isinstance(one, str):
            longest = max(longest, len(one.encode()))
        elif isinstance(one, list):
            longest = max(longest, len(one))
        else:
            return None
    suffix = body.get("suffix")
    return longest + (len(suffix.encode()) if isinstance(suffix, str) else 0) + COMPLETION_EXTRA_TOKENS_BOUND


def requested_max_tokens(body: dict[str, Any], default: int) -> int:
    """The answer's length the body asks for (max_completion_tokens, then max_tokens), or `default`."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default
