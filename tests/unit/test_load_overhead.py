"""The overhead benchmark's parts that need no Ray: config derivation, the closed loop, both request paths against
stand-ins (the fake OpenAI server, a fake deployment handle), and report shaping."""

from __future__ import annotations

import asyncio
import copy
import socket
import threading
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from app.config import load_app_config
from load_tests.client import RequestRecord
from load_tests.overhead import (
    TRACING_VARIANTS,
    Settings,
    app_url,
    build_report,
    closed_loop,
    hot_lane_call,
    http_phase,
    http_request,
    measure_rate_ceiling,
    phase_summary,
    prompt_text,
    rate_ceiling,
    relative_change,
    render_markdown,
    router_overhead,
    span_file_stats,
    tracing_comparison,
    with_tracing,
)
from tests.unit.test_load_report import fake_app

REPO = Path(__file__).resolve().parents[2]
LOCAL = yaml.safe_load((REPO / "serve_configs/local.yaml").read_text(encoding="utf-8"))


# ---- serve config ---------------------------------------------------------------------------------------------------


def test_with_tracing_changes_only_the_tracing_section_and_stays_valid():
    variant = TRACING_VARIANTS["tracing-1pct"]
    base = copy.deepcopy(LOCAL)
    derived = with_tracing(base, variant.tracing_section("/tmp/spans.jsonl"))
    assert base == LOCAL  # the base is not modified
    args = derived["applications"][0]["args"]
    assert args["observability"] == {"tracing": {"exporter": "file", "file_path": "/tmp/spans.jsonl",
                                                 "sample_ratio": 0.01},
                                     "vllm_metrics": LOCAL["applications"][0]["args"]["observability"]["vllm_metrics"]}
    derived["applications"][0]["args"]["observability"] = LOCAL["applications"][0]["args"]["observability"]
    assert derived == LOCAL
    # The app's own schema accepts every variant's section.
    for name, variant in TRACING_VARIANTS.items():
        cfg = load_app_config(with_tracing(LOCAL, variant.tracing_section("/tmp/s.jsonl"))["applications"][0]["args"])
        assert cfg.observability.tracing.exporter == variant.exporter, name
        if variant.exporter != "none":
            assert cfg.observability.tracing.sample_ratio == variant.sample_ratio


def test_with_tracing_needs_the_llm_lanes_app():
    with pytest.raises(ValueError, match="app.main:build_app"):
        with_tracing({"applications": [{"import_path": "other:app"}]}, {"exporter": "none"})


def test_app_url():
    assert app_url(LOCAL) == "http://127.0.0.1:8000"
    assert app_url({"http_options": {"host": "0.0.0.0", "port": 8123}}) == "http://127.0.0.1:8123"
    assert app_url({}) == "http://127.0.0.1:8000"


# ---- load -----------------------------------------------------------------------------------------------------------


async def test_closed_loop_keeps_concurrency_and_numbers_requests():
    in_flight, most, indices = 0, 0, []

    async def call(index: int, run_start: float) -> RequestRecord:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        indices.append(index)
        await asyncio.sleep(0.001)
        in_flight -= 1
        return RequestRecord("p", "interactive", index, False, 0.0, e2e_s=0.001, status=200)

    records, wall_s = await closed_loop(call, requests=10, concurrency=3, first_index=100)
    assert len(records) == 10 and wall_s > 0 and most == 3
    assert sorted(indices) == list(range(100, 110))
    records, _ = await closed_loop(call, requests=2, concurrency=8)
    assert len(records) == 2


def test_prompts_are_deterministic_short_and_distinct():
    assert prompt_text(7, 3, 16) == prompt_text(7, 3, 16)
    assert prompt_text(7, 3, 16) != prompt_text(7, 4, 16)
    assert prompt_text(7, 3, 16).startswith("request 3 ") and len(prompt_text(7, 3, 16).split()) == 16


def test_http_request_bodies():
    chat = http_request(1, "hi there", model="m", endpoint="chat", streaming=False, max_tokens=16, phase="chat")
    assert chat.path == "/v1/chat/completions" and chat.body["messages"] == [{"role": "user", "content": "hi there"}]
    assert chat.body["ignore_eos"] and "stream_options" not in chat.body and chat.request_class == "interactive"
    completion = http_request(2, "hi", model="m", endpoint="completions", streaming=True, max_tokens=4, phase="x")
    assert completion.path == "/v1/completions" and completion.body["prompt"] == "hi"
    assert completion.body["stream_options"] == {"include_usage": True}


async def test_http_phase_against_the_fake_server():
    runner = web.AppRunner(fake_app(token_delay_s=0.002))
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        records, wall_s = await http_phase(
            url, lambda i: http_request(i, prompt_text(1, i, 8), model="tiny-llama", endpoint="completions",
                                        streaming=True, max_tokens=3, phase="router_http"),
            requests=6, concurrency=2)
    finally:
        await runner.cleanup()
    assert len(records) == 6 and all(r.ok and r.output_tokens == 3 and r.prompt_tokens == 8 for r in records)
    summary = phase_summary(records, wall_s)
    assert summary["ok"] == 6 and summary["ttft_ms"]["count"] == 6 and summary["requests_per_s"] > 0


class FakeChunk:
    def __init__(self, completion_tokens: int):
        self.completion_tokens, self.prompt_tokens = completion_tokens, 5


class FakeHandle:
    """handle.options(stream=True).generate.remote(request) -> an async iterator of chunks, as Serve's handle."""

    def __init__(self, chunks: int, fail: bool = False):
        self.chunks, self.fail, self.requests = chunks, fail, []
        self.generate = self

    def options(self, stream: bool) -> "FakeHandle":
        assert stream
        return self

    async def _stream(self):
        for i in range(self.chunks):
            await asyncio.sleep(0.001)
            yield FakeChunk(4 * (i + 1))
        if self.fail:
            raise RuntimeError("replica died")

    def remote(self, request):
        self.requests.append(request)
        return self._stream()


async def test_hot_lane_call_records_like_an_http_request():
    handle = FakeHandle(chunks=4)
    record = await hot_lane_call(handle, "req", "hot_lane_handle", 9, 0.0)
    assert handle.requests == ["req"] and record.ok and record.index == 9 and record.streaming
    assert record.output_tokens == 16 and record.prompt_tokens == 5 and len(record.chunk_offsets_s) == 4
    assert 0 < record.ttft_s == record.chunk_offsets_s[0] <= record.e2e_s

    failed = await hot_lane_call(FakeHandle(chunks=1, fail=True), "req", "hot_lane_handle", 1, 0.0)
    assert not failed.ok and failed.error_key == "handle" and "replica died" in failed.error


# ---- report ---------------------------------------------------------------------------------------------------------


def _summary(rps: float, e2e: tuple[float, float], ttft: tuple[float, float]) -> dict:
    return {"requests": 10, "ok": 10, "errors": {}, "wall_s": 1.0, "requests_per_s": rps, "output_tokens": 160,
            "e2e_ms": {"p50": e2e[0], "p99": e2e[1]}, "ttft_ms": {"p50": ttft[0], "p99": ttft[1]}}


def _run(variant: str, rps: float, e2e_p50: float, error: str | None = None) -> dict:
    run = {"variant": variant, "tracing_label": variant, "error": error}
    if error is None:
        run["phases"] = {"chat": _summary(rps, (e2e_p50, 2 * e2e_p50), (e2e_p50, e2e_p50)),
                         "chat_stream": _summary(rps, (e2e_p50, e2e_p50), (e2e_p50 / 2, e2e_p50))}
    return run


def test_comparisons():
    assert relative_change(110, 100) == pytest.approx(0.1) and relative_change(1, 0) is None
    assert relative_change(None, 1) is None
    off, on = _run("tracing-off", 10.0, 100.0), _run("tracing-100pct", 9.0, 110.0)
    versus = tracing_comparison(on, off)
    assert versus["requests_per_s_change"] == pytest.approx(-0.1)
    assert versus["e2e_p50_ms_delta"] == pytest.approx(10) and versus["e2e_p99_ms_delta"] == pytest.approx(20)
    assert versus["ttft_p50_ms_delta"] == pytest.approx(5)
    diff = router_overhead(_summary(1, (30, 60), (12, 40)), _summary(1, (25, 50), (10, 30)))
    assert diff == {"ttft_p50_ms": 2, "ttft_p99_ms": 10, "e2e_p50_ms": 5, "e2e_p99_ms": 10}
    spans = [{"trace_id": "a", "name": "request"}, {"trace_id": "a", "name": "route"},
             {"trace_id": "b", "name": "request"}]
    assert span_file_stats(spans) == {"spans": 3, "traces": 2, "request_spans": 2}


def test_report_and_markdown():
    settings = Settings("serve_configs/local.yaml", Path("out"), 10, 8, 4, 16, 16, 2, 7, 600.0)
    off = _run("tracing-off", 10.0, 100.0)
    off["router_overhead"] = {"rounds": 2, "http": _summary(1, (30, 60), (12, 40)),
                              "handle": _summary(1, (25, 50), (10, 30)), "prompt_token_mismatches": 0,
                              "difference_ms": router_overhead(_summary(1, (30, 60), (12, 40)),
                                                               _summary(1, (25, 50), (10, 30)))}
    on = _run("tracing-100pct", 9.0, 110.0)
    on["span_file"] = {"spans": 1234, "traces": 24, "request_spans": 24}
    failed = _run("tracing-1pct", 0, 0, error="did not start")
    report = build_report(settings, "2026-12-02T00:00:00+00:00", [off, on, failed])
    assert "router_overhead" not in off and report["router_overhead"]["rounds"] == 2
    assert "versus_off" not in off and "versus_off" in on and "versus_off" not in failed
    assert report["settings"]["out_dir"] == "out"
    markdown = render_markdown(report)
    assert "| tracing-100pct | tracing-100pct | 9.00 | 110.0 / 220.0 | 55.0 / 110.0 | -10.0 % | +10.0 / +20.0 |" \
        in markdown
    assert "1,234 (24)" in markdown and "failed: did not start" in markdown
    assert "**+2.0** / +10.0 | +5.0 / +10.0" in markdown
    # Every table row has as many cells as its header.
    for table in markdown.split("\n\n"):
        rows = [line for line in table.splitlines() if line.startswith("|")]
        assert len({row.count("|") for row in rows}) <= 1, table

    report["router_overhead"] = None
    assert "Not measured" in render_markdown(report)


# ---- request-rate ceiling -----------------------------------------------------------------------------------------


def _level(concurrency, rps, errors=None, client_cpu=0.3):
    return {"concurrency": concurrency, "requests": 10, "ok": 10, "errors": errors or {}, "wall_s": 1.0,
            "requests_per_s": rps, "e2e_ms": {"p50": 5.0, "p99": 9.0}, "client_cpu_per_wall_s": client_cpu}


def test_rate_ceiling_is_the_fastest_level_without_errors():
    levels = [_level(16, 300.0), _level(64, 800.0, client_cpu=0.95), _level(256, 900.0, errors={"503": 2})]
    assert rate_ceiling(levels) == {"requests_per_s": 800.0, "concurrency": 64, "client_bound": True}
    assert rate_ceiling([_level(8, 10.0, errors={"timeout": 1})]) is None


def serve_fake_app_in_a_thread():
    """The fake OpenAI server on its own loop in a thread: measure_rate_ceiling runs asyncio.run itself."""
    ready, loop_box = threading.Event(), {}

    def run():
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(fake_app(token_delay_s=0.001))
        loop.run_until_complete(runner.setup())
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        loop.run_until_complete(web.SockSite(runner, sock).start())
        loop_box.update(loop=loop, runner=runner, port=sock.getsockname()[1])
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)
    return loop_box, thread


def test_measure_rate_ceiling_against_the_fake_server():
    box, thread = serve_fake_app_in_a_thread()
    try:
        settings = Settings("serve_configs/local.yaml", Path("out"), 10, 8, 2, 16, 8, 2, 7, 600.0,
                            rate_concurrency=[1, 4], rate_requests=12)
        result = measure_rate_ceiling(settings, f"http://127.0.0.1:{box['port']}", "tiny-llama")
    finally:
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        thread.join(10)
    assert [level["concurrency"] for level in result["levels"]] == [1, 4]
    assert all(level["ok"] == 12 and level["requests_per_s"] > 0 for level in result["levels"])
    assert result["ceiling"]["requests_per_s"] == max(level["requests_per_s"] for level in result["levels"])
    report = {"settings": settings.to_json(), "started_at": "t", "machine": {"cpus": 2}, "tracing_runs": [],
              "router_overhead": None, "rate_ceiling": result}
    markdown = render_markdown(report)
    assert "## Request-rate ceiling" in markdown and "**Ceiling:" in markdown


@pytest.mark.parametrize("haproxy", [False, True])
def test_markdown_with_the_direct_ingress_path(haproxy):
    settings = Settings("serve_configs/local.yaml", Path("out"), 10, 8, 4, 16, 16, 2, 7, 600.0, direct_ingress=True,
                        haproxy=haproxy)
    off = _run("tracing-off", 10.0, 100.0)
    http, direct = _summary(1, (30, 60), (12, 40)), _summary(1, (28, 55), (11, 35))
    handle = _summary(1, (25, 50), (10, 30))
    off["router_overhead"] = {"rounds": 2, "http": http, "handle": handle, "prompt_token_mismatches": 0,
                              "difference_ms": router_overhead(http, handle), "direct": direct,
                              "direct_url": "http://127.0.0.1:30000",
                              "direct_difference_ms": router_overhead(direct, handle)}
    off["rate_ceiling"] = {"levels": [_level(16, 300.0)], "ceiling": rate_ceiling([_level(16, 300.0)])}
    off["rate_ceiling_direct"] = {"levels": [_level(16, 600.0)], "ceiling": rate_ceiling([_level(16, 600.0)])}
    report = build_report(settings, "2026-12-03T00:00:00+00:00", [off])
    assert report["rate_ceiling_direct"]["ceiling"]["requests_per_s"] == 600.0
    markdown = render_markdown(report)
    assert "| Router: HTTP /v1/completions, direct ingress | 10 (10) | 11 / 35 |" in markdown
    assert "| **Router overhead**, direct ingress (difference) | | **+1.0** / +5.0 |" in markdown
    assert "## Request-rate ceiling, direct ingress" in markdown and "**Ceiling: 600.0 req/s**" in markdown
    front = "HAProxy" if haproxy else "the HTTP proxy"
    assert f"| Router: HTTP /v1/completions via {front} | 10 (10) | 12 / 40 |" in markdown
    assert f"through {'HAProxy' if haproxy else 'the HTTP proxy'} and the Router;" in markdown
    for table in markdown.split("\n\n"):
        rows = [line for line in table.splitlines() if line.startswith("|")]
        assert len({row.count("|") for row in rows}) <= 1, table


def test_rate_ceiling_over_two_servers_round_robin():
    first, first_thread = serve_fake_app_in_a_thread()
    second, second_thread = serve_fake_app_in_a_thread()
    try:
        settings = Settings("serve_configs/local.yaml", Path("out"), 10, 8, 2, 16, 8, 2, 7, 600.0,
                            rate_concurrency=[4], rate_requests=12)
        urls = f"http://127.0.0.1:{first['port']},http://127.0.0.1:{second['port']}"
        result = measure_rate_ceiling(settings, urls, "tiny-llama", "rate_direct")
    finally:
        for box, thread in ((first, first_thread), (second, second_thread)):
            box["loop"].call_soon_threadsafe(box["loop"].stop)
            thread.join(10)
    assert result["levels"][0]["ok"] == 12 and result["ceiling"]["requests_per_s"] > 0


def test_rate_level_spread_over_client_processes():
    """--rate-clients: the level's requests and concurrency shared by two spawned load-generator processes, their
    records merged (each request once), the busiest process's CPU reported."""
    box, thread = serve_fake_app_in_a_thread()
    try:
        settings = Settings("serve_configs/local.yaml", Path("out"), 10, 8, 3, 16, 8, 2, 7, 600.0,
                            rate_concurrency=[5], rate_requests=13, rate_clients=2)
        result = measure_rate_ceiling(settings, f"http://127.0.0.1:{box['port']}", "tiny-llama")
    finally:
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        thread.join(10)
    level = result["levels"][0]
    assert (level["clients"], level["requests"], level["ok"]) == (2, 13, 13)
    assert 0 < level["client_cpu_per_wall_s"] and level["requests_per_s"] > 0
    markdown = render_markdown({"settings": settings.to_json(), "started_at": "t", "machine": {"cpus": 2},
                                "tracing_runs": [], "router_overhead": None, "rate_ceiling": result})
    assert "| 5 | 2 | 13 (13) |" in markdown
