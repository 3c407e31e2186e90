"""The load generator: scenario parsing, statistics, report files, and the client end to end against a fake
OpenAI-compatible SSE server (aiohttp, started by the test; no Ray, no engine)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web

from load_tests import host
from load_tests.client import PromptFactory, RequestRecord
from load_tests.report import RunResult, build_report, render_markdown, write_report
from load_tests.run import main, run_serve_configs
from load_tests.scenario import ClassSLO, ScenarioError, load_scenario, parse_scenario
from load_tests.serve_runner import AppStartError, ServedApp
from load_tests.stats import compare, itl_s, percentile, summarize, throughput_series, tpot_s
from load_tests.workload import run_scenario

REPO = Path(__file__).resolve().parents[2]


# ---- a fake OpenAI-compatible server ---------------------------------------------------------------------------------


# GET /v1/admin/stats of an app whose lanes are up (each replica's engine reports its KV capacity).
LANES_UP = {"lanes": {"hot": [{"running": 0, "kv_capacity_tokens": 4096}],
                      "cold": [{"running": 0, "kv_capacity_tokens": 4096}]}}


async def lanes_up(_: web.Request) -> web.Response:
    return web.json_response(LANES_UP)


def fake_app(token_delay_s: float = 0.002, seen: list[dict] | None = None) -> web.Application:
    """Streams `max_tokens` one-word chunks then a usage chunk; realtime (service_tier priority) always gets 429."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny-llama", "object": "model"}]})

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if seen is not None:
            seen.append(body)
        chat = request.path.endswith("/chat/completions")
        tier = body.get("service_tier")
        lane = "cold" if tier == "flex" else "hot"
        if tier == "priority":
            return web.json_response(
                {"error": {"message": "queue full", "type": "rate_limit", "param": None, "code": 429}},
                status=429, headers={"Retry-After": "7"},
            )
        n = body["max_tokens"]
        prompt_tokens = len((body["messages"][0]["content"] if chat else body["prompt"]).split())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        headers = {"x-llm-lanes-lane": lane}
        if not body.get("stream"):
            await asyncio.sleep(token_delay_s * n)
            text = " ".join(["tok"] * n)
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message} if chat else {"index": 0, "text": text}
            return web.json_response({"choices": [choice], "usage": usage}, headers=headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await response.prepare(request)
        if chat:  # vLLM sends the role first, without content: must not count as the first token
            await response.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n')
        for _ in range(n):
            await asyncio.sleep(token_delay_s)
            choice = {"index": 0, "delta": {"content": " tok"}} if chat else {"index": 0, "text": " tok"}
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/admin/stats", lanes_up)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    return app


def serve_fake(port: int, token_delay_s: float) -> None:
    """Entry point for the fake server as a subprocess (the serve-config lifecycle tests start it like `serve run`)."""
    web.run_app(fake_app(token_delay_s), host="127.0.0.1", port=port, print=None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fake_server_command(port: int, token_delay_s: float) -> list[str]:
    code = f"from tests.unit.test_load_report import serve_fake; serve_fake({port}, {token_delay_s})"
    return [sys.executable, "-c", code]


# ---- scenario parsing ------------------------------------------------------------------------------------------------

BASE = {
    "name": "t",
    "model": "tiny-llama",
    "slo": {"interactive": {"ttft_ms": 500}},
    "tally_headers": ["x-llm-lanes-lane"],
    "streams": [
        {"name": "chat", "request_class": "interactive", "arrival": {"type": "poisson", "rate": 50}, "count": 5,
         "prompt_tokens": {"dist": "uniform", "min": 8, "max": 16}, "max_tokens": 6, "ignore_eos": True},
        {"name": "bulk", "request_class": "batch", "arrival": {"type": "burst", "n": 3, "at_s": 0.01},
         "prompt_tokens": 40, "max_tokens": 4, "stream": False, "endpoint": "completions"},
        {"name": "rt", "request_class": "realtime", "arrival": {"type": "closed", "concurrency": 2}, "count": 2,
         "prompt_tokens": 10, "max_tokens": 3},
    ],
}


def test_shipped_scenarios_parse():
    for name in ("mixed", "shared_prefix", "smoke"):
        scenario = load_scenario(REPO / "load_tests" / "scenarios" / f"{name}.yaml")
        assert scenario.streams
    mixed = load_scenario(REPO / "load_tests/scenarios/mixed.yaml")
    by_name = {s.name: s for s in mixed.streams}
    assert by_name["batch-backlog"].arrival.concurrency == 48 and by_name["batch-backlog"].service_tier == "flex"
    assert by_name["interactive-chat"].arrival.rate == 1.5 and by_name["interactive-chat"].max_tokens == 32
    shared = load_scenario(REPO / "load_tests/scenarios/shared_prefix.yaml").streams[0].shared_prefix
    assert shared.groups == 8 and shared.prefix_tokens.min >= 1024


def test_scenario_defaults_and_shorthands():
    scenario = parse_scenario(BASE)
    chat, bulk, rt = scenario.streams
    assert chat.stream and chat.endpoint == "chat" and chat.service_tier == "default"
    assert bulk.prompt_tokens.dist == "fixed" and bulk.prompt_tokens.value == 40 and bulk.service_tier == "flex"
    assert rt.service_tier == "priority"
    assert scenario.expected_requests() == 10
    assert scenario.model_for(chat) == "tiny-llama"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["streams"][0].pop("count"), "give count or duration_s"),
        (lambda d: d["streams"][0].update(request_class="urgent"), "request_class"),
        (lambda d: d["streams"][0].update(arrival={"type": "poisson", "rate": 0}), "rate"),
        (lambda d: d["streams"][0].update(prompt_tokens={"dist": "uniform", "min": 9, "max": 3}), "min=9 > max=3"),
        (lambda d: d["streams"][0].update(prompt_tokens={"dist": "normal", "mean": 5}), "needs ['std']"),
        (lambda d: d["streams"][1].update(name="chat"), "unique"),
        (lambda d: d["streams"][1].update(count=9), "burst"),
        (lambda d: d.update(surprise=1), "surprise"),
    ],
)
def test_scenario_errors_name_the_problem(mutate, message):
    data = json.loads(json.dumps(BASE))
    mutate(data)
    with pytest.raises(ScenarioError, match=re.escape(message)):
        parse_scenario(data)


def test_scenario_level_duration_covers_streams_without_count():
    data = json.loads(json.dumps(BASE))
    data["streams"][0].pop("count")
    data["duration_s"] = 10
    scenario = parse_scenario(data)
    assert scenario.stream_duration_s(scenario.streams[0]) == 10
    assert scenario.expected_requests() == 50 * 10 + 3 + 2


def test_prompts_are_deterministic_sized_and_share_prefixes():
    data = json.loads(json.dumps(BASE))
    data["streams"][0]["shared_prefix"] = {"groups": 2, "prefix_tokens": 30}
    scenario = parse_scenario(data)
    factory, again = PromptFactory(scenario), PromptFactory(scenario)
    chat = scenario.streams[0]
    prompts = [factory.prompt(chat, i) for i in range(20)]
    assert prompts == [again.prompt(chat, i) for i in range(20)]
    prefixes = factory.prefixes("chat")
    assert len(prefixes) == 2 and all(len(p.split()) == 30 for p in prefixes)
    assert all(any(p.startswith(prefix + " question ") for prefix in prefixes) for p in prompts)
    assert {p.split(" question ")[0] for p in prompts} == set(prefixes)  # both groups used
    bulk = scenario.streams[1]
    assert len(factory.prompt(bulk, 0).split()) == 40
    body = factory.request(chat, 3).body
    assert body["messages"][0]["role"] == "user" and body["service_tier"] == "default"
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    completions = factory.request(bulk, 0).body
    assert "prompt" in completions and "stream_options" not in completions and "ignore_eos" not in completions


# ---- statistics from synthetic records ------------------------------------------------------------------------------


def record(cls="interactive", start=0.0, ttft=0.1, chunks=(0.1, 0.2, 0.3, 0.4), tokens=4, status=200, **kw):
    e2e = kw.pop("e2e", chunks[-1] if chunks else 1.0)
    kw.setdefault("send_lag_s", kw.pop("send_lag", None))
    return RequestRecord(
        stream=cls, request_class=cls, index=0, streaming=True, start_s=start, e2e_s=e2e, ttft_s=ttft,
        chunk_offsets_s=list(chunks), output_tokens=tokens, status=status, usage_reported=True, **kw,
    )


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == 99.0
    assert percentile([10.0, 0.0], 90) == pytest.approx(9.0)


def test_tpot_and_itl():
    r = record(ttft=0.1, chunks=(0.1, 0.2, 0.4, 0.7), tokens=4, e2e=0.7)
    assert tpot_s(r) == pytest.approx(0.2)
    assert itl_s(r) == pytest.approx([0.1, 0.2, 0.3])
    assert tpot_s(record(tokens=1, chunks=(0.1,))) is None
    assert itl_s(record(status=429, chunks=())) == []


def test_summary_per_class_with_goodput_errors_and_headers():
    records = [record(start=float(i), ttft=0.1 * (i + 1), headers={"x-llm-lanes-lane": "hot"}) for i in range(10)]
    records.append(record(start=2.0, status=429, chunks=(), tokens=0, ttft=None, e2e=0.01, error="http: full"))
    records.append(record(start=3.0, status=None, chunks=(), tokens=0, ttft=None, e2e=5.0, error="timeout: late"))
    records += [record("batch", start=0.0, ttft=1.0, chunks=(1.0, 2.0), tokens=100, e2e=2.0,
                       headers={"x-llm-lanes-lane": "cold"}) for _ in range(2)]
    summary = summarize(records, {"interactive": ClassSLO(ttft_ms=450)}, ["x-llm-lanes-lane"])
    interactive, batch = summary["classes"]["interactive"], summary["classes"]["batch"]
    assert list(summary["classes"]) == ["interactive", "batch"]
    assert interactive["requests"] == 12 and interactive["ok"] == 10
    assert interactive["errors"] == {"429": 1, "timeout": 1}
    assert interactive["ttft_ms"]["p50"] == pytest.approx(550.0)
    assert interactive["ttft_ms"]["count"] == 10
    assert interactive["goodput"]["good"] == 4  # TTFT 100..400 ms meet 450 ms
    assert interactive["goodput"]["fraction"] == pytest.approx(4 / 12)
    assert interactive["headers"]["x-llm-lanes-lane"] == {"(absent)": 2, "hot": 10}
    # Window: first start 0.0 to last end 9.4 (start 9 + e2e 0.4).
    assert interactive["window_s"] == pytest.approx(9.4)
    assert interactive["output_tokens"] == 40
    assert interactive["output_tokens_per_s"] == pytest.approx(40 / 9.4)
    assert batch["output_tokens_per_s"] == pytest.approx(200 / 2.0)
    assert batch["goodput"]["fraction"] == 1.0  # no SLO for batch: every success counts
    assert summary["all"]["requests"] == 14


def test_throughput_series_spreads_tokens_over_chunks():
    records = [
        record("batch", start=0.0, chunks=(0.5, 1.5, 2.5, 3.5), tokens=8, e2e=3.5),
        record("interactive", start=1.0, chunks=(0.2,), tokens=3, e2e=0.2),
        record("interactive", start=1.0, status=500, chunks=(), tokens=0, e2e=0.1),
    ]
    series = throughput_series(records, bin_s=1.0)
    times, batch = series["batch"]
    assert times == [0.0, 1.0, 2.0, 3.0]
    assert batch == [2.0, 2.0, 2.0, 2.0]
    assert series["interactive"][1] == [0.0, 3.0, 0.0, 0.0]
    assert sum(batch) == 8


def test_compare_is_first_over_second():
    fast = summarize([record(ttft=0.1, tokens=4, e2e=0.4)], {}, [])
    slow = summarize([record(ttft=0.4, tokens=4, e2e=0.8, chunks=(0.4, 0.5, 0.6, 0.8))], {}, [])
    ratios = compare(fast, slow)["interactive"]
    assert ratios["ttft_p50"] == pytest.approx(0.25) and ratios["ttft_p99"] == pytest.approx(0.25)
    assert ratios["output_tokens_per_s"] == pytest.approx(2.0)


def test_report_files_from_synthetic_runs(tmp_path):
    scenario = parse_scenario(BASE)
    lanes = RunResult("local", "serve_configs/local.yaml", "2025-01-01T00:00:00+00:00", 10.0,
                      [record(ttft=0.1), record("batch", ttft=0.5, tokens=90, e2e=3.0, chunks=(0.5, 3.0))])
    single = RunResult("baseline-local", "serve_configs/baseline-local.yaml", "2025-01-01T00:01:00+00:00", 10.0,
                       [record(ttft=0.4, chunks=(0.4, 0.5)), record("batch", ttft=0.5, tokens=100, e2e=3.0,
                                                                     chunks=(0.5, 3.0))])
    broken = RunResult("gpu", "serve_configs/gpu-single.yaml", "2025-01-01T00:02:00+00:00", error="did not start")
    lanes.generator = {"on_cpu_s": 3.0, "runqueue_wait_s": 5.0, "on_cpu_per_s": 0.3, "runqueue_wait_per_s": 0.5}
    paths = write_report(scenario, [lanes, single, broken], tmp_path)
    for path in paths.values():
        assert path.exists() and path.stat().st_size > 0
    assert paths["latency_cdf"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(paths["json"].read_text())
    assert [r["label"] for r in report["runs"]] == ["local", "baseline-local", "gpu"]
    assert len(report["runs"][0]["records"]) == 2 and report["runs"][2]["error"] == "did not start"
    assert report["comparison"]["first"] == "local" and report["comparison"]["second"] == "baseline-local"
    assert report["comparison"]["ratios"]["interactive"]["ttft_p99"] == pytest.approx(0.25)
    assert report["comparison"]["ratios"]["batch"]["output_tokens_per_s"] == pytest.approx(0.9)
    markdown = paths["markdown"].read_text()
    assert "## Ratios: local ÷ baseline-local" in markdown
    assert "interactive TTFT p50: **0.25×**, p99: **0.25×**" in markdown
    assert "batch output throughput: **0.90×**" in markdown
    assert "| metric | local | baseline-local |" in markdown  # the failed run has no column
    assert "failed: did not start" in markdown
    assert report["runs"][0]["generator"]["runqueue_wait_s"] == 5.0
    assert "| 10.0 | 0.30 / 0.50 | ok |" in markdown and "| – | failed: did not start |" in markdown


def test_generator_schedstat_parses_and_rates_per_second(tmp_path):
    stat = tmp_path / "schedstat"
    stat.write_text("2500000000 1000000000 42\n")
    before = host.sample(stat)
    assert before == host.SchedSample(2.5, 1.0)
    stat.write_text("4500000000 5000000000 90\n")
    usage = host.usage(before, host.sample(stat), wall_s=4.0)
    assert usage == {"on_cpu_s": 2.0, "runqueue_wait_s": 4.0, "on_cpu_per_s": 0.5, "runqueue_wait_per_s": 1.0}
    assert host.sample(tmp_path / "missing") is None and host.usage(None, before, 1.0) is None


def test_autogroup_switch_is_read_and_an_active_one_is_called_out_in_the_report(tmp_path):
    switch = tmp_path / "sched_autogroup_enabled"
    switch.write_text("1\n")
    assert host.autogroup_enabled(switch) is True
    switch.write_text("0\n")
    assert host.autogroup_enabled(switch) is False
    assert host.autogroup_enabled(tmp_path / "missing") is None
    usage = {"on_cpu_s": 1.0, "runqueue_wait_s": 9.0, "on_cpu_per_s": 0.1, "runqueue_wait_per_s": 0.9}
    runs = [RunResult("url", "http://x", "now", 10.0, [record()], generator={**usage, "autogroup": flag})
            for flag in (True, False)]
    scenario = parse_scenario(BASE)
    assert "autogroup scheduling was on" in render_markdown(build_report(scenario, runs[:1]))
    assert "autogroup scheduling was on" not in render_markdown(build_report(scenario, runs[1:]))


def test_report_with_one_run_has_no_comparison():
    scenario = parse_scenario(BASE)
    report = build_report(scenario, [RunResult("url", "http://x", "now", 1.0, [record()])])
    assert "comparison" not in report
    assert "## interactive" in render_markdown(report)


# ---- end to end against the fake server ------------------------------------------------------------------------------


async def test_client_end_to_end_against_fake_sse_server(tmp_path):
    seen: list[dict] = []
    runner = web.AppRunner(fake_app(token_delay_s=0.003, seen=seen))
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        scenario = parse_scenario(BASE)
        done: list[RequestRecord] = []
        records, wall_s = await run_scenario(scenario, f"http://127.0.0.1:{sock.getsockname()[1]}", done.append)
    finally:
        await runner.cleanup()
    assert len(records) == len(done) == 10 and wall_s > 0
    chat = [r for r in records if r.stream == "chat"]
    assert len(chat) == 5 and all(r.ok for r in chat)
    for r in chat:
        assert r.usage_reported and r.output_tokens == 6 and len(r.chunk_offsets_s) == 6
        assert 0 < r.ttft_s <= r.e2e_s and r.ttft_s == r.chunk_offsets_s[0]
        assert r.headers == {"x-llm-lanes-lane": "hot"}
        assert tpot_s(r) > 0
    bulk = [r for r in records if r.stream == "bulk"]
    assert len(bulk) == 3 and all(r.ok and r.output_tokens == 4 and r.ttft_s == pytest.approx(r.e2e_s, abs=0.05)
                                  for r in bulk)
    assert all(r.headers == {"x-llm-lanes-lane": "cold"} for r in bulk)
    rt = [r for r in records if r.stream == "rt"]
    assert len(rt) == 2 and all(r.status == 429 and r.retry_after == "7" and r.error_key == "429" for r in rt)
    tiers = sorted(body["service_tier"] for body in seen)
    assert tiers == ["default"] * 5 + ["flex"] * 3 + ["priority"] * 2
    # Open-loop arrivals (Poisson chat, burst bulk) carry how late they were sent; closed-loop ones do not.
    assert all(r.send_lag_s is not None and 0 <= r.send_lag_s < 1.0 for r in chat + bulk)
    assert all(r.send_lag_s is None for r in rt)
    summary = summarize(records, scenario.slo, scenario.tally_headers)
    assert summary["classes"]["realtime"]["errors"] == {"429": 2}
    assert summary["classes"]["interactive"]["goodput"]["good"] == 5
    assert summary["classes"]["interactive"]["send_lag_ms"]["count"] == 5
    assert summary["classes"]["realtime"]["send_lag_ms"]["count"] == 0


def test_report_flags_a_load_generator_that_fell_behind():
    scenario = parse_scenario(BASE)
    on_time = [record(start=0.1 * i, send_lag=0.002) for i in range(10)]
    behind = [record(start=0.1 * i, send_lag=0.002 if i < 5 else 2.0) for i in range(10)]
    markdown = render_markdown(build_report(scenario, [RunResult("a", "x", "now", 1.0, on_time),
                                                       RunResult("b", "y", "now", 1.0, behind)]))
    (row,) = [line for line in markdown.splitlines() if line.startswith("| load generator send lag")]
    cells = [cell.strip() for cell in row.split("|")[2:-1]]
    assert cells[0] == "2.0 / 2.0"
    assert cells[1].endswith("**(generator fell behind)**")


async def test_transport_error_and_timeout_are_recorded():
    data = json.loads(json.dumps(BASE))
    data["streams"] = [data["streams"][0]]
    data["streams"][0]["count"] = 2
    records, _ = await run_scenario(parse_scenario(data), f"http://127.0.0.1:{free_port()}")
    assert len(records) == 2 and all(not r.ok and r.status is None and r.error_key == "transport" for r in records)

    runner = web.AppRunner(fake_app(token_delay_s=0.5))
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        data["request_timeout_s"] = 0.3
        records, _ = await run_scenario(parse_scenario(data), f"http://127.0.0.1:{sock.getsockname()[1]}")
    finally:
        await runner.cleanup()
    assert all(r.error_key == "timeout" and r.e2e_s < 1.0 for r in records)


# ---- app lifecycle (serve run stand-in) and the CLI ------------------------------------------------------------------


def test_served_app_waits_until_ready_and_stops_the_process_group(tmp_path):
    port = free_port()
    app = ServedApp(f"http://127.0.0.1:{port}", tmp_path / "serve.log", fake_server_command(port, 0.001),
                    stop_commands=[[sys.executable, "-c", "print('shutdown called')"]], ready_timeout_s=30,
                    poll_interval_s=0.1)
    with app:
        assert app.wait_ready() < 30
    assert app.process.poll() is not None
    assert "shutdown called" in (tmp_path / "serve.log").read_text()


def test_a_served_app_started_with_sigint_ignored_still_stops_on_its_sigint(tmp_path):
    """Run from a shell's background (CI, `nohup`) this process has SIGINT ignored; the app it starts must not inherit
    that, or `serve run` ignores the SIGINT of its graceful stop and each stop waits out the grace period."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        app = ServedApp("http://127.0.0.1:9", tmp_path / "serve.log",
                        [sys.executable, "-c", "import signal, time; print(signal.getsignal(signal.SIGINT), "
                                               "flush=True); time.sleep(60)"],
                        ready_timeout_s=30, poll_interval_s=0.1, stop_grace_s=30)
        app.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert wait_for_text(tmp_path / "serve.log", "default_int_handler")
        started = time.monotonic()
        app.stop()
        assert time.monotonic() - started < 10  # the SIGINT stopped it, not the SIGTERM after the grace period
    finally:
        if app.process.poll() is None:
            app.process.kill()


def wait_for_text(path: Path, text: str, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return True
        time.sleep(0.05)
    return False


def test_served_app_reports_early_exit_with_log_tail(tmp_path):
    app = ServedApp("http://127.0.0.1:9", tmp_path / "serve.log",
                    [sys.executable, "-c", "import sys; print('config invalid: model.source'); sys.exit(3)"],
                    ready_timeout_s=30, poll_interval_s=0.1)
    with app, pytest.raises(AppStartError, match="(?s)exited with 3.*log tail:.*config invalid"):
        app.wait_ready()


def serve_lanes_starting(port: int) -> None:
    """Like the Router before its engines are up: /v1/models answers, the cold lane's replica does not yet."""
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"lanes": {"hot": [{"running": 0, "kv_capacity_tokens": 4096}],
                                            "cold": [{"error": "TimeoutError: replica starting"}]}})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/admin/stats", stats)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def test_served_app_is_not_ready_until_every_lane_answers(tmp_path):
    port = free_port()
    code = f"from tests.unit.test_load_report import serve_lanes_starting; serve_lanes_starting({port})"
    app = ServedApp(f"http://127.0.0.1:{port}", tmp_path / "serve.log", [sys.executable, "-c", code],
                    ready_timeout_s=3, poll_interval_s=0.1)
    with app, pytest.raises(AppStartError, match="every lane answering /v1/admin/stats"):
        app.wait_ready()
    # Without the lanes check the same server counts as ready at once.
    app = ServedApp(f"http://127.0.0.1:{port}", tmp_path / "serve.log", [sys.executable, "-c", code],
                    ready_timeout_s=30, poll_interval_s=0.1, lanes_path=None)
    with app:
        assert app.wait_ready() < 30


def test_served_app_times_out(tmp_path):
    # A short grace: a SIGINT that lands while the child interpreter is still starting can be lost (CI saw a 30 s
    # stop once), and SIGTERM must then follow soon.
    app = ServedApp(f"http://127.0.0.1:{free_port()}", tmp_path / "serve.log",
                    [sys.executable, "-c", "import time; time.sleep(60)"], ready_timeout_s=0.5, poll_interval_s=0.1,
                    stop_grace_s=3)
    started = time.monotonic()
    with app, pytest.raises(AppStartError, match="did not answer 200"):
        app.wait_ready()
    assert time.monotonic() - started < 20 and app.process.poll() is not None


def test_two_configs_one_combined_report(tmp_path):
    """The --serve-config flow with a stand-in for `serve run`: the fast config and the slow one, compared."""
    port = free_port()
    # 200x apart: the fast config's median TTFT must stay under half the slow one's (100 ms) even when a busy
    # 2-core CI machine delays it (with 50 ms the fast median once came out above 25 ms).
    delays = {"fast": 0.001, "slow": 0.2}
    data = json.loads(json.dumps(BASE))
    data["streams"] = data["streams"][:2]
    scenario = parse_scenario(data)
    runs = run_serve_configs(
        scenario, ["configs/fast.yaml", "configs/slow.yaml"], f"http://127.0.0.1:{port}", tmp_path, 30, False,
        start_command_for=lambda config: fake_server_command(port, delays[Path(config).stem]),
        stop_commands=[], cleanup_commands=[], poll_interval_s=0.1,
    )
    assert [r.label for r in runs] == ["fast", "slow"] and all(r.error is None for r in runs)
    assert all(len(r.records) == 8 and all(rec.ok for rec in r.records) for r in runs)
    report = build_report(scenario, runs)
    ratios = report["comparison"]["ratios"]
    # Medians only: over 8 requests a tail latency is one scheduling hiccup away from anything on a busy machine.
    assert ratios["interactive"]["ttft_p50"] < 0.5 and ratios["interactive"]["e2e_p99"] is not None
    assert ratios["batch"]["output_tokens_per_s"] > 1.0
    assert (tmp_path / "serve-fast.log").exists() and (tmp_path / "serve-slow.log").exists()


def test_cli_url_mode_writes_report(tmp_path):
    port = free_port()
    scenario_path = tmp_path / "s.yaml"
    data = json.loads(json.dumps(BASE))
    scenario_path.write_text(json.dumps(data))  # JSON is YAML
    server = subprocess.Popen(fake_server_command(port, 0.001), cwd=REPO)
    try:
        app = ServedApp(f"http://127.0.0.1:{port}", tmp_path / "unused.log", [], ready_timeout_s=30,
                        poll_interval_s=0.1)
        app.process = server
        app.wait_ready()
        before = time.time()
        code = main(["--scenario", str(scenario_path), "--url", f"http://127.0.0.1:{port}", "--out",
                     str(tmp_path / "out"), "--label", "fake", "--no-progress"])
    finally:
        server.terminate()
        server.wait(10)
    assert code == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["runs"][0]["label"] == "fake"
    # When the measured part began (after the warm-up): what span files are cut at (load_tests.ttft_breakdown).
    assert before <= report["runs"][0]["measured_from_unix"] <= time.time() - report["runs"][0]["wall_s"] + 0.5
    assert report["runs"][0]["summary"]["classes"]["realtime"]["errors"] == {"429": 2}
    assert (tmp_path / "out" / "throughput.png").exists()


def test_cli_rejects_bad_scenario(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: m\nstreams: []\n")
    assert main(["--scenario", str(bad), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "streams" in capsys.readouterr().err


def test_prefix_hit_rate_is_cached_over_prompt_tokens_of_answers_that_report_both():
    from load_tests.stats import summarize_class

    records = [record(prompt_tokens=1000, cached_prompt_tokens=900), record(prompt_tokens=1000, cached_prompt_tokens=0),
               record(prompt_tokens=500),  # no cache figure: left out
               record(prompt_tokens=1000, cached_prompt_tokens=1000, status=500)]  # failed: left out
    assert summarize_class(records, None, [])["prefix_hit_rate"] == 0.45
    assert summarize_class([record()], None, [])["prefix_hit_rate"] is None
