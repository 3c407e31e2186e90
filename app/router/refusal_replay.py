"""A retry sent before its Retry-After is answered the same 429 by Serve's HTTP proxy, which costs almost nothing.

Under a retry storm most requests are refusals, and each one that reaches a Router costs more in Serve's
per-request work (the proxy's call to the replica, the replica's call back for the body, its request wrapper) than
in the Router's own decision: on a small host the refusals then take the CPU that the admitted streams need. A
Router's 429 carries a Retry-After; the proxy remembers that refusal until the Retry-After has passed and answers a
retry of the same request sent sooner with the same refusal, without calling a Router, after a pause of
`REPLAY_PAUSE_S` (or what is left of the Retry-After, if less): a loop that retries at once is slowed to about one
request a second, which costs the proxy a sleeping coroutine instead of the parsing and answering of five or ten.
Polite clients never meet it; a naive retry loop costs the Routers one request per Retry-After.

The same request: the same method, path and query, the same body byte for byte, and the same values of the headers
the Router reads (`Authorization`, `X-Request-Class`, `X-Request-Timeout`). A Router decides its 429 only after the
key, the class and the request's parameters have passed their checks (app/router/pipeline.py), so a replay is never
a 429 for what would be a 400, 401 or 403. What is remembered: a Router's 429 with a Retry-After, for at most
`MAX_REPLAY_S`, for a request to a generation endpoint with a declared body of at most `MAX_BODY_BYTES` (others
pass through unread), at most `MAX_ENTRIES` at once (the oldest forgotten first). Each proxy (one per node, and each
Router replica's own server under direct ingress) remembers its own refusals. A replayed answer carries
`x-llm-lanes-replayed: 1`, a Retry-After counted down to the remembered time, and its own request id; the proxy
counts them in `llm_lanes_refusals_replayed_total`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# The endpoints whose refusals are remembered (path suffixes, so a route prefix is allowed).
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
# The request headers the Router's answer depends on besides the body (lower case, as ASGI has them).
KEYED_HEADERS = (b"authorization", b"x-request-class", b"x-request-timeout")
MAX_BODY_BYTES = 64 * 1024  # a request with a larger (or no) declared body is passed on unread
MAX_REFUSAL_BYTES = 16 * 1024  # a 429 body larger than this is not remembered
MAX_REPLAY_S = 60.0  # a longer Retry-After is remembered this long
MAX_ENTRIES = 20_000  # about 10 MiB of remembered refusals at most
REPLAY_PAUSE_S = 1.0  # an early retry's refusal is answered after this long (at most its remaining Retry-After)
REPLAYED_HEADER = b"x-llm-lanes-replayed"
REPLAYED_METRIC = "llm_lanes_refusals_replayed_total"

# Response headers that belong to one answer, not to the refusal: the replay sets its own.
_PER_ANSWER_HEADERS = frozenset({b"x-request-id", b"retry-after", b"date", b"server"})


@dataclass(frozen=True)
class Refusal:
    """A remembered 429: its status line's headers (less the per-answer ones) and body, until `until_s`."""
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    until_s: float


def request_key(method: str, path: str, query: bytes, headers: Any, body: bytes) -> bytes:
    """What makes two requests the same to a Router: method, path, query, the keyed headers and the body."""
    digest = hashlib.blake2b(digest_size=32)
    for part in (method.encode(), path.encode(), query):
        digest.update(len(part).to_bytes(4, "big") + part)
    values = dict.fromkeys(KEYED_HEADERS, b"")
    for name, value in headers:
        if name in values:
            values[name] = value
    for name in KEYED_HEADERS:
        digest.update(len(values[name]).to_bytes(4, "big") + values[name])
    digest.update(body)
    return digest.digest()


def retry_after_s(headers: Any) -> float | None:
    """The Retry-After (seconds) among a response's headers, or None without a usable one."""
    for name, value in headers:
        if name.lower() == b"retry-after":
            try:
                seconds = float(value)
            except ValueError:
                return None
            return seconds if math.isfinite(seconds) and seconds > 0 else None
    return None


class RefusalMemory:
    """Refusals by request key until their Retry-After; bounded, the oldest forgotten first."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_replay_s: float = MAX_REPLAY_S):
        self.max_entries = max_entries
        self.max_replay_s = max_replay_s
        self._refusals: OrderedDict[bytes, Refusal] = OrderedDict()

    def __len__(self) -> int:
        return len(self._refusals)

    def remember(self, key: bytes, headers: Any, body: bytes, retry_after: float, now: float) -> None:
        kept = tuple((name, value) for name, value in headers if name.lower() not in _PER_ANSWER_HEADERS)
        self._refusals.pop(key, None)
        self._refusals[key] = Refusal(kept, body, now + min(retry_after, self.max_replay_s))
        self._forget_expired(now)
        while len(self._refusals) > self.max_entries:
            self._refusals.popitem(last=False)

    def recall(self, key: bytes, now: float) -> Refusal | None:
        """The refusal to replay for this request now, or None (never refused, or its Retry-After has passed)."""
        refusal = self._refusals.get(key)
        if refusal is None:
            return None
        if refusal.until_s <= now:
            del self._refusals[key]
            return None
        return refusal

    def _forget_expired(self, now: float) -> None:
        # Entries are in the order they were remembered, and each lasts at most max_replay_s: the expired are
        # mostly at the front.
        while self._refusals:
            key, oldest = next(iter(self._refusals.items()))
            if oldest.until_s > now:
                break
            del self._refusals[key]


def replayed_headers(refusal: Refusal, request_headers: Any, now: float) -> list[tuple[bytes, bytes]]:
    """The replay's headers: the refusal's own, a Retry-After counted down, the request's id (or a new one)."""
    request_id = next((value for name, value in request_headers if name == b"x-request-id"), None)
    return [*refusal.headers, (b"retry-after", str(max(1, math.ceil(refusal.until_s - now))).encode()),
            (b"x-request-id", request_id or uuid.uuid4().hex.encode()), (REPLAYED_HEADER, b"1")]


class RefusalReplay:
    """ASGI middleware: answers a retry sent before its Retry-After with the Router's remembered 429."""

    def __init__(self, app: Any, memory: RefusalMemory | None = None, counter: Any = None,
                 pause_s: float = REPLAY_PAUSE_S):
        self.app = app
        self.memory = memory if memory is not None else RefusalMemory()
        self._counter = counter
        self.pause_s = pause_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if not _replayable(scope):
            await self.app(scope, receive, send)
            return
        received: list[dict] = []
        body = bytearray()
        while True:
            message = await receive()
            received.append(message)
            if message.get("type") != "http.request":
                break  # the client went away: the app hears it
            body += message.get("body", b"")
            if len(body) > MAX_BODY_BYTES or not message.get("more_body", False):
                break
        complete = received[-1].get("type") == "http.request" and not received[-1].get("more_body", False)
        key = (request_key(scope["method"], scope["path"], scope.get("query_string", b""), scope["headers"],
                           bytes(body)) if complete and len(body) <= MAX_BODY_BYTES else None)
        if key is not None:
            refusal = self.memory.recall(key, time.monotonic())
            if refusal is not None:
                await asyncio.sleep(max(0.0, min(self.pause_s, refusal.until_s - time.monotonic())))
                now = time.monotonic()
                await send({"type": "http.response.start", "status": 429,
                            "headers": replayed_headers(refusal, scope["headers"], now)})
                await send({"type": "http.response.body", "body": refusal.body, "more_body": False})
                self._count()
                return

        async def replay_receive() -> dict:
            if received:
                return received.pop(0)
            return await receive()

        await self.app(scope, replay_receive, send if key is None else self._remembering(send, key))

    def _remembering(self, send: Any, key: bytes) -> Any:
        """`send`, noting a 429 with a Retry-After on its way to the client."""
        refused: dict[str, Any] = {}

        async def remembering_send(message: dict) -> None:
            kind = message.get("type")
            if kind == "http.response.start":
                retry_after = retry_after_s(message.get("headers", ()))
                if message.get("status") == 429 and retry_after is not None:
                    refused.update(headers=list(message.get("headers", ())), body=bytearray(),
                                   retry_after=retry_after)
            elif kind == "http.response.body" and refused:
                refused["body"] += message.get("body", b"")
                if len(refused["body"]) > MAX_REFUSAL_BYTES:
                    refused.clear()
                elif not message.get("more_body", False):
                    self.memory.remember(key, refused["headers"], bytes(refused["body"]), refused["retry_after"],
                                         time.monotonic())
                    refused.clear()
            await send(message)

        return remembering_send

    def _count(self) -> None:
        if self._counter is None:
            self._counter = _replayed_counter()
        self._counter.inc()


def _replayable(scope: dict) -> bool:
    if scope.get("type") != "http" or scope.get("method") != "POST" or not scope.get("path", "").endswith(
            GENERATION_PATHS):
        return False
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.isdigit() and int(value) <= MAX_BODY_BYTES
    return False


class _NoCounter:
    def inc(self, value: float = 1.0) -> None:
        pass


def _replayed_counter() -> Any:
    """Ray's counter in the proxy's process (a Ray worker); none where Ray is not connected (a plain server)."""
    try:
        import ray
        from ray.util.metrics import Counter

        if not ray.is_initialized():
            return _NoCounter()
        return Counter(REPLAYED_METRIC, description="429s answered by the HTTP proxy to a retry sent before "
                                                    "the Router's Retry-After, without calling a Router")
    except Exception:  # metrics must never fail a refusal
        return _NoCounter()
