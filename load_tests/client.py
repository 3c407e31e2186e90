"""Build requests from a scenario and send them: one OpenAI-compatible HTTP request -> one `RequestRecord`.

Prompt sizes are approximated with common English words: each word below is one token in the tiny model's
byte-level BPE tokenizer (checked when this list was written) and in Llama-family tokenizers, so N words ~ N tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from load_tests.scenario import Scenario, StreamSpec

WORDS = (
    "the of and to in is that for it as with be on not this are by or an from at which if can but all will one has "
    "have its may when there been more other use used value return object data string file list name set time new "
    "type first only also each number line call function default method class module error any should must some "
    "these then than into over such two same after where both"
).split()


def words(rng: random.Random, n_tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_tokens))


@dataclass(frozen=True)
class RequestSpec:
    stream: str
    request_class: str
    index: int
    endpoint: str  # "chat" | "completions"
    streaming: bool
    body: dict[str, Any]

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


class PromptFactory:
    """Deterministic prompts per (seed, stream, request index), whatever order requests are issued in."""

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self._prefixes: dict[str, list[str]] = {}
        for stream in scenario.streams:
            if stream.shared_prefix is not None:
                rng = random.Random(f"{scenario.seed}:{stream.name}:prefixes")
                shared = stream.shared_prefix
                self._prefixes[stream.name] = [
                    words(rng, shared.prefix_tokens.sample(rng)) for _ in range(shared.groups)
                ]

    def prefixes(self, stream_name: str) -> list[str]:
        return self._prefixes.get(stream_name, [])

    def prompt(self, stream: StreamSpec, index: int) -> str:
        rng = random.Random(f"{self.scenario.seed}:{stream.name}:{index}")
        # A request number first: no two unshared prompts start alike, so only intended prefixes are shared.
        unique = f"request {index} " + words(rng, max(1, stream.prompt_tokens.sample(rng) - 2))
        if stream.shared_prefix is None:
            return unique
        prefix = rng.choice(self._prefixes[stream.name])
        return prefix + " question " + unique

    def request(self, stream: StreamSpec, index: int) -> RequestSpec:
        prompt = self.prompt(stream, index)
        body: dict[str, Any] = {
            "model": self.scenario.model_for(stream),
            "max_tokens": stream.max_tokens,
            "stream": stream.stream,
            "service_tier": stream.service_tier,
        }
        if stream.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if stream.stream:
            body["stream_options"] = {"include_usage": True}
        if stream.ignore_eos is not None:
            body["ignore_eos"] = stream.ignore_eos
        body.update(stream.extra_body)
        return RequestSpec(stream.name, stream.request_class, index, stream.endpoint, stream.stream, body)


@dataclass
class RequestRecord:
    stream: str
    request_class: str
    index: int
    streaming: bool
    start_s: float  # since the run's start
    # Open-loop arrivals (Poisson, burst): how late the generator sent the request after its scheduled arrival. A
    # generator short of CPU sends arrivals in clumps and its own stall counts as latency: this shows it.
    send_lag_s: float | None = None
    e2e_s: float | None = None
    ttft_s: float | None = None
    # Offsets from the request's start of every chunk that carried output text.
    chunk_offsets_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    # Prompt tokens the engine found in its prefix cache (usage.prompt_tokens_details.cached_tokens).
    cached_prompt_tokens: int | None = None
    usage_reported: bool = False
    status: int | None = None  # HTTP status; None when no response came (transport error, timeout)
    error: str | None = None
    retry_after: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def end_s(self) -> float | None:
        return None if self.e2e_s is None else self.start_s + self.e2e_s

    @property
    def error_key(self) -> str | None:
        """How this request's failure is counted: the HTTP status, or what went wrong without one."""
        if self.ok:
            return None
        if self.status is not None and self.status != 200:
            return str(self.status)
        return self.error.split(":", 1)[0] if self.error else "unknown"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if endpoint == "chat":
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


def _is_token_chunk(chunk: dict[str, Any], endpoint: str) -> bool:
    """A chunk reporting generated tokens, with or without text: it has a choice, and (chat) is not the role
    announcement that a server may send before any token. The usage-only last chunk has no choice."""
    choices = chunk.get("choices") or []
    if not choices:
        return False
    if endpoint == "chat":
        return not any("role" in (choice.get("delta") or {}) for choice in choices)
    return True


def _response_text(payload: dict[str, Any], endpoint: str) -> str:
    text = ""
    for choice in payload.get("choices") or []:
        if endpoint == "chat":
            text += (choice.get("message") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


def _take_usage(record: RequestRecord, payload: dict[str, Any]) -> None:
    usage = payload.get("usage")
    if usage:
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        record.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        record.cached_prompt_tokens = details.get("cached_tokens")
        record.usage_reported = True


async def send(
    client: httpx.AsyncClient, spec: RequestSpec, run_start: float, tally_headers: list[str], timeout_s: float,
    count_empty_chunks: bool = False, scheduled_s: float | None = None,
) -> RequestRecord:
    """One request; `scheduled_s` (since run_start) is when an open-loop arrival was due."""
    start = time.perf_counter()
    record = RequestRecord(spec.stream, spec.request_class, spec.index, spec.streaming, start - run_start)
    if scheduled_s is not None:
        record.send_lag_s = max(0.0, record.start_s - scheduled_s)
    try:
        await asyncio.wait_for(
            _exchange(client, spec, record, start, tally_headers, count_empty_chunks), timeout_s
        )
    except asyncio.TimeoutError:
        record.error = f"timeout: no complete answer within {timeout_s} s"
    except httpx.HTTPError as error:
        record.error = f"transport: {type(error).__name__}: {error}"
    record.e2e_s = time.perf_counter() - start
    if not record.usage_reported:
        # No usage chunk (server without include_usage support): one streamed chunk ~ one token.
        record.output_tokens = len(record.chunk_offsets_s)
    return record


async def _exchange(
    client: httpx.AsyncClient, spec: RequestSpec, record: RequestRecord, start: float, tally_headers: list[str],
    count_empty_chunks: bool = False,
) -> None:
    async with client.stream("POST", spec.path, json=spec.body) as response:
        record.status = response.status_code
        record.headers = {name: response.headers[name] for name in tally_headers if name in response.headers}
        record.retry_after = response.headers.get("retry-after")
        if response.status_code != 200:
            body = (await response.aread()).decode("utf-8", "replace")
            record.error = f"http: {body[:300]}"
            return
        if not spec.streaming:
            payload = json.loads(await response.aread())
            offset = time.perf_counter() - start
            if _response_text(payload, spec.endpoint):
                record.chunk_offsets_s.append(offset)
            # Without streaming the first token is only seen with the last: TTFT = E2E (conservative).
            record.ttft_s = offset
            _take_usage(record, payload)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                record.error = f"stream: {json.dumps(chunk['error'])[:300]}"
                break
            if _chunk_text(chunk, spec.endpoint) or (count_empty_chunks and _is_token_chunk(chunk, spec.endpoint)):
                offset = time.perf_counter() - start
                if record.ttft_s is None:
                    record.ttft_s = offset
                record.chunk_offsets_s.append(offset)
            _take_usage(record, chunk)
