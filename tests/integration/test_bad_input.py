"""A client's bad input is that client's 4xx, on the real app: 1,200 generated hostile and 300 generated edge chat and
completion bodies (tests/hostile_requests.py), plus the requests that used to switch the lanes off, get 0 responses
5xx and open 0 breakers, and after every 100 of them a valid request is answered 200 by the hot lane."""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import Counter

import httpx

from tests.hostile_requests import CHAT, COMPLETIONS, edge_requests, encoded, generated, requests_
from tests.integration.conftest import router_stats

# Hostile bodies sent to the real app; tests/unit/test_bad_input.py sends more of them to the Router's HTTP surface
# over fake lanes, where each costs milliseconds.
GENERATED = 1200  # hostile
EDGES = 300  # valid, at the edges of what the engine takes
BLOCK = 100  # requests between two checks of the breakers and the hot lane
CONCURRENCY = 32

# The requests of the report: each answered 503 and counted against a lane's breaker before.
ISSUE_CASES = [
    (COMPLETIONS, {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4, "stop": [""]}),
    (COMPLETIONS, {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4, "seed": 18446744073709551616}),
    (CHAT, {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stop": ""}),
    (CHAT, {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "seed": 2**64}),
    (COMPLETIONS, {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4, "service_tier": "flex", "stop": [""]}),
    (COMPLETIONS, {"model": "tiny-llama", "prompt": [1, 2, 2048], "max_tokens": 4}),
    (COMPLETIONS, {"model": "tiny-llama", "prompt": "a\ud800", "max_tokens": 4}),
    (CHAT, {"model": "tiny-llama", "messages": [{"role": "user", "content": "\udfff"}], "max_tokens": 4}),
]
# Found by this test's generators (each answered 500 before): a service_tier of another JSON type than a string.
FOUND_CASES = [
    (COMPLETIONS, {"model": "tiny-llama", "prompt": "hi", "max_tokens": 4, "service_tier": []}),
    (CHAT, {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "service_tier": {"tier": "flex"}}),
]
VALID = {"model": "tiny-llama", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2}


async def send(client: httpx.AsyncClient, gate: asyncio.Semaphore, path: str, raw: bytes) -> tuple[int, str]:
    async with gate:
        response = await client.post(path, content=raw, headers={"content-type": "application/json"})
        return response.status_code, response.text[:300]


def test_bad_input_gets_4xx_and_never_takes_a_lane_down(app_url):
    began = time.monotonic()
    hostile, edges = generated(requests_(), GENERATED), generated(edge_requests(), EDGES)
    known = ISSUE_CASES * 25 + FOUND_CASES * 5
    requests = [(path, encoded(payload)) for path, payload in known] + hostile + edges
    # Mixed, so the engine works on valid requests while the hostile ones arrive.
    requests.sort(key=lambda request: zlib.crc32(request[1]))
    generated_s = time.monotonic() - began
    statuses: Counter[int] = Counter()
    server_errors: list[tuple[int, str, bytes, str]] = []
    checks: list[str] = []

    async def run() -> None:
        gate = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=app_url, timeout=120, limits=limits) as client:
            for start in range(0, len(requests), BLOCK):
                block = requests[start:start + BLOCK]
                answers = await asyncio.gather(*(send(client, gate, path, raw) for path, raw in block))
                for (path, raw), (status, text) in zip(block, answers):
                    statuses[status] += 1
                    if status >= 500:
                        server_errors.append((status, path, raw[:300], text))
                breakers = (await client.get("/v1/admin/stats")).json()["router"]["breakers"]
                valid = await client.post(CHAT, json=VALID)
                lane = valid.headers.get("x-llm-lanes-lane")
                if set(breakers.values()) != {"closed"} or valid.status_code != 200 or lane != "hot":
                    checks.append(f"after {start + len(block)}: breakers {breakers}, valid request "
                                  f"{valid.status_code} on {lane} lane ({valid.text[:200]})")

    asyncio.run(run())
    elapsed_s = time.monotonic() - began
    print(f"\n{len(requests)} requests ({len(hostile)} generated hostile, {len(edges)} generated at the engine's "
          f"edges, {len(known)} known from the report and earlier runs) in {elapsed_s:.0f} s (generation "
          f"{generated_s:.0f} s): statuses {dict(sorted(statuses.items()))}; {len(checks)} failed checks of "
          f"{-(-len(requests) // BLOCK)}")
    assert len(hostile) == GENERATED and len(edges) == EDGES
    assert not server_errors, f"{len(server_errors)} answers 5xx, e.g. {server_errors[:5]}"
    assert not checks, checks
    assert set(router_stats(app_url)["breakers"].values()) == {"closed"}
