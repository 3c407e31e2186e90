"""Overload on the real app: after a little traffic and a quiet spell, about five times as many closed-loop
interactive streams as the hot lane runs at once, plus a few flex streams. The hot lane must keep serving
interactive work (it is not left idle while requests wait for it, nor handed far more than it runs), admitted
interactive requests keep their TTFT within the config's `admission.interactive_ttft_slo_s` (as the Router measures
it), the rest are refused with 429 and a usable Retry-After, flex work completes meanwhile, and nothing answers 5xx.

The app ("two-hot-replicas", shared with tests/integration/test_prefix_approximate_feed.py, which runs after this
module): local.yaml's admission settings (its interactive_ttft_slo_s, not the shared test app's) on two hot replicas
whose engines are small enough to overload with a few dozen streams on 2 cores yet larger than
realtime_max_inflight, so interactive requests have hot slots of their own; the approximate prefix feed, which the
other module tests (this one's prompts are too short to be recorded). The load and its figures come from
load_tests/overload.py (the benchmark's phases and aggregation, shorter and in this process); refused streams wait
the Retry-After before their next request.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import yaml

from load_tests.overload import (
    StatsSampler,
    burst_scenarios,
    drive,
    light_scenario,
    limits_from_args,
    records_from,
    retry_after_s,
    summarize_class,
    summarize_samples,
)
from tests.integration.conftest import TEST_MAX_NUM_SEQS, local_test_document, write_serve_config
from tests.integration.test_prefix_affinity_and_scaling import hot_replicas_report

APP = "two-hot-replicas"
pytestmark = pytest.mark.app(APP)

HOT_REPLICAS = 2
HOT_MAX_NUM_SEQS = 2
REALTIME_MAX_INFLIGHT = 1  # a hot slot per replica left to interactive work: 2 - 1
# Longer than test_prefix_approximate_feed.py's own requests take, short enough to watch its entries expire (the
# PrefixCache sweeps every 5 s).
APPROXIMATE_TTL_S = 8

LOAD_MULTIPLE = 5  # interactive streams per sequence the hot engines run at once
FLEX_STREAMS = 2
MAX_TOKENS = 128
PROMPT_TOKENS = {"dist": "uniform", "min": 48, "max": 80}
LIGHT_RATE = 2.0
LIGHT_S = 4.0
QUIET_S = 10.0
BURST_S = 25.0
SAMPLE_INTERVAL_S = 1.0
REQUEST_TIMEOUT_S = 60.0
RETRY_AFTER_RANGE_S = (1.0, 60.0)


def write_two_hot_replicas_config(tmp_dir: Path, tiny_model: Path) -> Path:
    document, args = local_test_document(tiny_model)
    args["hot_lane"]["deployment"]["num_replicas"] = HOT_REPLICAS
    args["hot_lane"]["engine"]["max_num_seqs"] = HOT_MAX_NUM_SEQS
    args["cold_lane"]["engine"]["max_num_seqs"] = TEST_MAX_NUM_SEQS
    args["admission"]["realtime_max_inflight"] = REALTIME_MAX_INFLIGHT
    args["prefix_cache"].update(feed="approximate", approximate_ttl_s=APPROXIMATE_TTL_S)
    args["batch"] = {"store": str(tmp_dir / "batches.sqlite3")}
    return write_serve_config(tmp_dir / "two-hot-replicas.yaml", document)


def use_two_hot_replicas_app(apps):
    return apps.use(APP, write_two_hot_replicas_config, ready=hot_replicas_report(HOT_REPLICAS))


@pytest.fixture(scope="module")
def overload_app(apps):
    return use_two_hot_replicas_app(apps)


def served_args(app) -> dict:
    document = yaml.safe_load(app.config.read_text())
    return document["applications"][0]["args"]


async def test_overload_keeps_the_hot_lane_busy_and_admitted_ttft_within_slo(overload_app, served_model):
    app_url = overload_app.url
    limits = limits_from_args(served_args(overload_app))
    capacity = limits.hot_capacity
    slo_s = limits.interactive_ttft_slo_s
    interactive_streams = LOAD_MULTIPLE * capacity

    with StatsSampler(app_url, SAMPLE_INTERVAL_S) as sampler:
        sampler.phase = "light"
        await drive(light_scenario(served_model, LIGHT_RATE, LIGHT_S, MAX_TOKENS, PROMPT_TOKENS, 1,
                                   REQUEST_TIMEOUT_S), app_url)
        sampler.phase = "quiet"
        await asyncio.sleep(QUIET_S)
        sampler.phase = "burst"
        (scenario,) = burst_scenarios(served_model, interactive_streams, FLEX_STREAMS, 1, BURST_S, MAX_TOKENS,
                                      PROMPT_TOKENS, 1, REQUEST_TIMEOUT_S)
        result = await drive(scenario, app_url)
        sampler.phase = "after"
    # The Router's own TTFT of its recent streamed requests (body in hand to first chunk): what admission controls,
    # free of this test process's own waits for a CPU on a 2-core machine that also runs the engines, and of the
    # HTTP proxy's (it hands each body to the Router when asked, late while the proxy is starved of a CPU).
    async with httpx.AsyncClient(timeout=30) as client:
        router_ttft = (await client.get(f"{app_url}/v1/admin/stats")).json()["router"]["ttft_ms"]["interactive"]

    origin = result["start_unix"]
    window = (0.0, BURST_S)
    records = records_from([result], origin)
    interactive = [r for r in records if r.request_class == "interactive"]
    flex = [r for r in records if r.request_class == "batch"]
    summary = summarize_class(interactive, slo_s, window)
    flex_summary = summarize_class(flex, None, window)
    burst_samples = [s for s in sampler.samples if s["phase"] == "burst" and 0 <= s["t"] - origin < BURST_S]
    stats = summarize_samples(burst_samples, limits.hot_max_num_seqs)
    figures = (f"interactive: {summary}\nRouter-side interactive TTFT: {router_ttft}\nflex: {flex_summary}\n"
               f"stats: {stats}\n"
               f"capacity {capacity}, {interactive_streams} interactive streams, SLO {slo_s} s; this process "
               f"on a CPU / waiting for one (s per s): {result.get('generator')}")
    print(figures)  # in the captured output: the figures of a passing run too

    # Nothing failed on the server's side; interactive requests were admitted or refused with 429, flex ones (the
    # batch class is queued, never refused for load) all admitted.
    assert summary["server_errors_5xx"] == 0 and flex_summary["server_errors_5xx"] == 0, figures
    assert summary["other_errors"] == {}, figures
    assert flex_summary["rejected_429"] == 0 and flex_summary["other_errors"] == {}, figures
    assert summary["admitted"] > 0, figures

    # Admitted interactive requests kept their first token within the SLO, on either lane, as the Router measured it
    # (the client-side figure adds this process's own scheduling delays and is reported, not asserted).
    assert router_ttft and all(lane["p99_ms"] <= slo_s * 1000 for lane in router_ttft.values()), figures

    # The hot lane served interactive work through the burst: a clear majority of the admitted requests, or on
    # average at least half of its slots (its share per the Router's hot_slots limit where the app reports one).
    hot_served = summary["lanes"].get("hot", 0)
    slots = stats["hot_slots_limit"] if stats["hot_slots_reported"] else capacity
    assert hot_served > 0, figures
    assert summary["hot_share"] > 0.5 or summary["hot_in_flight_mean"] >= 0.5 * max(1, slots), figures

    # Never more in the hot engines than they run at once, and not idle while requests wait in the Router for a
    # hot slot (a sample catches the engine between two requests at times: the hops to it take a while here).
    assert stats["hot_in_engine_max"] is not None and stats["hot_in_engine_max"] <= capacity, figures
    assert stats["hot_slots_reported"], figures
    if stats["with_waiting_for_hot_slot"] >= 3:
        assert (stats["waiting_for_hot_slot_while_hot_running_none"]
                <= 0.25 * stats["with_waiting_for_hot_slot"]), figures

    # Those refused were told when to come back.
    refused = [r for r in interactive if r.status == 429]
    for record in refused:
        delay = retry_after_s(record.retry_after)
        assert delay is not None and RETRY_AFTER_RANGE_S[0] <= delay <= RETRY_AFTER_RANGE_S[1], (
            f"429 with Retry-After {record.retry_after!r}\n{figures}")

    # Flex work kept progressing during the burst.
    assert flex_summary["completed_in_window"] >= 1, figures
    assert flex_summary["tokens_per_s_in_window"] > 0, figures
