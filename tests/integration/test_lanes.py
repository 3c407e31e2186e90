"""Request classes end to end on the real engines: priority, the realtime cap, degrade, back-pressure, deadlines."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.integration.conftest import (TEST_INTERACTIVE_QUEUE_BOUND, TEST_MAX_NUM_SEQS, TEST_REALTIME_TIMEOUT_S,
                                        lane_stats, wait_until, wait_until_async)


async def first_token_time(client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None):
    """(monotonic time of the first content chunk or None, status, response headers), reading the stream to its end."""
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                             headers=headers or {}) as response:
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"text"' in line:
                first = time.monotonic()
        return first, response.status_code, response.headers


def long_body(model: str, tier: str, max_tokens: int, prompt: str = "tell me more") -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "service_tier": tier}


def engine_idle(app_url: str) -> bool:
    stats = lane_stats(app_url)
    return all(s["running"] == 0 and s["waiting"] == 0 and not s["inflight_by_class"] for s in stats.values())


@pytest.fixture(autouse=True)
def idle_engines(app_url):
    assert wait_until(lambda: engine_idle(app_url), timeout_s=60), lane_stats(app_url)
    yield


async def test_realtime_overtakes_queued_interactive(app_url, served_model):
    async with httpx.AsyncClient(timeout=120) as client:
        # Twice the engine's max_num_seqs: half run, half wait inside the engine.
        interactive = [asyncio.create_task(first_token_time(client, app_url, long_body(served_model, "default", 400)))
                       for _ in range(2 * TEST_MAX_NUM_SEQS)]
        assert await wait_until_async(lambda: lane_stats(app_url)["hot"]["waiting"] > 0, timeout_s=30)
        realtime_first, status, headers = await first_token_time(
            client, app_url, long_body(served_model, "priority", 8))
        results = await asyncio.gather(*interactive)
    assert status == 200 and headers["x-llm-lanes-request-class"] == "realtime"
    assert all(r[1] == 200 for r in results)
    later = sum(1 for first, _, _ in results if first > realtime_first)
    # Every interactive request still waiting in the engine when realtime arrived started after it.
    assert later >= TEST_MAX_NUM_SEQS - 1, (later, [r[0] - realtime_first for r in results])


async def test_interactive_overtakes_batch_on_the_cold_lane_after_a_long_context_degrade(app_url, served_model):
    long_prompt = " ".join(["lane"] * 1700)  # over local.yaml's long_context_threshold of 1536 tokens
    async with httpx.AsyncClient(timeout=120) as client:
        batch = [asyncio.create_task(first_token_time(client, app_url, long_body(served_model, "flex", 400)))
                 for _ in range(2 * TEST_MAX_NUM_SEQS)]
        assert await wait_until_async(lambda: lane_stats(app_url)["cold"]["waiting"] > 0, timeout_s=30)
        interactive_first, status, headers = await first_token_time(
            client, app_url, long_body(served_model, "default", 8, prompt=long_prompt))
        results = await asyncio.gather(*batch)
    assert status == 200
    assert headers["x-llm-lanes-lane"] == "cold" and headers["x-llm-lanes-request-class"] == "interactive"
    assert "long_context" in headers["x-llm-lanes-degraded"]
    later = sum(1 for first, _, _ in results if first > interactive_first)
    assert later >= TEST_MAX_NUM_SEQS - 1, later


async def test_realtime_in_flight_is_capped_at_four_per_hot_replica(app_url, served_model):
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.create_task(first_token_time(client, app_url, long_body(served_model, "priority", 200)))
                 for _ in range(12)]
        saw_waiting = await wait_until_async(lambda: lane_stats(app_url)["hot"]["gate_waiting_by_class"].get("realtime", 0) > 0,
                                 timeout_s=20, interval_s=0.05)
        results = await asyncio.gather(*tasks)
    assert all(status == 200 for _, status, _ in results)
    stats = lane_stats(app_url)["hot"]
    assert saw_waiting, "realtime requests beyond the cap should wait in front of the engine"
    assert stats["max_inflight_by_class"]["realtime"] == 4


async def test_interactive_burst_gets_429_with_retry_after_while_batch_completes(app_url, served_model):
    async def plain(client, body):
        response = await client.post(f"{app_url}/v1/completions", json=body)
        return response.status_code, response.headers, response.json()

    async with httpx.AsyncClient(timeout=180) as client:
        batch = [asyncio.create_task(plain(client, long_body(served_model, "flex", 32))) for _ in range(30)]
        burst = [asyncio.create_task(plain(client, long_body(served_model, "default", 64)))
                 for _ in range(3 * TEST_INTERACTIVE_QUEUE_BOUND)]
        burst_results = await asyncio.gather(*burst)
        batch_results = await asyncio.gather(*batch)
    refused = [r for r in burst_results if r[0] == 429]
    assert refused, "an interactive burst over the queue bound must be refused"
    for _, headers, body in refused:
        assert 1 <= int(headers["retry-after"]) <= 60
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
    assert all(r[0] in (200, 429) for r in burst_results)
    assert [r[0] for r in batch_results] == [200] * 30, "batch-class requests are never refused for load"


def test_timed_out_request_is_aborted_in_the_engine(app_url, served_model):
    started = time.monotonic()
    response = httpx.post(f"{app_url}/v1/completions", timeout=60,
                          json=long_body(served_model, "priority", 2000))  # ~6 s of decoding on this CPU
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert elapsed < TEST_REALTIME_TIMEOUT_S + 2
    assert wait_until(lambda: lane_stats(app_url)["hot"]["running"] == 0, timeout_s=10), lane_stats(app_url)
    # The timeout counted against the hot lane's breaker but one failure does not open it.
    follow_up = httpx.post(f"{app_url}/v1/completions", timeout=60, json=long_body(served_model, "priority", 4))
    assert follow_up.status_code == 200
