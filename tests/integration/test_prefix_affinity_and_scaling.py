"""Prefix-affinity routing and queue-depth autoscaling on the real CPU engine, with more than one replica per lane.

Its own app ("prefix-scaling"): the hot lane has two
replicas with small KV caches (12 MiB, 6144 tokens each) so evictions happen within seconds; the cold lane scales
between 1 and 2 replicas on its batch backlog with short delays. The prefix index is fed exactly, by every engine's
vLLM KV-cache events.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from load_tests.overload import retry_after_s
from tests.integration.conftest import (
    AppProcess,
    kill_replica,
    local_test_document,
    wait_until,
    write_serve_config,
)
from tests.integration.test_batch_api import wait_for_batch

HOT_REPLICAS = 2
HOT_KV_BYTES = 12 * 1024 * 1024  # 6144 tokens at 2048 bytes a token (4 layers x 1 KV head x 64 dims x K,V x fp32)
PREFIX_TOKENS = 1056  # 33 blocks of 32: above min_prefix_tokens (1024)
QUESTION_TOKENS = 24  # match ratio 1056 / 1080 = 0.98 >= match_threshold (0.85)
BATCH_LINES = 96  # 6 x target_lines_per_replica: long enough that the new replica (~60-80 s to start on 2 cores) still finds lines to serve


def _write_config(tmp_dir: Path, tiny_model: Path) -> Path:
    document, args = local_test_document(tiny_model)
    hot = args["hot_lane"]
    hot["engine"].update(max_num_seqs=4, kv_cache_memory_bytes=HOT_KV_BYTES)
    hot["deployment"]["num_replicas"] = HOT_REPLICAS
    cold = args["cold_lane"]
    cold["engine"]["max_num_seqs"] = 8
    cold["deployment"].pop("num_replicas", None)
    cold["deployment"]["autoscaling"] = {
        "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 6,
        "metrics_interval_s": 1, "look_back_period_s": 3,
        "queue_depth": {"target_lines_per_replica": 16, "target_backlog_tokens_per_replica": 10_000_000,
                        "target_waiting_per_replica": 1000, "target_ongoing_per_replica": 1000}}
    args["prefix_cache"].update(max_pinned_prefixes=8)
    args["batch"] = {"store": str(tmp_dir / "batches.sqlite3"), "lease_s": 5, "window_min": 4, "window_max": 8}
    return write_serve_config(tmp_dir / "prefix-scaling.yaml", document)


APP = "prefix-scaling"
pytestmark = [pytest.mark.app(APP), pytest.mark.disrupts_app]  # scales the cold lane, kills the PrefixCache


def hot_replicas_report(count: int) -> Callable[[AppProcess], bool]:
    """An app's readiness for the modules that run more than one hot replica: all `count` of them report."""
    return lambda app: len(lanes(app.url)["hot"]) == count


@pytest.fixture(scope="module")
def scaling_app(apps):
    app = apps.use(APP, _write_config, ready=hot_replicas_report(HOT_REPLICAS))
    yield app
    apps.mark_dirty()


def stats(url: str, attempts: int = 3) -> dict:
    # While a new replica starts on two busy cores, one read can come back empty (CI saw a non-JSON answer once in
    # the scale-out wait): read again before failing.
    for attempt in range(attempts):
        try:
            response = httpx.get(f"{url}/v1/admin/stats", timeout=10)
            if response.status_code == 200:
                return response.json()
        except (httpx.HTTPError, ValueError):
            if attempt == attempts - 1:
                raise
        time.sleep(1)
    response.raise_for_status()
    return response.json()


def lanes(url: str) -> dict[str, list[dict]]:
    return {lane: [r for r in replicas if "replica_id" in r] for lane, replicas in stats(url)["lanes"].items()}


def token_prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 2000 + 40 for i in range(length)]


def shared_prefix_prompt(group: int, question: int) -> list[int]:
    return token_prompt(group, PREFIX_TOKENS) + token_prompt(10_000 + group * 100 + question, QUESTION_TOKENS)


def complete(url: str, model: str, prompt: list[int], service_tier: str = "default") -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": 2, "service_tier": service_tier})


def holders(url: str, prompt: list[int]) -> dict[str, int]:
    body = httpx.post(f"{url}/v1/admin/prefix_lookup", json={"prompt": prompt}, timeout=10).json()
    return {m["replica_id"]: m["matched_tokens"] for m in body["matches"]}


def router_mirror_caught_up(url: str) -> bool:
    """The Router's copy of the prefix index has every change the PrefixCache had a moment before."""
    target = stats(url)["prefix_cache"]["change_seq"]
    mirrors = stats(url)["router"]["prefix_index_mirror"]
    return bool(mirrors) and all(m["fresh"] and m["seq"] >= target for m in mirrors.values())


def test_requests_sharing_a_prefix_land_on_the_replica_that_holds_it(scaling_app, served_model):
    url = scaling_app.url
    served = set()
    for group in range(3):
        replicas, cached = [], []
        for question in range(3):
            response = complete(url, served_model, shared_prefix_prompt(group, question))
            assert response.status_code == 200, response.text
            assert response.headers["x-llm-lanes-lane"] == "hot"
            replicas.append(response.headers["x-llm-lanes-replica"])
            cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            if question == 0:
                # The engine's KV events reach the index within a moment; the next request is routed by it.
                assert wait_until(lambda: holders(url, shared_prefix_prompt(group, 0)).get(replicas[0], 0)
                                  >= PREFIX_TOKENS, timeout_s=10), holders(url, shared_prefix_prompt(group, 0))
                # The Router process routes with its own copy of the index, pulled every 0.1 s: let it catch up.
                assert wait_until(lambda: router_mirror_caught_up(url), timeout_s=10), stats(url)["router"]
        assert len(set(replicas)) == 1, (f"group {group} was spread over {replicas}; routing: "
                                         f"{stats(url)['router']['replica_routing']}")
        # The engine reports the shared prefix as cached for every request after the first.
        assert all(tokens >= PREFIX_TOKENS for tokens in cached[1:]), cached
        served.update(replicas)
    # Those choices came from the Router's local copy of the index (no per-request call to the PrefixCache).
    lookups = stats(url)["router"]["replica_routing"]["HotLane"]["lookups"]
    assert lookups.get("ok", 0) >= 6 and "timeout" not in lookups, lookups
    hot = lanes(url)["hot"]
    assert len(hot) == HOT_REPLICAS and all(r["prefix_feed"]["mode"] == "kv_events" for r in hot), hot
    # Every replica that served a group fed the index from its engine's events. Only one replica answers the stats
    # call live; the others' figures come from the PrefixCache's registry, pushed every 2 s: poll.
    def fed_by_events() -> bool:
        return all(r["prefix_feed"]["events"]["batches"] > 0 for r in lanes(url)["hot"] if r["replica_id"] in served)

    assert wait_until(fed_by_events, timeout_s=10), lanes(url)["hot"]


def test_an_evicted_prefix_leaves_the_index(scaling_app, served_model):
    url = scaling_app.url
    victim = token_prompt(500, PREFIX_TOKENS + QUESTION_TOKENS)
    response = complete(url, served_model, victim)
    assert response.status_code == 200
    holder = response.headers["x-llm-lanes-replica"]
    assert wait_until(lambda: holders(url, victim).get(holder, 0) >= PREFIX_TOKENS, timeout_s=10)
    # Fill the holder's 6144-token cache with other prompts until its engine has prefilled 8 of them (12,000 tokens):
    # the victim's blocks are reused. Counted by the replica that answered: the load-based routing of prompts that
    # share nothing picks either replica, and a fixed number of them could all go to the other one.
    filled, seed = 0, 600
    while filled < 8:
        assert seed < 700, f"the holder answered {filled} of {seed - 600} filler prompts"
        response = complete(url, served_model, token_prompt(seed, 1500))
        assert response.status_code == 200
        filled += response.headers["x-llm-lanes-replica"] == holder
        seed += 1
    assert wait_until(lambda: holders(url, victim).get(holder, 0) < PREFIX_TOKENS, timeout_s=15), holders(url, victim)

    def removed_blocks() -> dict[str, int]:
        return {r["replica_id"]: r["prefix_feed"]["events"]["removed_blocks"] for r in lanes(url)["hot"]}

    # The holder's engine said so (BlockRemoved); its stats may come from the registry, up to 2 s old, so poll.
    assert wait_until(lambda: removed_blocks()[holder] > 0, timeout_s=10), removed_blocks()


async def test_killing_the_prefix_cache_mid_load_fails_no_request(scaling_app, served_model):
    url = scaling_app.url

    refusals: list[str] = []

    async def one(client: httpx.AsyncClient, i: int) -> int:
        # 24 long prompts at once on two cores are more than the hot lane starts within the TTFT target, so admission
        # refuses some with 429 (hot_lane_full) and a Retry-After; this client retries as the refusal says. What the
        # kill must not cause is a failure: any other status.
        for _ in range(10):
            response = await client.post(f"{url}/v1/completions", json={
                "model": served_model, "prompt": shared_prefix_prompt(i % 4, i), "max_tokens": 8})
            if response.status_code != 429:
                return response.status_code
            refusals.append(response.json()["error"]["code"])
            await asyncio.sleep(min(retry_after_s(response.headers.get("Retry-After")) or 1, 10))
        return response.status_code

    async with httpx.AsyncClient(timeout=120) as client:
        requests = [asyncio.ensure_future(one(client, i)) for i in range(24)]
        await asyncio.sleep(0.5)
        await asyncio.to_thread(kill_replica, "PrefixCache", only=True)
        later = [asyncio.ensure_future(one(client, 100 + i)) for i in range(8)]
        statuses = await asyncio.gather(*requests, *later)
    assert statuses == [200] * 32, (statuses, refusals)
    assert set(refusals) <= {"hot_lane_full", "queue_full"}, refusals
    # Serve brings the PrefixCache back (empty); the engines' feeds resync it.
    assert wait_until(lambda: stats(url)["prefix_cache"].get("entries", 0) > 0, timeout_s=60)
    # Again with no traffic at all: no KV event flows, and the replicas' periodic stats push (which answers with the
    # PrefixCache's epoch) is what tells them to resync.
    epoch = stats(url)["prefix_cache"]["epoch"]
    kill_replica("PrefixCache", only=True)
    assert wait_until(lambda: stats(url)["prefix_cache"].get("epoch", epoch) != epoch, timeout_s=60)
    assert wait_until(lambda: stats(url)["prefix_cache"].get("entries", 0) > 0, timeout_s=30)


def test_cold_lane_scales_out_on_backlog_warms_the_new_replica_and_scales_back(scaling_app, served_model,
                                                                                openai_client_for):
    url = scaling_app.url
    client = openai_client_for(url)
    # A prefix used three times on the cold lane (batch class): popular, so it is pinned.
    pinned = [shared_prefix_prompt(40, q) for q in range(3)]
    for prompt in pinned:
        assert complete(url, served_model, prompt, service_tier="flex").status_code == 200
    assert wait_until(lambda: PREFIX_TOKENS in stats(url)["prefix_cache"]["pinned_prefixes"], timeout_s=10)
    (first_replica,) = [r["replica_id"] for r in lanes(url)["cold"]]

    lines = [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": served_model, "prompt": f"backlog {i}", "max_tokens": 1000,
                                  "ignore_eos": True}}) for i in range(BATCH_LINES)]
    uploaded = client.files.create(file=("backlog.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    backlog_at = time.monotonic()
    assert wait_until(lambda: len(lanes(url)["cold"]) == 2, timeout_s=180), lanes(url)["cold"]
    scaled_out_s = time.monotonic() - backlog_at
    (new,) = [r for r in lanes(url)["cold"] if r["replica_id"] != first_replica]
    # The batch window is per cold replica: with two, the (only) Router keeps twice the window in flight. Checked
    # first, while the backlog that scaled the lane out is still there: once it drains, the lane scales back to one
    # replica (downscale_delay_s 6) and the Router rightly follows.

    def dispatching_for_two_replicas() -> bool:
        router = stats(url)["router"]
        return (router["replicas_seen"] == {"cold": 2, "router": 1}
                and router["batch_in_flight_limit"] == 2 * router["batch_window"])

    assert wait_until(dispatching_for_two_replicas, timeout_s=30), stats(url)["router"]
    # Warmed before it took traffic: it prefilled the pinned prefixes, and the index knows it holds them.
    assert new["prefix_feed"]["warmup"]["prefixes"] >= 1 and new["prefix_feed"]["warmup"]["error"] is None, new
    assert holders(url, pinned[0]).get(new["replica_id"], 0) >= PREFIX_TOKENS, holders(url, pinned[0])
    # Requests with the pinned prefix that land on the new replica hit its cache from the first one on.
    # Both replicas hold it fully, so ties go to the less loaded one: send them four at a time, so some land on the
    # new replica whichever one the batch lines keep busier.
    landed, served_by = [], []
    for round_ in range(4):
        prompts = [shared_prefix_prompt(40, 3 + round_ * 4 + i) for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda p: complete(url, served_model, p, service_tier="flex"), prompts))
        for response in responses:
            assert response.status_code == 200
            served_by.append(response.headers["x-llm-lanes-replica"])
            if response.headers["x-llm-lanes-replica"] == new["replica_id"]:
                landed.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        if landed:
            break
    # Where they land is the router's call (equal matches go to the less loaded replica, which can be the old one
    # every time); any that did land on the new replica hit the cache its warm-up filled.
    assert all(tokens >= PREFIX_TOKENS for tokens in landed), (landed, served_by)
    # And the new replica is serving: batch lines reach it.
    assert wait_until(lambda: any(r["replica_id"] == new["replica_id"] and r["served_by_class"].get("batch", 0) > 0
                                  for r in lanes(url)["cold"]), timeout_s=60), lanes(url)["cold"]

    # The rest of the backlog is not this test's subject (a batch's completion is test_batch_api's): cancelled, its
    # queued lines leave the backlog, the lines under way finish, and the lane scales back.
    client.batches.cancel(batch.id)
    done = wait_for_batch(client, batch.id, timeout_s=600)
    assert done.status == "cancelled" and done.request_counts.completed > 0, done
    drained_at = time.monotonic()
    assert wait_until(lambda: len(lanes(url)["cold"]) == 1, timeout_s=120), lanes(url)["cold"]
    print(f"cold lane: 1 -> 2 replicas {scaled_out_s:.1f} s after the backlog; "
          f"2 -> 1 {time.monotonic() - drained_at:.1f} s after it drained")


@pytest.fixture
def openai_client_for():
    import openai

    return lambda url: openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
