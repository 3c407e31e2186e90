"""One tenant's flood, from a process of its own: `concurrency` completions always in flight until stdin closes,
then a JSON line of the answers' status counts, under "lanes" how many each lane served, and under "cpu_s" the
CPU seconds the flood's own client took.

A tenant is another client than the one measured beside it: run in the test's own process, the flood's threads
took the measuring client's CPU and interpreter, and its request times measured the client, not the app.

    FLOOD_API_KEY=sk-... python -m tests.integration.tenant_flood URL MODEL CONCURRENCY MAX_TOKENS
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections import Counter

import httpx

PROMPT = "tell me a story " * 8


async def flood(url: str, model: str, key: str, concurrency: int, max_tokens: int) -> dict:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    # stdin closing (the test's signal, or the test process gone) stops the flood.
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
    statuses: Counter[int] = Counter()
    lanes: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency),
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        async def worker() -> None:
            while not stop.is_set():
                answer = await client.post(f"{url}/v1/completions", json={
                    "model": model, "prompt": PROMPT, "max_tokens": max_tokens})
                statuses[answer.status_code] += 1
                if answer.status_code == 200:
                    lanes[answer.headers.get("x-llm-lanes-lane", "?")] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {**statuses, "lanes": lanes, "cpu_s": round(time.process_time(), 1)}


def main() -> None:
    url, model, concurrency, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    statuses = asyncio.run(flood(url, model, os.environ["FLOOD_API_KEY"], concurrency, max_tokens))
    print(json.dumps(statuses))


if __name__ == "__main__":
    main()
