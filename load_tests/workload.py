"""Drive a scenario against the app: every stream's arrival process at once, one record per request.

The base URL may list several servers, comma-separated (the Router replicas' own ports under direct ingress,
load_tests/direct_ingress.py); requests then go to them in turn, as a round-robin load balancer would send them."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from load_tests.client import PromptFactory, RequestRecord, RequestSpec, send
from load_tests.scenario import Scenario, StreamSpec

# Enough connections that the client never becomes the queue being measured.
MAX_CONNECTIONS = 2048
# Outstanding requests per HTTP client (ClientPool): above a few dozen, httpcore's per-request pool scan costs the
# generator more CPU than a 2-core host can spare.
REQUESTS_PER_CLIENT = 32
WARMUP_MAX_TOKENS = 4

OnDone = Callable[[RequestRecord], None]


def split(total: int, parts: int) -> list[int]:
    """`total` spread over `parts` as evenly as integers allow (earlier parts take the remainder): requests or
    streams over client processes."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split_urls(base_url: str) -> list[str]:
    """'http://a:1, http://b:2' -> ['http://a:1', 'http://b:2']; one URL is a list of one."""
    urls = [url.strip().rstrip("/") for url in base_url.split(",") if url.strip()]
    if not urls:
        raise ValueError(f"no URL in {base_url!r}")
    return urls


class ClientPool:
    """`async with ClientPool(base_url, clients_per_server=1, **httpx_client_options) as pool`: HTTP clients for
    each server of the base URL (split_urls), closed on exit; `pool.next()` hands them out round robin.

    Several clients per server when many requests are outstanding at once: httpcore's connection pool scans all of
    its connections for every request it places, so one client holding 256 connections kept the load generator's
    event loop busy for seconds at a time and sent the scenario's arrivals in clumps (mixed_backlog.yaml:
    py-spy showed the loop in httpcore's connection pool). The latency measured was the generator's."""

    def __init__(self, base_url: str, clients_per_server: int = 1, **client_options: Any):
        if clients_per_server < 1:
            raise ValueError(f"clients_per_server must be >= 1, got {clients_per_server}")
        self.clients = [httpx.AsyncClient(base_url=url, **client_options)
                        for _ in range(clients_per_server) for url in split_urls(base_url)]
        self._turn = itertools.cycle(self.clients)

    def next(self) -> httpx.AsyncClient:
        return next(self._turn)

    async def __aenter__(self) -> "ClientPool":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for client in self.clients:
            await client.aclose()


async def run_scenario(
    scenario: Scenario, base_url: str, on_done: OnDone | None = None
) -> tuple[list[RequestRecord], float]:
    """Returns the records (in completion order) and the wall time of the measured part in seconds."""
    limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS)
    # The per-request deadline is enforced by `send`; httpx's own timeouts only guard against a dead socket.
    timeout = httpx.Timeout(scenario.request_timeout_s, connect=30.0)
    factory = PromptFactory(scenario)
    clients = max(1, math.ceil(peak_outstanding(scenario) / REQUESTS_PER_CLIENT))
    async with ClientPool(base_url, clients_per_server=clients, limits=limits, timeout=timeout) as pool:
        await _warm_up(pool, scenario, factory)
        records: list[RequestRecord] = []
        run_start = time.perf_counter()

        def finished(record: RequestRecord) -> None:
            records.append(record)
            if on_done is not None:
                on_done(record)

        await asyncio.gather(
            *(_run_stream(pool, scenario, factory, stream, run_start, finished) for stream in scenario.streams)
        )
        return records, time.perf_counter() - run_start


def peak_outstanding(scenario: Scenario) -> int:
    """Requests the scenario's closed-loop and burst streams keep outstanding at once (Poisson streams add their
    rate: about one second's arrivals in flight)."""
    total = 0
    for stream in scenario.streams:
        arrival = stream.arrival
        if arrival.type == "closed":
            total += arrival.concurrency
        elif arrival.type == "burst":
            total += arrival.n
        else:
            total += math.ceil(arrival.rate)
    return total


async def _warm_up(pool: ClientPool, scenario: Scenario, factory: PromptFactory) -> None:
    # At least one request per client (so per server), so each has a connection open before the measured part.
    for i in range(max(scenario.warmup_requests, len(pool.clients) if scenario.warmup_requests else 0)):
        stream = scenario.streams[i % len(scenario.streams)]
        spec = factory.request(stream, -1 - i)
        body = dict(spec.body, max_tokens=WARMUP_MAX_TOKENS)
        warm = RequestSpec(spec.stream, spec.request_class, spec.index, spec.endpoint, spec.streaming, body)
        await send(pool.next(), warm, time.perf_counter(), [], scenario.request_timeout_s, scenario.count_empty_chunks)


async def _run_stream(
    pool: ClientPool,
    scenario: Scenario,
    factory: PromptFactory,
    stream: StreamSpec,
    run_start: float,
    finished: OnDone,
) -> None:
    duration = scenario.stream_duration_s(stream)
    count = stream.arrival.n if stream.arrival.type == "burst" else stream.count
    tally = scenario.tally_headers
    timeout_s = scenario.request_timeout_s

    async def one(index: int, scheduled_s: float | None = None) -> None:
        finished(await send(pool.next(), factory.request(stream, index), run_start, tally, timeout_s,
                            scenario.count_empty_chunks, scheduled_s))

    def elapsed() -> float:
        return time.perf_counter() - run_start - stream.start_s

    await asyncio.sleep(stream.start_s)
    arrival = stream.arrival
    if arrival.type == "burst":
        await asyncio.sleep(arrival.at_s)
        await asyncio.gather(*(one(i, stream.start_s + arrival.at_s) for i in range(arrival.n)))
    elif arrival.type == "poisson":
        rng = random.Random(f"{scenario.seed}:{stream.name}:arrivals")
        tasks: list[asyncio.Task[None]] = []
        next_at = rng.expovariate(arrival.rate)
        index = 0
        while (count is None or index < count) and (duration is None or next_at < duration):
            delay = next_at - elapsed()
            if delay > 0:
                await asyncio.sleep(delay)
            # Open loop: the next arrival does not wait for this one to finish.
            tasks.append(asyncio.create_task(one(index, stream.start_s + next_at)))
            index += 1
            next_at += rng.expovariate(arrival.rate)
        await asyncio.gather(*tasks)
    else:
        issued = 0

        async def worker() -> None:
            nonlocal issued
            while (count is None or issued < count) and (duration is None or elapsed() < duration):
                index = issued
                issued += 1
                await one(index)

        await asyncio.gather(*(worker() for _ in range(arrival.concurrency)))
