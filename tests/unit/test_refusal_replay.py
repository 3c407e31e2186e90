"""The proxy answers a retry sent before its Retry-After with the Router's remembered 429, and nothing else."""

import asyncio
import json

import pytest

from app.router.refusal_replay import (
    MAX_BODY_BYTES,
    REPLAYED_HEADER,
    RefusalMemory,
    RefusalReplay,
    request_key,
    retry_after_s,
)

CHAT = "/v1/chat/completions"
REFUSAL = {"error": {"message": "the hot lane is full; retry in 3 s", "code": "hot_lane_full"}}


class Counter:
    def __init__(self):
        self.value = 0

    def inc(self, value=1.0):
        self.value += value


class Router:
    """The app behind the proxy: answers each request with the next of `answers` ((status, headers)), and
    records what it received."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.bodies.append(body)
        status, headers = self.answers.pop(0)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        payload = json.dumps(REFUSAL if status == 429 else {"ok": True}).encode()
        await send({"type": "http.response.body", "body": payload[:10], "more_body": True})
        await send({"type": "http.response.body", "body": payload[10:], "more_body": False})


def refused(retry_after="3"):
    return 429, [(b"content-type", b"application/json"), (b"retry-after", retry_after.encode()),
                 (b"x-request-id", b"router-1")]


OK = (200, [(b"content-type", b"application/json")])


def call(middleware, body=b'{"messages": []}', path=CHAT, headers=(), pieces=1, method="POST"):
    """One request through the middleware: (status, headers dict, body)."""
    size = len(body)
    step = max(1, -(-size // pieces))
    messages = [{"type": "http.request", "body": body[i:i + step], "more_body": i + step < size}
                for i in range(0, max(size, 1), step)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [(b"content-length", str(size).encode()), *headers]}
    asyncio.run(middleware(scope, receive, send))
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


class Clock(list):
    """[now]; `pauses`: what the middleware slept."""

    def __init__(self, values):
        super().__init__(values)
        self.pauses: list[float] = []


@pytest.fixture
def clock(monkeypatch):
    """The middleware's clock, and its pauses (asyncio.sleep) recorded and passed on the clock at once."""
    now = Clock([1000.0])
    pauses = now.pauses

    async def pause(seconds):
        pauses.append(seconds)
        now[0] += seconds

    monkeypatch.setattr("app.router.refusal_replay.time.monotonic", lambda: now[0])
    monkeypatch.setattr("app.router.refusal_replay.asyncio.sleep", pause)
    return now


def test_a_retry_before_its_retry_after_gets_the_same_refusal_without_reaching_the_router(clock):
    router, counter = Router(refused("3")), Counter()
    replay = RefusalReplay(router, counter=counter)
    first = call(replay, pieces=3)
    clock[0] += 0.8
    again = call(replay, headers=[(b"x-request-id", b"client-7")])
    assert len(router.bodies) == 1 and router.bodies[0] == b'{"messages": []}'  # the body reached it whole
    assert first[0] == again[0] == 429 and again[2] == first[2] and json.loads(again[2]) == REFUSAL
    # Answered after a pause of a second, the Retry-After counted down from the Router's 3 s over both.
    assert clock.pauses == [1.0] and again[1][b"retry-after"] == b"2"
    assert again[1][REPLAYED_HEADER] == b"1" and again[1][b"x-request-id"] == b"client-7"
    assert REPLAYED_HEADER not in first[1] and first[1][b"x-request-id"] == b"router-1"
    assert counter.value == 1


def test_after_the_retry_after_the_request_reaches_the_router_again(clock):
    router = Router(refused("2"), OK)
    replay = RefusalReplay(router, counter=Counter())
    call(replay)
    clock[0] += 1.6
    assert call(replay)[0] == 429 and clock.pauses == [pytest.approx(0.4)]  # no pause past the Retry-After
    assert call(replay)[0] == 200 and len(router.bodies) == 2


def test_another_body_key_class_or_timeout_is_another_request(clock):
    router = Router(refused(), OK, OK, OK, OK)
    replay = RefusalReplay(router, counter=Counter())
    call(replay, headers=[(b"authorization", b"Bearer a")])
    assert call(replay, body=b'{"messages": [1]}', headers=[(b"authorization", b"Bearer a")])[0] == 200
    assert call(replay, headers=[(b"authorization", b"Bearer b")])[0] == 200
    assert call(replay, headers=[(b"authorization", b"Bearer a"), (b"x-request-class", b"batch")])[0] == 200
    assert call(replay, headers=[(b"authorization", b"Bearer a"), (b"x-request-timeout", b"5")])[0] == 200
    assert len(router.bodies) == 5


def test_only_a_429_with_a_retry_after_is_remembered(clock):
    no_retry_after = (429, [(b"content-type", b"application/json")])
    router = Router(no_retry_after, no_retry_after, (400, []), (400, []), (503, [(b"retry-after", b"5")]), OK)
    replay = RefusalReplay(router, counter=Counter())
    statuses = [call(replay)[0] for _ in range(3)] + [call(replay, body=b"{}")[0] for _ in range(3)]
    assert statuses == [429, 429, 400, 400, 503, 200] and len(router.bodies) == 6


def test_requests_it_does_not_read_pass_through_untouched(clock):
    router = Router(refused(), refused(), refused(), refused())
    replay = RefusalReplay(router, counter=Counter())
    call(replay, path="/v1/embeddings")
    call(replay, path="/v1/embeddings")
    big = b" " * (MAX_BODY_BYTES + 1)
    call(replay, body=big, pieces=4)
    call(replay, body=big, pieces=4)
    assert len(router.bodies) == 4 and router.bodies[2] == big


def test_the_memory_is_bounded_and_forgets_the_expired_and_the_oldest():
    memory = RefusalMemory(max_entries=3, max_replay_s=10.0)
    for index in range(5):
        memory.remember(bytes([index]), [(b"retry-after", b"1")], b"", 1.0, now=100.0)
    assert len(memory) == 3 and memory.recall(bytes([0]), 100.5) is None and memory.recall(bytes([4]), 100.5)
    memory.remember(b"long", [], b"", 3600.0, now=100.0)
    assert memory.recall(b"long", 109.0) is not None and memory.recall(b"long", 110.0) is None
    memory.remember(b"late", [], b"", 1.0, now=200.0)
    assert len(memory) == 1  # the expired went when a new one came


def test_request_keys_and_retry_after_values():
    same = request_key("POST", CHAT, b"", [(b"user-agent", b"x"), (b"authorization", b"k")], b"{}")
    assert same == request_key("POST", CHAT, b"", [(b"authorization", b"k"), (b"user-agent", b"y")], b"{}")
    assert same != request_key("POST", CHAT, b"a=1", [(b"authorization", b"k")], b"{}")
    assert retry_after_s([(b"Retry-After", b"4")]) == 4.0
    assert retry_after_s([(b"retry-after", b"soon")]) is None
    assert retry_after_s([(b"retry-after", b"0")]) is None
    assert retry_after_s([]) is None
