"""Request classes end to end on the real engines: priority, the realtime cap, degrade, back-pressure, deadlines.

The tiny model decodes a step of 8 sequences in ~2 ms on one core, faster than this 2-core machine's HTTP path can
bring requests in; contention inside an engine therefore needs long generations (1000+ tokens).
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from app.config import load_app_config
from app.lanes.cpu_priority import descendant_pids, parse_cpu_list
from tests.integration.conftest import (TEST_HOT_MAX_NUM_SEQS, TEST_INTERACTIVE_QUEUE_BOUND, TEST_MAX_NUM_SEQS,
                                        lane_stats, local_test_document, wait_until, wait_until_async)


async def first_token_time(client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None,
                           on_first_token=None):
    """(monotonic time of the first content chunk or None, status, response headers), reading the stream to its end.
    `on_first_token(response headers)` is called as the first content chunk arrives."""
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                             headers=headers or {}) as response:
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"text"' in line:
                first = time.monotonic()
                if on_first_token is not None:
                    on_first_token(response.headers)
        return first, response.status_code, response.headers


async def plain_completion(client: httpx.AsyncClient, url: str, body: dict):
    response = await client.post(f"{url}/v1/completions", json=body)
    return response.status_code, response.headers, response.json()


def long_body(model: str, tier: str, max_tokens: int, prompt: str = "tell me more") -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "service_tier": tier}


# Interactive streams that end this soon after a realtime request is sent can end before its first token anyway
# (realtime's first token takes tens of milliseconds here).
STREAM_END_MARGIN_S = 0.3
# As long as the tiny model's 2,048-token context allows: the streams holding the hot slots must still run when the
# realtime request is sent. 1,200 tokens streamed in 0.8 s on the 2-core host, less than the margin once was.
INTERACTIVE_STREAM_TOKENS = 2000


def engine_idle(app_url: str) -> bool:
    stats = lane_stats(app_url)
    return all(s["running"] == 0 and s["waiting"] == 0 and not s["inflight_by_class"] for s in stats.values())


@pytest.fixture(autouse=True)
def idle_engines(app_url):
    assert wait_until(lambda: engine_idle(app_url), timeout_s=60), lane_stats(app_url)
    yield


def router_stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/admin/stats", timeout=30).json()["router"]


async def first_and_last_token_time(client: httpx.AsyncClient, url: str, body: dict, on_first_token=None):
    """(first content chunk time, end of stream time, status, headers) of a streamed completion."""
    first, status, headers = await first_token_time(client, url, body, on_first_token=on_first_token)
    return first, time.monotonic(), status, headers


async def test_realtime_never_waits_for_the_hot_lanes_interactive_slots(app_url, served_model):
    slots = router_stats(app_url)["hot_slots"]
    # Nothing here blocks the event loop that reads the streams: the times compared below are when each stream's
    # chunks arrived. (An admin-stats call in between, synchronous and seconds long on a busy host, once held every
    # reader and the realtime request back until the interactive stream had ended.)
    streaming_on_hot = asyncio.Event()

    def note_lane(response_headers) -> None:
        if response_headers.get("x-llm-lanes-lane") == "hot":
            streaming_on_hot.set()

    async with httpx.AsyncClient(timeout=120) as client:
        # Three times the hot engine's max_num_seqs in long interactive streams: the hot lane takes the Router's
        # share of its slots; the rest wait for one, spill to the cold lane or are refused (429).
        interactive = [asyncio.create_task(first_and_last_token_time(
            client, app_url, long_body(served_model, "default", INTERACTIVE_STREAM_TOKENS), on_first_token=note_lane))
            for _ in range(3 * TEST_HOT_MAX_NUM_SEQS)]
        # Once an interactive stream holds a hot slot (its first token came from the hot lane).
        await asyncio.wait_for(streaming_on_hot.wait(), timeout=60)
        realtime_sent = time.monotonic()
        realtime_first, status, headers = await first_token_time(
            client, app_url, long_body(served_model, "priority", 8))
        hot_slots = (await asyncio.to_thread(router_stats, app_url))["hot_slots"]
        results = await asyncio.gather(*interactive)
    assert status == 200 and headers["x-llm-lanes-request-class"] == "realtime"
    assert headers["x-llm-lanes-lane"] == "hot"
    assert all(r[2] in (200, 429) for r in results), [r[2] for r in results]
    assert any(r[2] == 200 for r in results), [r[2] for r in results]
    on_hot = [(first, last) for first, last, status_, response_headers in results
              if status_ == 200 and response_headers["x-llm-lanes-lane"] == "hot"
              and last > realtime_sent + STREAM_END_MARGIN_S]
    # Realtime was sent while interactive streams held the hot slots, and did not wait for one to give its slot
    # back: its first token came before the first of the interactive streams still running on the hot lane well
    # after it was sent ended. (A stream that ended within the margin may end before realtime's first token without
    # realtime having waited for it.)
    assert on_hot, ("no interactive stream ran on the hot lane past the margin after realtime was sent", results)
    assert realtime_first < min(last for _, last in on_hot), (hot_slots, realtime_first - realtime_sent,
                                                              [last - realtime_first for _, last in on_hot])
    # The hot engine never held more interactive work than the Router's slots.
    assert lane_stats(app_url)["hot"]["max_inflight_by_class"].get("interactive", 0) <= slots["limit"], slots


async def test_interactive_overtakes_batch_on_the_cold_lane_after_a_long_context_degrade(app_url, served_model):
    long_prompt = [100 + i % 1000 for i in range(1700)]  # token ids: over local.yaml's long-context threshold (1536)
    async with httpx.AsyncClient(timeout=120) as client:
        batch = [asyncio.create_task(first_token_time(client, app_url, long_body(served_model, "flex", 1500)))
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
    before = lane_stats(app_url)["hot"]["gate_waits_by_class"].get("realtime", 0)
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.create_task(plain_completion(client, app_url, long_body(served_model, "priority", 64)))
                 for _ in range(12)]
        results = await asyncio.gather(*tasks)
    assert [status for status, _, _ in results] == [200] * 12
    stats = lane_stats(app_url)["hot"]
    assert stats["max_inflight_by_class"]["realtime"] == 4
    assert stats["gate_waits_by_class"].get("realtime", 0) > before, "realtime beyond the cap waits before the engine"


async def test_interactive_burst_gets_429_with_retry_after_while_batch_completes(app_url, served_model):
    async def plain(client, body):
        return await plain_completion(client, app_url, body)

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
        # Over the queue bound, or past what the hot lane's queue and the cold lane's spill room start within the SLO.
        assert body["error"]["type"] == "rate_limit_error"
        assert body["error"]["code"] in ("queue_full", "hot_lane_full"), body
    assert all(r[0] in (200, 429) for r in burst_results)
    assert [r[0] for r in batch_results] == [200] * 30, "batch-class requests are never refused for load"


def test_timed_out_request_is_aborted_in_the_engine(app_url, served_model):
    deadline_s = 1.0
    started = time.monotonic()
    response = httpx.post(f"{app_url}/v1/completions", timeout=60, headers={"X-Request-Timeout": str(deadline_s)},
                          json=long_body(served_model, "priority", 2000))  # ~6 s of decoding on this CPU
    elapsed = time.monotonic() - started
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert elapsed < deadline_s + 3
    assert wait_until(lambda: lane_stats(app_url)["hot"]["running"] == 0, timeout_s=10), lane_stats(app_url)
    # One timeout counts against the hot lane's breaker but does not open it.
    follow_up = httpx.post(f"{app_url}/v1/completions", timeout=60, json=long_body(served_model, "priority", 4))
    assert follow_up.status_code == 200


def test_request_timeout_header_must_be_positive_seconds(app_url, served_model):
    response = httpx.post(f"{app_url}/v1/completions", timeout=30, headers={"X-Request-Timeout": "soon"},
                          json=long_body(served_model, "default", 4))
    assert response.status_code == 400 and response.json()["error"]["param"] == "X-Request-Timeout"


def processes_named(prefix: str) -> list[int]:
    """Pids whose command line (a process title, for Ray's and vLLM's processes) starts with `prefix`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if entry.isdigit() and cmdline.read().decode(errors="replace").startswith(prefix):
                    found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="local.yaml's placement names cores 0 and 1")
def test_cold_engine_processes_run_where_local_yaml_places_them(app_url, tiny_model):
    """local.yaml: the cold lane's worker and engine core (scheduler) on core 1 at niceness 19, its replica (vLLM's
    frontend) on core 0 at Ray's 15 - the engine's two halves take turns on one core, undisturbed by the app."""
    engine = load_app_config(local_test_document(tiny_model)[1]).cold_lane.engine
    replicas = processes_named("ray::ServeReplica:llm-lanes:ColdLane")
    assert len(replicas) == 1, replicas
    replica = replicas[0]
    below_replica = set(descendant_pids(replica))
    engine_cores = [pid for pid in processes_named("VLLM::EngineCore") if pid in below_replica]
    assert len(engine_cores) == 1, engine_cores
    below_engine_core = set(descendant_pids(engine_cores[0]))
    workers = [pid for pid in processes_named("VLLM::Worker") if pid in below_engine_core]
    assert len(workers) == 1, workers

    assert os.sched_getaffinity(replica) == parse_cpu_list(engine.cpu_frontend_bind) == {0}
    assert os.sched_getaffinity(engine_cores[0]) == parse_cpu_list(engine.cpu_engine_core_bind) == {1}
    assert os.getpriority(os.PRIO_PROCESS, engine_cores[0]) == engine.cpu_nice == 19
    assert os.getpriority(os.PRIO_PROCESS, workers[0]) == 19
    assert os.getpriority(os.PRIO_PROCESS, replica) < 19  # the frontend answers the Router at Ray's niceness


def test_the_lane_replicas_logs_go_on_after_their_engines_start(app_url, served_model):
    """Ray Serve's log handlers of a lane replica still write once its engine has started (vLLM's logging set-up
    closes every handler that exists when it runs: app.lanes.engine.configure_vllm_logging), so the replica's log
    has its "Finished initializing" line, and its records are written, not kept in memory."""
    from pathlib import Path

    logs = Path("/tmp/ray/session_latest/logs/serve")
    for lane in ("HotLane", "ColdLane"):
        files = sorted(logs.glob(f"replica_*_{lane}_*.log"), key=lambda path: path.stat().st_mtime)
        assert files, f"no {lane} replica log under {logs}"
        assert "Finished initializing replica" in files[-1].read_text(), files[-1]
