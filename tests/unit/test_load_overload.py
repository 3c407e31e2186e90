"""The overload benchmark's parts that need no Ray: limits and overrides from a serve config, the phases' scenarios,
reading /v1/admin/stats samples, per-phase aggregation and the report."""

from __future__ import annotations

import copy
import json
import socket
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from load_tests.client import RequestRecord
from load_tests.overload import (
    Limits,
    apply_overrides,
    build_report,
    burst_scenarios,
    derived_config,
    headline,
    interactive_held,
    interactive_streams,
    lane_in_flight_mean,
    light_scenario,
    limits_from_args,
    parse_override,
    rebuild,
    records_from,
    refusal_wait_s,
    render_markdown,
    retry_after_s,
    run_closed_loop,
    stats_view,
    summarize_class,
    summarize_samples,
    tokens_in_window,
    write_report,
)
from load_tests.scenario import parse_scenario
from load_tests.workload import split
from tests.unit.test_load_report import fake_app

REPO = Path(__file__).resolve().parents[2]
LOCAL = yaml.safe_load((REPO / "serve_configs/local.yaml").read_text(encoding="utf-8"))
PROMPT = {"dist": "uniform", "min": 48, "max": 80}
TALLY = ["x-llm-lanes-lane", "x-llm-lanes-degraded"]
LIMITS = Limits(hot_max_num_seqs=4, hot_replicas=1, realtime_max_inflight=1, router_replicas=1,
                interactive_ttft_slo_s=2.0)


def record(request_class="interactive", status=200, ttft=0.1, start=0.0, e2e=1.0, lane="hot", degraded=None,
           retry_after=None, tokens=8, chunks=None, error=None) -> RequestRecord:
    headers = {"x-llm-lanes-lane": lane} if lane else {}
    if degraded:
        headers["x-llm-lanes-degraded"] = degraded
    if status != 200 and error is None:
        error = "http: refused"
    offsets = chunks if chunks is not None else ([ttft + i * (e2e - ttft) / max(1, tokens - 1) for i in range(tokens)]
                                                 if status == 200 and error is None else [])
    return RequestRecord(stream="s", request_class=request_class, index=0, streaming=True, start_s=start,
                         e2e_s=e2e, ttft_s=ttft if status == 200 else None, chunk_offsets_s=offsets,
                         output_tokens=tokens if status == 200 and error is None else 0, usage_reported=True,
                         status=status, error=error, retry_after=retry_after, headers=headers)


# ---- config -------------------------------------------------------------------------------------------------------


def test_limits_come_from_the_config_with_schema_defaults():
    args = copy.deepcopy(LOCAL["applications"][0]["args"])
    limits = limits_from_args(args)
    assert limits.hot_max_num_seqs == args["hot_lane"]["engine"]["max_num_seqs"]
    assert limits.interactive_ttft_slo_s == args["admission"]["interactive_ttft_slo_s"]
    assert limits.hot_capacity == limits.hot_max_num_seqs * args["hot_lane"]["deployment"]["num_replicas"]
    del args["admission"]["interactive_ttft_slo_s"]
    args["hot_lane"]["deployment"]["num_replicas"] = 2
    limits = limits_from_args(args)
    from app.config import AdmissionConfig

    assert limits.interactive_ttft_slo_s == AdmissionConfig().interactive_ttft_slo_s
    assert limits.hot_capacity == 2 * limits.hot_max_num_seqs


def test_overrides_are_dotted_yaml_values_on_a_copy():
    assert parse_override("admission.interactive_ttft_slo_s=2.5") == (["admission", "interactive_ttft_slo_s"], 2.5)
    assert parse_override("model.source=/m/tiny") == (["model", "source"], "/m/tiny")
    base = {"model": {"source": "models/tiny"}}
    changed = apply_overrides(base, ["model.source=/abs/tiny", "router.num_replicas=2"])
    assert changed == {"model": {"source": "/abs/tiny"}, "router": {"num_replicas": 2}}
    assert base == {"model": {"source": "models/tiny"}}
    with pytest.raises(ValueError):
        parse_override("no-equals-sign")


def test_derived_config_moves_the_batch_store_and_applies_overrides(tmp_path):
    derived = derived_config(LOCAL, ["model.source=/abs/tiny"], tmp_path)
    args = derived["applications"][0]["args"]
    assert args["model"]["source"] == "/abs/tiny"
    assert args["batch"]["store"] == str((tmp_path / "batches.sqlite3").resolve())
    assert LOCAL["applications"][0]["args"]["model"]["source"] == "models/tiny-llama"  # base untouched
    kept = derived_config(LOCAL, ["batch.store=/elsewhere.sqlite3"], tmp_path)
    assert kept["applications"][0]["args"]["batch"]["store"] == "/elsewhere.sqlite3"


def test_interactive_streams_explicit_or_a_multiple_of_capacity():
    assert interactive_streams(None, None, 32) == 160
    assert interactive_streams(40, None, 32) == 40
    assert interactive_streams(None, 5, 32) == 160
    assert interactive_streams(None, 0.01, 32) == 1
    with pytest.raises(ValueError):
        interactive_streams(10, 2.0, 32)


# ---- workload -----------------------------------------------------------------------------------------------------


def test_burst_is_split_over_client_processes_with_distinct_streams():
    assert split(7, 2) == [4, 3]
    assert split(1, 2) == [1, 0]
    scenarios = burst_scenarios("tiny", 161, 16, 2, 40, 128, PROMPT, 0, 300)
    assert len(scenarios) == 2
    parsed = [parse_scenario(s) for s in scenarios]
    concurrency = {(s.request_class, s.arrival.concurrency) for p in parsed for s in p.streams}
    assert concurrency == {("interactive", 81), ("interactive", 80), ("batch", 8)}
    names = [s.name for p in parsed for s in p.streams]
    assert len(set(names)) == len(names) == 4
    for p in parsed:
        for stream in p.streams:
            assert stream.max_tokens == 128 and stream.stream and stream.ignore_eos
            assert stream.duration_s == 40
            assert p.stream_duration_s(stream) == 40
    assert {s.service_tier for p in parsed for s in p.streams} == {"default", "flex"}
    # One client process: everything in it; no flex: no flex stream.
    assert [len(s["streams"]) for s in burst_scenarios("tiny", 10, 0, 1, 5, 8, PROMPT, 0, 60)] == [1]


def test_light_scenario_is_poisson_interactive():
    scenario = parse_scenario(light_scenario("tiny", 3.0, 20, 128, PROMPT, 1, 300))
    (stream,) = scenario.streams
    assert stream.arrival.type == "poisson" and stream.arrival.rate == 3.0
    assert stream.request_class == "interactive" and scenario.stream_duration_s(stream) == 20


def test_records_from_clients_share_one_clock():
    a = {"start_unix": 1000.0, "records": [record(start=1.0).to_json()]}
    b = {"start_unix": 1002.5, "records": [record(start=0.5).to_json()]}
    records = records_from([a, b], origin_unix=999.0)
    assert [r.start_s for r in records] == [2.0, 4.0]


# ---- stats samples ------------------------------------------------------------------------------------------------


def admin_stats(running, waiting, queued, slots=None, replicas=1):
    router = {"queued_by_class": {"realtime": 0, "interactive": queued, "batch": 3}, "breakers": {}}
    if slots is not None:
        router["hot_slots"] = slots
    hot = [{"lane": "hot", "running": running, "waiting": waiting}] * replicas
    return {"lanes": {"hot": hot + [{"error": "timed out"}], "cold": [{"running": 9}]}, "router": router}


def test_stats_view_reads_hot_engines_router_queue_and_optional_hot_slots():
    view = stats_view(admin_stats(3, 1, 5, replicas=2))
    assert view == {"hot_replicas": 2, "hot_running": 6, "hot_waiting": 2, "queued_interactive": 5,
                    "hot_slots": None, "router_ttft_interactive": None}
    ttft = {"hot": {"p50_ms": 80.0, "p99_ms": 900.0, "count": 40}}
    with_ttft = admin_stats(2, 0, 0)
    with_ttft["router"]["ttft_ms"] = {"interactive": ttft}
    assert stats_view(with_ttft)["router_ttft_interactive"] == ttft
    assert summarize_samples([{"t": 1, "view": stats_view(with_ttft)}], 4)["router_ttft_interactive"] == ttft
    view = stats_view(admin_stats(2, 0, 0, slots={"limit": 28, "in_flight": 28, "waiting": 7}))
    assert view["hot_slots"] == {"limit": 28, "in_flight": 28, "waiting": 7}
    assert interactive_held(view) == 7
    assert stats_view("Not Found") is None
    assert stats_view({"lanes": {}})["hot_replicas"] == 0


def test_idle_hot_lane_figure_counts_held_samples_with_free_hot_slots():
    samples = [
        {"t": 1, "view": stats_view(admin_stats(0, 0, 12))},   # held, hot idle
        {"t": 2, "view": stats_view(admin_stats(2, 0, 4))},    # held, hot below 4
        {"t": 3, "view": stats_view(admin_stats(4, 10, 4))},   # held, hot full
        {"t": 4, "view": stats_view(admin_stats(1, 0, 0))},    # nothing held
        {"t": 5, "view": stats_view(admin_stats(4, 0, 0, slots={"limit": 3, "in_flight": 3, "waiting": 2}))},
        {"t": 6, "status": None, "view": None},               # no answer
    ]
    summary = summarize_samples(samples, hot_max_num_seqs=4)
    assert summary["samples"] == 6 and summary["answered"] == 5
    assert summary["with_interactive_held"] == 4
    assert summary["held_while_hot_below_max_num_seqs"] == 2
    assert summary["held_while_hot_running_none"] == 1
    assert summary["hot_running_max"] == 4
    assert summary["hot_in_engine_max"] == 14
    assert summary["queued_interactive_max"] == 12
    assert summary["hot_slots_reported"] and summary["hot_slots_limit"] == 3
    assert summary["hot_slots_waiting_max"] == 2
    assert summary["held_while_hot_below_slots_limit"] == 0  # the one sample with slots ran 4 >= its limit 3
    assert summary["with_waiting_for_hot_slot"] == 1 and summary["waiting_for_hot_slot_while_hot_running_none"] == 0
    assert summarize_samples(samples[:4], 4)["held_while_hot_below_slots_limit"] is None
    idle = [{"t": 1, "view": stats_view(admin_stats(0, 0, 3, slots={"limit": 2, "in_flight": 2, "waiting": 1}))}]
    assert summarize_samples(idle, 4)["waiting_for_hot_slot_while_hot_running_none"] == 1
    empty = summarize_samples([], 4)
    assert empty["with_interactive_held"] == 0 and empty["hot_running_max"] is None


# ---- aggregation --------------------------------------------------------------------------------------------------


def test_retry_after_parsing():
    assert retry_after_s("3") == 3.0
    assert retry_after_s(" 1.5 ") == 1.5
    assert retry_after_s(None) is None
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert retry_after_s("inf") is None


def test_class_summary_counts_admitted_refused_lanes_and_ttft_against_the_slo():
    records = (
        [record(ttft=0.1 * i, lane="hot") for i in range(1, 8)]
        + [record(ttft=3.0, lane="cold", degraded="hot_saturated"),
           record(ttft=1.0, lane="cold", degraded="long_context,hot_saturated")]
        + [record(status=429, retry_after=str(v), lane=None) for v in (1, 4, 9)]
        + [record(status=429, retry_after=None, lane=None),
           record(status=503, lane=None),
           record(status=200, error="stream: {\"message\": \"boom\"}", lane="hot", tokens=0)]
    )
    summary = summarize_class(records, slo_s=2.0)
    assert summary["sent"] == 15
    assert summary["admitted"] == 10  # the stream that broke after its 200 was admitted
    assert summary["completed"] == 9
    assert summary["rejected_429"] == 4
    assert summary["retry_after_s"] == {"min": 1.0, "median": 4.0, "max": 9.0, "missing": 1}
    assert summary["other_errors"] == {"503": 1, "stream": 1}
    assert summary["server_errors_5xx"] == 1
    assert summary["lanes"] == {"cold": 2, "hot": 8}
    assert summary["hot_share"] == pytest.approx(0.8)
    assert summary["hot_saturated"] == 2
    assert summary["ttft_ms"]["count"] == 9
    assert summary["ttft_within_slo"] == pytest.approx(8 / 9)
    assert summary["ttft_p99_within_slo"] is False
    assert summarize_class([record(ttft=0.5)], 2.0)["ttft_p99_within_slo"] is True
    assert summarize_class([], 2.0)["hot_share"] is None


def test_tokens_and_completions_inside_the_window():
    # 10 tokens, chunks at 0.5, 1.5, ... 9.5 s after a start at 10 s: 5 of them in [10, 15).
    r = record(start=10.0, ttft=0.5, e2e=9.5, tokens=10, chunks=[0.5 + i for i in range(10)])
    assert tokens_in_window(r, 10.0, 15.0) == pytest.approx(5.0)
    assert tokens_in_window(record(status=429), 0, 100) == 0.0
    inside = record(request_class="batch", start=11.0, e2e=2.0, tokens=4)
    after = record(request_class="batch", start=18.0, e2e=5.0, tokens=4)  # ends at 23, outside [10, 20)
    summary = summarize_class([inside, after], None, window=(10.0, 20.0))
    assert summary["completed_in_window"] == 1
    assert summary["tokens_in_window"] == pytest.approx(4 + 4 * 2 / 4, rel=0.01)  # after: chunks at 18.1..23
    assert summary["tokens_per_s_in_window"] == pytest.approx(summary["tokens_in_window"] / 10)
    assert summary["ttft_slo_s"] is None and summary["ttft_p99_within_slo"] is None


def test_report_per_phase_headline_and_markdown(tmp_path):
    burst_records = (
        [record(start=30.0 + i * 0.1, lane="cold", degraded="hot_saturated", ttft=5.0, e2e=6.0) for i in range(9)]
        + [record(start=31.0, lane="hot", ttft=0.2)]
        + [record(status=429, start=32.0, retry_after="2", lane=None)]
        + [record(request_class="batch", start=30.0, e2e=4.0, lane="cold", tokens=16)]
    )
    light_records = [record(start=1.0, ttft=0.05)]
    samples = [
        {"t": 1005.0, "phase": "light", "status": 200, "view": stats_view(admin_stats(1, 0, 0))},
        {"t": 1020.0, "phase": "quiet", "status": 200, "view": stats_view(admin_stats(0, 0, 0))},
        {"t": 1032.0, "phase": "burst", "status": 200, "view": stats_view(admin_stats(0, 0, 30))},
        {"t": 1034.0, "phase": "burst", "status": 200, "view": stats_view(admin_stats(4, 0, 30))},
    ]
    settings = {"serve_config": "serve_configs/local.yaml", "light_rate": 3.0, "light_s": 10.0, "quiet_s": 10.0,
                "interactive": 20, "flex": 1, "burst_s": 10.0, "clients": 2, "max_tokens": 8,
                "sample_interval_s": 1.5, "autogroup": True}
    report = build_report(settings, LIMITS, {"light": light_records, "burst": burst_records},
                          {"light": (0.0, 11.0), "quiet": (11.0, 21.0), "burst": (30.0, 40.0)}, samples,
                          origin_unix=1000.0)
    assert list(report["phases"]) == ["light", "quiet", "burst"]
    assert report["phases"]["quiet"]["classes"] == {}
    assert report["phases"]["light"]["stats"]["answered"] == 1
    head = report["headline"]
    assert head["interactive_admitted"] == 10 and head["interactive_429"] == 1
    assert head["interactive_on_hot"] == 1 and head["interactive_hot_share"] == pytest.approx(0.1)
    assert head["interactive_hot_saturated"] == 9
    assert head["interactive_ttft_p99_within_slo"] is False
    assert head["flex_completed_in_window"] == 1
    assert head["samples_interactive_held"] == 2
    assert head["samples_held_while_hot_below_max_num_seqs"] == 1
    assert head["samples_held_while_hot_running_none"] == 1
    assert head["server_errors_5xx"] == 0
    assert headline({}, LIMITS)["interactive_admitted"] is None

    paths = write_report(report, tmp_path)
    written = json.loads(paths["json"].read_text())
    assert written["headline"] == json.loads(json.dumps(head))
    assert len(written["records"]["burst"]) == len(burst_records)
    text = paths["markdown"].read_text()
    assert text == render_markdown(report)
    assert "## burst" in text and "## quiet" in text
    assert "autogroup" in text
    assert "1 of 2 samples" in text
    assert "| share on the hot lane | 10.0 % | 0.0 % |" in text


def test_rebuild_recomputes_a_saved_report(tmp_path):
    settings = {"serve_config": "c.yaml", "light_rate": 1.0, "light_s": 1.0, "quiet_s": 1.0, "interactive": 2,
                "flex": 0, "burst_s": 5.0, "clients": 1, "max_tokens": 8, "sample_interval_s": 1.0}
    report = build_report(settings, LIMITS, {"burst": [record(start=1.0), record(status=429, retry_after="3")]},
                          {"burst": (0.0, 5.0)}, [], origin_unix=0.0)
    write_report(report, tmp_path)
    saved = json.loads((tmp_path / "report.json").read_text())
    saved["phases"] = {}
    saved["headline"] = {}
    (tmp_path / "report.json").write_text(json.dumps(saved))
    rebuild(tmp_path)
    again = json.loads((tmp_path / "report.json").read_text())
    assert again["headline"]["interactive_admitted"] == 1 and again["headline"]["interactive_429"] == 1
    assert again["phases"]["burst"]["classes"]["interactive"]["retry_after_s"]["max"] == 3.0


# ---- closed loop --------------------------------------------------------------------------------------------------


def test_refusal_wait_follows_retry_after():
    assert refusal_wait_s(record()) is None
    assert refusal_wait_s(record(status=429, retry_after="4")) == 4.0
    assert refusal_wait_s(record(status=429, retry_after=None)) == 1.0
    assert refusal_wait_s(record(status=503, retry_after="600")) == 60.0
    assert refusal_wait_s(record(status=None, error="transport: refused")) == 1.0


def test_hot_lane_generating_mean_counts_first_token_to_last_byte_inside_the_window():
    records = [record(start=0.0, ttft=1.0, e2e=5.0, lane="hot"),      # generating 1..5
               record(start=4.0, ttft=0.0, e2e=10.0, lane="hot"),     # 4..14, window ends at 10
               record(start=0.0, ttft=0.1, e2e=9.0, lane="cold"),
               record(status=429, lane=None)]
    assert lane_in_flight_mean(records, "hot", 0.0, 10.0) == pytest.approx((4 + 6) / 10)
    assert lane_in_flight_mean(records, "hot", 5.0, 5.0) is None


async def test_closed_loop_streams_wait_out_refusals_against_the_fake_server():
    runner = web.AppRunner(fake_app(token_delay_s=0.001))
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    scenario_doc = {"name": "t", "model": "tiny-llama", "request_timeout_s": 10, "tally_headers": TALLY,
                    # Long enough for more than one request per stream on a busy host (at 0.5 s, a CI run once got one).
                    "streams": [{"name": "ok", "request_class": "interactive", "arrival": {"type": "closed",
                                 "concurrency": 2}, "duration_s": 1.5, "prompt_tokens": 4, "max_tokens": 3},
                                # The fake server refuses realtime requests with 429 and Retry-After 7.
                                {"name": "refused", "request_class": "realtime", "arrival": {"type": "closed",
                                 "concurrency": 2}, "duration_s": 0.5, "prompt_tokens": 4, "max_tokens": 3}]}
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        waiting, _, wall_s = await run_closed_loop(parse_scenario(scenario_doc), url)
        hammering, _, _ = await run_closed_loop(parse_scenario(scenario_doc), url, wait_on_refusal=False)
        retrying, _, _ = await run_closed_loop(parse_scenario(scenario_doc), url, resend_refused_after_s=0.05)
    finally:
        await runner.cleanup()
    refused = [r for r in waiting if r.request_class == "realtime"]
    # Each refused stream waited out the rest of its 0.5 s after its first 429: one request per stream.
    assert len(refused) == 2 and all(r.status == 429 and r.retry_after == "7" for r in refused)
    assert wall_s < 5
    assert sum(1 for r in hammering if r.request_class == "realtime") > 2
    # A naive retry loop sends the refused request again, the same one, without waiting for the Retry-After.
    retried = [r for r in retrying if r.request_class == "realtime"]
    assert len(retried) > 2 and {r.index for r in retried} == {0, 1}
    served = [r for r in waiting if r.request_class == "interactive"]
    assert len(served) > 2 and all(r.ok and r.output_tokens == 3 and r.headers["x-llm-lanes-lane"] == "hot"
                                   for r in served)
