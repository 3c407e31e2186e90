"""Drive a scenario against one URL: every stream's arrival process at once, one record per request."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import httpx

from load_tests.client import PromptFactory, RequestRecord, RequestSpec, send
from load_tests.scenario import Scenario, StreamSpec

# Enough connections that the client never becomes the queue being measured.
MAX_CONNECTIONS = 2048
WARMUP_MAX_TOKENS = 4

OnDone = Callable[[RequestRecord], None]


async def run_scenario(
    scenario: Scenario, base_url: str, on_done: OnDone | None = None
) -> tuple[list[RequestRecord], float]:
    """Returns the records (in completion order) and the wall time of the measured part in seconds."""
    limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS)
    # The per-request deadline is enforced by `send`; httpx's own timeouts only guard against a dead socket.
    timeout = httpx.Timeout(scenario.request_timeout_s, connect=30.0)
    factory = PromptFactory(scenario)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        await _warm_up(client, scenario, factory)
        records: list[RequestRecord] = []
        run_start = time.perf_counter()

        def finished(record: RequestRecord) -> None:
            records.append(record)
            if on_done is not None:
                on_done(record)

        await asyncio.gather(
            *(_run_stream(client, scenario, factory, stream, run_start, finished) for stream in scenario.streams)
        )
        return records, time.perf_counter() - run_start


async def _warm_up(client: httpx.AsyncClient, scenario: Scenario, factory: PromptFactory) -> None:
    for i in range(scenario.warmup_requests):
        stream = scenario.streams[i % len(scenario.streams)]
        spec = factory.request(stream, -1 - i)
        body = dict(spec.body, max_tokens=WARMUP_MAX_TOKENS)
        warm = RequestSpec(spec.stream, spec.request_class, spec.index, spec.endpoint, spec.streaming, body)
        await send(client, warm, time.perf_counter(), [], scenario.request_timeout_s, scenario.count_empty_chunks)


async def _run_stream(
    client: httpx.AsyncClient,
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

    async def one(index: int) -> None:
        finished(await send(client, factory.request(stream, index), run_start, tally, timeout_s,
                            scenario.count_empty_chunks))

    def elapsed() -> float:
        return time.perf_counter() - run_start - stream.start_s

    await asyncio.sleep(stream.start_s)
    arrival = stream.arrival
    if arrival.type == "burst":
        await asyncio.sleep(arrival.at_s)
        await asyncio.gather(*(one(i) for i in range(arrival.n)))
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
            tasks.append(asyncio.create_task(one(index)))
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
