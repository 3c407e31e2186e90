"""What tracing and the Router cost, measured in one run on whatever engine the base serve config names.

(a) Tracing overhead. The app is started once per tracing variant from a copy of the base serve config that differs
    only in `observability.tracing`: off (exporter none), file exporter with 100 % sampling, file exporter with 1 %
    sampling (spans really exported, to a temporary JSON-lines file). In each, a fixed number of short chat requests
    is sent at a fixed closed-loop concurrency after a warm-up, non-streamed (requests/s, E2E p50/p99) and streamed
    (TTFT p50/p99).
(b) Router overhead. In the tracing-off run, streamed TTFT through the Router's HTTP API (/v1/completions with a
    plain prompt) is compared with calling the HotLane deployment handle directly with the same prompt tokenized by
    the same tokenizer, as an interactive request, at the same concurrency. The two paths alternate in rounds so a
    drift of the machine over time hits both alike.

    .venv/bin/python -m load_tests.overhead --serve-config serve_configs/local.yaml \
        --requests 400 --concurrency 8 --out load_tests/results/overhead-cpu

    With --direct-ingress the app is started with Ray Serve's direct ingress (load_tests/direct_ingress.py) and a
    third path alternates with the two: the Router replicas' own HTTP ports, without the proxy hop (the proxy keeps
    answering on its port, so all three paths are measured on one running app). With --haproxy (implies
    --direct-ingress) Ray's HAProxy front door answers on the proxy's port instead of Serve's Python proxy
    (load_tests/direct_ingress.py: HAPROXY_ENV), and "the proxy" in the report is HAProxy.
(c) Request-rate ceiling (with --rate-concurrency): in the tracing-off run, non-streamed /v1/completions of a short
    prompt and max_tokens 1 through the Router at each closed-loop concurrency given; requests/s and E2E per level.
    With --direct-ingress each level runs on both ingress paths (proxy, then the replicas' ports).
    The highest requests/s is the ceiling of the path (HTTP proxy + Router + one lane call) on that host, unless the
    load generator itself was the limit: its CPU use (process CPU seconds / wall seconds) is reported per level, and
    a value near 1.0 means the client, not the app, saturated. --rate-clients N spreads each level over N client
    processes (the busiest one's CPU is reported).

Outputs in --out: report.json (settings, summaries, every request's record), report.md (the tables), the derived
serve configs and their `serve run` logs. Run it from the repository root, as `load_tests.run`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime as dt
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from load_tests import direct_ingress
from load_tests.client import RequestRecord, RequestSpec, send, words
from load_tests.overlay import OverlayError, add_set_argument, load_serve_config
from load_tests.report import _num
from load_tests.serve_runner import (
    AppStartError,
    ServedApp,
    app_url,
    default_cleanup_commands,
    default_start_command,
    default_stop_commands,
    llm_lanes_application,
)
from load_tests.stats import summarize_class
from load_tests.workload import ClientPool, split

HOT_LANE_DEPLOYMENT = "HotLane"
# The Router-vs-handle measurement's own limit (its child process is killed past it).
ROUTER_OVERHEAD_TIMEOUT_S = 1800.0
REQUEST_CLASS = "interactive"  # the default class: what most chat traffic is, served by the hot lane
REQUEST_TIMEOUT_S = 120.0
# Each phase numbers its prompts from its own base, so no phase replays another's prompts (which could hit the
# prefix cache); all bases have the same number of digits, so prompts keep the same length everywhere.
PHASE_INDEX_BASE = {"chat": 1_000_000, "chat_stream": 2_000_000, "router_http": 3_000_000,
                    "hot_lane_handle": 4_000_000, "rate": 5_000_000, "router_direct": 6_000_000,
                    "rate_direct": 7_000_000, "warmup": 9_000_000}


@dataclass(frozen=True)
class TracingVariant:
    name: str
    exporter: str  # "none" or "file"
    sample_ratio: float = 1.0

    def tracing_section(self, span_file: str | None) -> dict[str, Any]:
        if self.exporter == "none":
            return {"exporter": "none"}
        return {"exporter": self.exporter, "file_path": span_file, "sample_ratio": self.sample_ratio}


TRACING_VARIANTS = {
    variant.name: variant
    for variant in (
        TracingVariant("tracing-off", "none"),
        TracingVariant("tracing-100pct", "file", 1.0),
        TracingVariant("tracing-1pct", "file", 0.01),
    )
}
BASELINE_VARIANT = "tracing-off"
# The load generator is one Python process: at this share of a core (CPU seconds per wall second) it, not the app,
# is what limits the measured request rate.
CLIENT_BOUND_CPU = 0.9


# --------------------------------------------------------------------------------------------------------------------
# Serve config: the base config with another tracing section, where to reach the app, which model and tokenizer
# --------------------------------------------------------------------------------------------------------------------


def with_tracing(serve_config: dict[str, Any], tracing: dict[str, Any]) -> dict[str, Any]:
    """A copy of the serve config whose llm-lanes app has this `observability.tracing` section; nothing else
    changes (the other observability keys are kept)."""
    derived = copy.deepcopy(serve_config)
    args = llm_lanes_application(derived).setdefault("args", {})
    observability = args.get("observability") or {}
    args["observability"] = {**observability, "tracing": dict(tracing)}
    return derived


# --------------------------------------------------------------------------------------------------------------------
# Load: a closed loop over either path, one RequestRecord per request
# --------------------------------------------------------------------------------------------------------------------

Call = Callable[[int, float], Awaitable[RequestRecord]]  # (request index, run start) -> record


async def closed_loop(call: Call, requests: int, concurrency: int,
                      first_index: int = 0) -> tuple[list[RequestRecord], float]:
    """`requests` calls, `concurrency` in flight at all times (until the last ones); (records, wall seconds)."""
    run_start = time.perf_counter()
    records: list[RequestRecord] = []
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while issued < requests:
            index = first_index + issued
            issued += 1
            records.append(await call(index, run_start))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
    return records, time.perf_counter() - run_start


def prompt_text(seed: int, index: int, n_words: int) -> str:
    """A short prompt, the same for a given index on both paths; the leading request number keeps prompts apart
    (no prefix-cache hits between requests)."""
    rng = random.Random(f"{seed}:overhead:{index}")
    return f"request {index} " + words(rng, max(1, n_words - 2))


def http_request(index: int, prompt: str, *, model: str, endpoint: str, streaming: bool, max_tokens: int,
                 phase: str) -> RequestSpec:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": streaming, "ignore_eos": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if streaming:
        body["stream_options"] = {"include_usage": True}
    return RequestSpec(phase, REQUEST_CLASS, index, endpoint, streaming, body)


async def http_phase(url: str, make_spec: Callable[[int], RequestSpec], requests: int, concurrency: int,
                     first_index: int = 0) -> tuple[list[RequestRecord], float]:
    """`url` may list several servers, comma-separated: requests go to them round robin."""
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with ClientPool(url, limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as pool:
        async def call(index: int, run_start: float) -> RequestRecord:
            # Every chunk with a choice counts as a token: the tiny model's tokens may decode to no text, and the
            # lane's first chunk is what TTFT is about on both paths.
            return await send(pool.next(), make_spec(index), run_start, [], REQUEST_TIMEOUT_S,
                              count_empty_chunks=True)

        return await closed_loop(call, requests, concurrency, first_index)


async def hot_lane_call(handle: Any, lane_request: Any, phase: str, index: int, run_start: float) -> RequestRecord:
    """One streamed generate() on the HotLane handle, recorded like an HTTP request (TTFT = first chunk)."""
    start = time.perf_counter()
    record = RequestRecord(phase, REQUEST_CLASS, index, True, start - run_start)

    async def consume() -> None:
        async for chunk in handle.options(stream=True).generate.remote(lane_request):
            offset = time.perf_counter() - start
            if record.ttft_s is None:
                record.ttft_s = offset
            record.chunk_offsets_s.append(offset)
            # Cumulative counts: the last chunk holds the usage.
            record.output_tokens = chunk.completion_tokens
            record.prompt_tokens = chunk.prompt_tokens

    try:
        await asyncio.wait_for(consume(), REQUEST_TIMEOUT_S)
        record.status = 200  # RequestRecord's notion of success
        record.usage_reported = True
    except asyncio.TimeoutError:
        record.error = f"timeout: no complete answer within {REQUEST_TIMEOUT_S} s"
    except Exception as error:  # noqa: BLE001 -- every failure is a recorded outcome, not a crash of the run
        record.error = f"handle: {type(error).__name__}: {error}"[:300]
    record.e2e_s = time.perf_counter() - start
    return record


# --------------------------------------------------------------------------------------------------------------------
# Report shaping (pure)
# --------------------------------------------------------------------------------------------------------------------


def phase_summary(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    summary = summarize_class(records, None, [])
    return {
        "requests": summary["requests"],
        "ok": summary["ok"],
        "errors": summary["errors"],
        "wall_s": wall_s,
        "requests_per_s": summary["requests_per_s"],
        "ttft_ms": summary["ttft_ms"],
        "e2e_ms": summary["e2e_ms"],
        "output_tokens": summary["output_tokens"],
    }


def difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def relative_change(value: float | None, baseline: float | None) -> float | None:
    """(value - baseline) / baseline, e.g. 0.05 = 5 % more than the baseline."""
    if value is None or baseline is None or baseline == 0:
        return None
    return (value - baseline) / baseline


def tracing_comparison(variant: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """A tracing variant against tracing off: relative change of requests/s, absolute change of latencies (ms)."""
    chat, chat_off = variant["phases"]["chat"], baseline["phases"]["chat"]
    stream, stream_off = variant["phases"]["chat_stream"], baseline["phases"]["chat_stream"]
    return {
        "requests_per_s_change": relative_change(chat["requests_per_s"], chat_off["requests_per_s"]),
        "e2e_p50_ms_delta": difference(chat["e2e_ms"]["p50"], chat_off["e2e_ms"]["p50"]),
        "e2e_p99_ms_delta": difference(chat["e2e_ms"]["p99"], chat_off["e2e_ms"]["p99"]),
        "ttft_p50_ms_delta": difference(stream["ttft_ms"]["p50"], stream_off["ttft_ms"]["p50"]),
        "ttft_p99_ms_delta": difference(stream["ttft_ms"]["p99"], stream_off["ttft_ms"]["p99"]),
    }


def router_overhead(http: dict[str, Any], handle: dict[str, Any]) -> dict[str, float | None]:
    """What the HTTP proxy + Router add to the direct handle call, in ms (Router path minus direct path)."""
    return {
        "ttft_p50_ms": difference(http["ttft_ms"]["p50"], handle["ttft_ms"]["p50"]),
        "ttft_p99_ms": difference(http["ttft_ms"]["p99"], handle["ttft_ms"]["p99"]),
        "e2e_p50_ms": difference(http["e2e_ms"]["p50"], handle["e2e_ms"]["p50"]),
        "e2e_p99_ms": difference(http["e2e_ms"]["p99"], handle["e2e_ms"]["p99"]),
    }


def span_file_stats(spans: list[dict[str, Any]]) -> dict[str, int]:
    return {
        "spans": len(spans),
        "traces": len({span["trace_id"] for span in spans}),
        "request_spans": sum(span["name"] == "request" for span in spans),
    }


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:+.1f} %"


def _delta(value: float | None) -> str:
    return "–" if value is None else f"{value:+,.1f}"


def _spans(stats: dict[str, int] | None) -> str:
    return "–" if stats is None else f"{stats['spans']:,} ({stats['traces']:,})"


def _p50_p99(distribution: dict[str, Any]) -> str:
    return f"{_num(distribution['p50'])} / {_num(distribution['p99'])}"


def front_door(settings: dict[str, Any]) -> str:
    """What answers on http_options.port in this run."""
    return "HAProxy" if settings.get("haproxy") else "the HTTP proxy"


def errors_cell(errors: dict[str, int]) -> str:
    """A table cell of error counts by kind ("none" when there were none)."""
    return ", ".join(f"{k}: {v}" for k, v in errors.items()) or "none"


def rate_level_row(level: dict[str, Any]) -> str:
    """One rate level as a table row: concurrency, client processes, requests (ok), req/s, E2E p50 / p99, the busiest
    client's CPU, errors."""
    errors = errors_cell(level["errors"])
    return (f"| {level['concurrency']} | {level.get('clients', 1)} | {level['requests']} ({level['ok']}) | "
            f"{_num(level['requests_per_s'], 1)} | {_p50_p99(level['e2e_ms'])} | "
            f"{_num(level['client_cpu_per_wall_s'], 2)} | {errors} |")


def render_rate_ceiling(rate: dict[str, Any] | None, direct: bool = False, front: str = "the HTTP proxy") -> list[str]:
    if not rate:
        return []
    path = ("the Router replicas' own ports (direct ingress, no proxy)" if direct
            else f"{front} and the Router")
    lines = ["## Request-rate ceiling" + (", direct ingress" if direct else ""), "",
             f"Non-streamed /v1/completions, short prompt, max_tokens 1, through {path}; closed "
             "loop at each concurrency, shared by the client processes. Client CPU = the busiest load-generator "
             "process's CPU seconds per wall second (near 1.0: the client, not the app, was the limit).", "",
             "| concurrency | client processes | requests (ok) | req/s | E2E p50 / p99 (ms) | client CPU | errors |",
             "|---|---|---|---|---|---|---|"]
    lines += [rate_level_row(level) for level in rate["levels"]]
    ceiling = rate["ceiling"]
    if ceiling:
        bound = " (the load generator was at its limit: the app's ceiling is at least this)" \
            if ceiling["client_bound"] else ""
        lines += ["", f"**Ceiling: {_num(ceiling['requests_per_s'], 1)} req/s** at concurrency "
                      f"{ceiling['concurrency']}{bound}."]
    lines.append("")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    front = front_door(report["settings"])
    return "\n".join([render_overheads(report), *render_rate_ceiling(report.get("rate_ceiling"), front=front),
                      *render_rate_ceiling(report.get("rate_ceiling_direct"), direct=True)])


def render_overheads(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        "# Overhead: tracing and the Router",
        "",
        f"Base config `{settings['serve_config']}`, {settings['requests']} measured requests per phase after "
        f"{settings['warmup']} warm-up, closed loop at concurrency {settings['concurrency']}, "
        f"~{settings['prompt_words']}-word prompts, max_tokens {settings['max_tokens']} (ignore_eos), "
        f"class {REQUEST_CLASS}. "
        f"Started {report['started_at']} on {report['machine']['cpus']} CPUs.",
        "",
        "## Tracing overhead",
        "",
        "Non-streamed chat: requests/s and E2E; streamed chat: TTFT. Changes are against tracing off. Each "
        f"variant sent {settings['warmup'] + 2 * settings['requests']} requests (warm-up included); the span file "
        "shows how many were traced.",
        "",
        "| variant | tracing | req/s | E2E p50 / p99 (ms) | TTFT p50 / p99 (ms) | Δ req/s | Δ E2E p50 / p99 (ms) "
        "| Δ TTFT p50 / p99 (ms) | spans (traces) exported | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report["tracing_runs"]:
        if run["error"]:
            lines.append(f"| {run['variant']} | {run['tracing_label']} | failed: {run['error']} |" + " |" * 7)
            continue
        chat, stream = run["phases"]["chat"], run["phases"]["chat_stream"]
        versus = run.get("versus_off") or {}
        spans = run.get("span_file")
        errors = sum(chat["errors"].values()) + sum(stream["errors"].values())
        lines.append(
            f"| {run['variant']} | {run['tracing_label']} | {_num(chat['requests_per_s'], 2)} | "
            f"{_p50_p99(chat['e2e_ms'])} | {_p50_p99(stream['ttft_ms'])} | "
            f"{_pct(versus.get('requests_per_s_change'))} | "
            f"{_delta(versus.get('e2e_p50_ms_delta'))} / {_delta(versus.get('e2e_p99_ms_delta'))} | "
            f"{_delta(versus.get('ttft_p50_ms_delta'))} / {_delta(versus.get('ttft_p99_ms_delta'))} | "
            f"{_spans(spans)} | {errors} |"
        )
    lines.append("")

    overhead = report.get("router_overhead")
    lines += ["## Router overhead", ""]
    if not overhead:
        lines += ["Not measured (needs the tracing-off variant).", ""]
        return "\n".join(lines)
    if overhead.get("error"):
        lines += [f"Failed: {overhead['error']}", ""]
        return "\n".join(lines)
    http, handle, diff = overhead["http"], overhead["handle"], overhead["difference_ms"]
    lines += [
        f"Streamed /v1/completions, {overhead['rounds']} alternating rounds per path; the direct path sends the "
        f"prompt tokenized as the Router does ({overhead['prompt_token_mismatches']} Router prompt-token counts "
        "differed from that tokenization).",
        "",
        "| path | requests (ok) | TTFT p50 / p99 (ms) | E2E p50 / p99 (ms) | errors |",
        "|---|---|---|---|---|",
    ]
    front = front_door(settings)
    rows = [(f"Router: HTTP /v1/completions via {front}", http)]
    if overhead.get("direct"):
        rows.append(("Router: HTTP /v1/completions, direct ingress", overhead["direct"]))
    rows.append(("HotLane handle, direct", handle))
    for title, summary in rows:
        errors = errors_cell(summary["errors"])
        lines.append(f"| {title} | {summary['requests']} ({summary['ok']}) | {_p50_p99(summary['ttft_ms'])} | "
                     f"{_p50_p99(summary['e2e_ms'])} | {errors} |")
    lines.append(f"| **Router overhead** via {front} (difference) | | **{_delta(diff['ttft_p50_ms'])}** / "
                 f"{_delta(diff['ttft_p99_ms'])} | {_delta(diff['e2e_p50_ms'])} / {_delta(diff['e2e_p99_ms'])} | |")
    if overhead.get("direct_difference_ms"):
        direct = overhead["direct_difference_ms"]
        lines.append(f"| **Router overhead**, direct ingress (difference) | | **{_delta(direct['ttft_p50_ms'])}** / "
                     f"{_delta(direct['ttft_p99_ms'])} | {_delta(direct['e2e_p50_ms'])} / "
                     f"{_delta(direct['e2e_p99_ms'])} | |")
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Settings:
    serve_config: str
    out_dir: Path
    requests: int
    concurrency: int
    warmup: int
    max_tokens: int
    prompt_words: int
    rounds: int
    seed: int
    ready_timeout_s: float
    variants: list[str] = field(default_factory=lambda: list(TRACING_VARIANTS))
    rate_concurrency: list[int] = field(default_factory=list)
    rate_requests: int = 2000
    direct_ingress: bool = False
    haproxy: bool = False
    rate_clients: int = 1

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _log(message: str) -> None:
    print(f"[overhead] {message}", file=sys.stderr, flush=True)


def measure_tracing_phases(settings: Settings, url: str, model: str) -> tuple[dict[str, Any], dict[str, list]]:
    """Warm-up, then non-streamed and streamed chat: summaries and raw records per phase."""

    def chat(streaming: bool, phase: str) -> Callable[[int], RequestSpec]:
        return lambda index: http_request(index, prompt_text(settings.seed, index, settings.prompt_words),
                                          model=model, endpoint="chat", streaming=streaming,
                                          max_tokens=settings.max_tokens, phase=phase)

    asyncio.run(http_phase(url, chat(False, "warmup"), settings.warmup, settings.concurrency,
                           PHASE_INDEX_BASE["warmup"]))
    phases, records = {}, {}
    for phase, streaming in (("chat", False), ("chat_stream", True)):
        phase_records, wall_s = asyncio.run(
            http_phase(url, chat(streaming, phase), settings.requests, settings.concurrency,
                       PHASE_INDEX_BASE[phase]))
        phases[phase] = phase_summary(phase_records, wall_s)
        records[phase] = [r.to_json() for r in phase_records]
        summary = phases[phase]
        _log(f"  {phase}: {_num(summary['requests_per_s'], 2)} req/s, E2E p50 {_num(summary['e2e_ms']['p50'])} ms, "
             f"TTFT p50 {_num(summary['ttft_ms']['p50'])} ms, errors {summary['errors'] or 'none'}")
    return phases, records


def measure_router_overhead(settings: Settings, url: str, app_config: dict[str, Any],
                            app_name: str, direct_url: str | None = None) -> dict[str, Any]:
    """Router (HTTP through the proxy) vs the HotLane handle, streamed, same prompts, alternating rounds; with
    `direct_url` (direct ingress) the Router's own ports as a third path."""
    # Imported here: only this measurement needs Ray, the app's types and the tokenizer.
    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from app.lanes.types import LaneRequest, SamplingOptions
    from app.classes import RequestClass, policy_for

    model = app_config["model"]
    tokenizer = AutoTokenizer.from_pretrained(model.get("tokenizer") or model["source"])
    priority = policy_for(RequestClass(REQUEST_CLASS)).priority

    def prompt(index: int) -> str:
        return prompt_text(settings.seed, index, settings.prompt_words)

    def lane_request(index: int, phase: str) -> LaneRequest:
        # What the Router builds for a streamed interactive /v1/completions request on the hot lane
        # (app/router/pipeline.py: RequestPipeline.prepare, then LaneCall: priority from the route, may_spill).
        return LaneRequest(
            request_id=f"overhead-{phase}-{index}",
            prompt_token_ids=tokenizer.encode(prompt(index), add_special_tokens=False),
            sampling=SamplingOptions(max_tokens=settings.max_tokens, ignore_eos=True),
            request_class=RequestClass(REQUEST_CLASS),
            priority=priority,
            stream=True,
            may_spill=True,
        )

    def http_spec(index: int, phase: str = "router_http") -> RequestSpec:
        return http_request(index, prompt(index), model=model["served_name"], endpoint="completions",
                            streaming=True, max_tokens=settings.max_tokens, phase=phase)

    def direct_spec(index: int) -> RequestSpec:
        return http_spec(index, "router_direct")

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as for the `serve` CLI (Ray 2.60 turns token auth on)
    # No ray.shutdown(): this runs in a child process that ends with os._exit (measure_router_overhead_isolated).
    ray.init(address="auto", namespace="serve", log_to_driver=False)
    handle = serve.get_deployment_handle(HOT_LANE_DEPLOYMENT, app_name=app_name)

    async def handle_phase(requests: int, first_index: int, phase: str) -> tuple[list[RequestRecord], float]:
        async def call(index: int, run_start: float) -> RequestRecord:
            return await hot_lane_call(handle, lane_request(index, phase), phase, index, run_start)

        return await closed_loop(call, requests, settings.concurrency, first_index)

    async def run_all() -> dict[str, tuple[list[RequestRecord], float]]:
        # Warm every path (the handle's first calls set up its router and connections).
        await handle_phase(settings.warmup, PHASE_INDEX_BASE["warmup"], "warmup")
        await http_phase(url, http_spec, settings.warmup, settings.concurrency, PHASE_INDEX_BASE["warmup"])
        if direct_url:
            await http_phase(direct_url, direct_spec, settings.warmup, settings.concurrency,
                             PHASE_INDEX_BASE["warmup"] + 100_000)
        paths: dict[str, tuple[list[RequestRecord], float]] = {}

        def add(path: str, result: tuple[list[RequestRecord], float]) -> None:
            records, wall = paths.get(path, ([], 0.0))
            paths[path] = (records + result[0], wall + result[1])

        per_round = max(1, settings.requests // settings.rounds)
        for round_index in range(settings.rounds):
            offset = round_index * per_round
            add("http", await http_phase(url, http_spec, per_round, settings.concurrency,
                                         PHASE_INDEX_BASE["router_http"] + offset))
            if direct_url:
                add("direct", await http_phase(direct_url, direct_spec, per_round, settings.concurrency,
                                               PHASE_INDEX_BASE["router_direct"] + offset))
            add("handle", await handle_phase(per_round, PHASE_INDEX_BASE["hot_lane_handle"] + offset,
                                             "hot_lane_handle"))
        return paths

    paths = asyncio.run(run_all())

    http_records, handle_records = paths["http"][0], paths["handle"][0]
    http, handle_summary = phase_summary(*paths["http"]), phase_summary(*paths["handle"])
    # The direct path must feed the engine what the Router would: the Router's prompt token count (usage) has to
    # equal our own tokenization of the same prompt.
    mismatches = sum(1 for r in http_records
                     if r.ok and r.prompt_tokens != len(tokenizer.encode(prompt(r.index), add_special_tokens=False)))
    result = {
        "rounds": settings.rounds,
        "http": http,
        "handle": handle_summary,
        "difference_ms": router_overhead(http, handle_summary),
        "prompt_token_mismatches": mismatches,
        "records": {"http": [r.to_json() for r in http_records], "handle": [r.to_json() for r in handle_records]},
    }
    if "direct" in paths:
        direct = phase_summary(*paths["direct"])
        result.update(direct_url=direct_url, direct=direct,
                      direct_difference_ms=router_overhead(direct, handle_summary))
        result["records"]["direct"] = [r.to_json() for r in paths["direct"][0]]
    return result


def _router_overhead_child(conn, *args) -> None:
    try:
        conn.send(("ok", measure_router_overhead(*args)))
    except BaseException as error:  # noqa: BLE001 -- reported to the parent, which keeps the other figures
        conn.send(("error", f"{type(error).__name__}: {error}"[:300]))
    finally:
        conn.close()
        # Without Ray's shutdown: the handle's background threads (its request router's PrefixCache handle and
        # index sync) go on calling Ray during ray.shutdown(), which then kills the process or auto-starts a stray
        # local cluster that holds up the app's stop.
        os._exit(0)


def measure_router_overhead_isolated(timeout_s: float, *args) -> dict[str, Any]:
    """measure_router_overhead in a child process of its own (spawned), so the Ray driver it needs ends with it."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_router_overhead_child, args=(send, *args), daemon=True)
    child.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            raise TimeoutError(f"the Router-vs-handle measurement did not finish within {timeout_s:.0f} s")
        kind, value = receive.recv()
    except EOFError:
        raise RuntimeError(f"the Router-vs-handle measurement's process died (exit code {child.exitcode})") from None
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    if kind != "ok":
        raise RuntimeError(value)
    return value


@dataclass(frozen=True)
class RateJob:
    """One load-generator process's share of a rate level."""

    url: str
    model: str
    seed: int
    prompt_words: int
    phase: str
    warmup: int
    requests: int
    concurrency: int
    first_index: int


def run_rate_job(job: RateJob, barrier: Any = None) -> tuple[list[RequestRecord], float, float]:
    """Warm-up, then (after `barrier`, where several processes share a level) the measured requests: the records,
    the wall seconds and the CPU seconds this process spent on them."""
    def spec(index: int) -> RequestSpec:
        return http_request(index, prompt_text(job.seed, index, job.prompt_words), model=job.model,
                            endpoint="completions", streaming=False, max_tokens=1, phase=job.phase)

    if job.warmup:
        asyncio.run(http_phase(job.url, spec, job.warmup, job.concurrency,
                               PHASE_INDEX_BASE["warmup"] + 500_000 + job.first_index))
    if barrier is not None:
        barrier.wait(timeout=REQUEST_TIMEOUT_S)
    cpu_before = time.process_time()
    records, wall_s = asyncio.run(http_phase(job.url, spec, job.requests, job.concurrency, job.first_index))
    return records, wall_s, time.process_time() - cpu_before


def _rate_client_process(job: RateJob, barrier: Any, results: Any) -> None:
    try:
        results.put(("ok", run_rate_job(job, barrier)))
    except BaseException as error:  # the parent reports it; a child's traceback alone is easy to miss
        results.put(("error", f"{type(error).__name__}: {error}"))


def run_rate_level(jobs: list[RateJob]) -> tuple[list[RequestRecord], float, float]:
    """The jobs at once, one process each (one job: in this process): every record, the longest wall time, and the
    busiest process's CPU seconds per wall second."""
    if len(jobs) == 1:
        records, wall_s, cpu_s = run_rate_job(jobs[0])
        return records, wall_s, cpu_s / wall_s if wall_s > 0 else 0.0
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(len(jobs)), context.Queue()
    processes = [context.Process(target=_rate_client_process, args=(job, barrier, results), daemon=True)
                 for job in jobs]
    for process in processes:
        process.start()
    answers = [results.get(timeout=REQUEST_TIMEOUT_S * 4) for _ in jobs]
    for process in processes:
        process.join(timeout=30)
    errors = [value for kind, value in answers if kind != "ok"]
    if errors:
        raise RuntimeError(f"a load-generator process failed: {errors[0]}")
    records = [record for _, (chunk, _, _) in answers for record in chunk]
    walls = [wall_s for _, (_, wall_s, _) in answers]
    busiest = max(cpu_s / wall_s for _, (_, wall_s, cpu_s) in answers if wall_s > 0)
    return records, max(walls), busiest


def measure_rate_ceiling(settings: Settings, url: str, model: str, phase: str = "rate") -> dict[str, Any]:
    """Short non-streamed completions (max_tokens 1) at each concurrency level, spread over `rate_clients`
    load-generator processes: the path's request-rate ceiling."""
    levels = []
    for level, concurrency in enumerate(settings.rate_concurrency):
        clients = min(settings.rate_clients, concurrency)
        first = PHASE_INDEX_BASE[phase] + level * settings.rate_requests
        warmups = split(min(settings.warmup, settings.rate_requests), clients)
        requests, concurrencies = split(settings.rate_requests, clients), split(concurrency, clients)
        jobs = [RateJob(url, model, settings.seed, settings.prompt_words, phase, warmups[i], requests[i],
                        concurrencies[i], first + sum(requests[:i])) for i in range(clients)]
        records, wall_s, client_cpu = run_rate_level(jobs)
        summary = phase_summary(records, wall_s)
        levels.append({"concurrency": concurrency, "clients": clients, "client_cpu_per_wall_s": client_cpu,
                       **{k: summary[k] for k in ("requests", "ok", "errors", "wall_s", "requests_per_s", "e2e_ms")}})
        _log(f"  rate at concurrency {concurrency} from {clients} client process(es): "
             f"{_num(summary['requests_per_s'], 1)} req/s, E2E p50 {_num(summary['e2e_ms']['p50'])} ms, busiest "
             f"client's CPU {_num(client_cpu, 2)}, errors {summary['errors'] or 'none'}")
    return {"levels": levels, "ceiling": rate_ceiling(levels)}


def rate_ceiling(levels: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The level with the most requests/s among those without errors (None if every level had errors)."""
    clean = [level for level in levels if not level["errors"] and level["requests_per_s"]]
    if not clean:
        return None
    best = max(clean, key=lambda level: level["requests_per_s"])
    return {"requests_per_s": best["requests_per_s"], "concurrency": best["concurrency"],
            "client_bound": (best["client_cpu_per_wall_s"] or 0) >= CLIENT_BOUND_CPU}


def run_variant(settings: Settings, base_config: dict[str, Any], variant: TracingVariant,
                span_dir: Path) -> dict[str, Any]:
    span_file = span_dir / f"spans-{variant.name}.jsonl"
    derived = with_tracing(base_config, variant.tracing_section(str(span_file)))
    config_path = settings.out_dir / f"serve-{variant.name}.yaml"
    config_path.write_text(yaml.safe_dump(derived, sort_keys=False), encoding="utf-8")
    application = llm_lanes_application(derived)
    url, model = app_url(derived), application["args"]["model"]["served_name"]
    tracing_label = ("off" if variant.exporter == "none"
                     else f"{variant.exporter}, {variant.sample_ratio * 100:g} % sampled")
    result: dict[str, Any] = {"variant": variant.name, "tracing_label": tracing_label,
                              "tracing": variant.tracing_section(str(span_file)), "serve_config": str(config_path),
                              "started_at": _now(), "error": None}
    app = ServedApp(url, settings.out_dir / f"serve-{variant.name}.log", default_start_command(str(config_path)),
                    stop_commands=default_stop_commands(), cleanup_commands=default_cleanup_commands(),
                    ready_timeout_s=settings.ready_timeout_s,
                    env=(direct_ingress.HAPROXY_ENV if settings.haproxy
                         else direct_ingress.ENV if settings.direct_ingress else None))
    _log(f"{variant.name}: starting `serve run {config_path}` (log: {app.log_path})")
    try:
        app.start()
        result["ready_s"] = app.wait_ready()
        _log(f"{variant.name}: ready after {result['ready_s']:.0f} s")
        direct_url = None
        if settings.direct_ingress:
            direct_url = direct_ingress.router_urls(derived, [app.log_path])
            _log(f"{variant.name}: direct ingress at {direct_url}")
        result["phases"], result["records"] = measure_tracing_phases(settings, url, model)
        if variant.name == BASELINE_VARIANT:
            _log(f"{variant.name}: Router vs HotLane handle")
            try:
                result["router_overhead"] = measure_router_overhead_isolated(
                    ROUTER_OVERHEAD_TIMEOUT_S, settings, url, application["args"],
                    application.get("name", "llm-lanes"), direct_url)
            except Exception as error:  # noqa: BLE001 -- keep the tracing numbers when this part fails
                _log(f"router overhead failed: {error!r}")
                result["router_overhead"] = {"error": f"{type(error).__name__}: {error}"[:300]}
            if settings.rate_concurrency:
                _log(f"{variant.name}: request-rate ceiling at concurrency {settings.rate_concurrency}")
                result["rate_ceiling"] = measure_rate_ceiling(settings, url, model)
                if direct_url:
                    _log(f"{variant.name}: request-rate ceiling, direct ingress")
                    result["rate_ceiling_direct"] = measure_rate_ceiling(settings, direct_url, model, "rate_direct")
    except (AppStartError, TimeoutError) as error:
        _log(f"{variant.name}: {error}")
        result["error"] = str(error).splitlines()[0]
    finally:
        _log(f"{variant.name}: shutting down")
        app.stop()
    if span_file.exists():
        from app.observability.tracing import read_span_file

        result["span_file"] = span_file_stats(read_span_file(str(span_file)))
    return result


def build_report(settings: Settings, started_at: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    baseline = next((r for r in runs if r["variant"] == BASELINE_VARIANT and not r["error"]), None)
    for run in runs:
        if baseline is not None and run is not baseline and not run["error"]:
            run["versus_off"] = tracing_comparison(run, baseline)
    router = next((r.pop("router_overhead") for r in runs if "router_overhead" in r), None)
    rate = next((r.pop("rate_ceiling") for r in runs if "rate_ceiling" in r), None)
    rate_direct = next((r.pop("rate_ceiling_direct") for r in runs if "rate_ceiling_direct" in r), None)
    return {
        "started_at": started_at,
        "finished_at": _now(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "settings": settings.to_json(),
        "tracing_runs": runs,
        "router_overhead": router,
        "rate_ceiling": rate,
        "rate_ceiling_direct": rate_direct,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-config", default="serve_configs/local.yaml",
                        help="base serve config (or an overlay in load_tests/configs)")
    add_set_argument(parser)
    parser.add_argument("--out", required=True, help="directory for report.json, report.md, configs and logs")
    parser.add_argument("--requests", type=int, default=400, help="measured requests per phase (and per path)")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop requests in flight")
    parser.add_argument("--warmup", type=int, default=32, help="unmeasured requests before each measurement")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (ignore_eos)")
    parser.add_argument("--prompt-words", type=int, default=16, help="prompt length in words (~tokens)")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of Router and handle paths")
    parser.add_argument("--variant", action="append", choices=list(TRACING_VARIANTS), default=None,
                        help="run only these tracing variants (repeatable; default all)")
    parser.add_argument("--rate-concurrency", default="",
                        help="comma-separated closed-loop concurrencies for the request-rate ceiling (e.g. 16,64,256; "
                             "default: not measured)")
    parser.add_argument("--rate-requests", type=int, default=2000, help="requests per rate-ceiling level")
    parser.add_argument("--rate-clients", type=int, default=1,
                        help="load-generator processes sharing each rate level's concurrency and requests (one "
                             "Python client saturates a core at a few hundred short requests/s)")
    parser.add_argument("--direct-ingress", action="store_true",
                        help="start the app with Ray Serve's direct ingress and also measure the Router replicas' own "
                             "ports (Router overhead and request-rate ceiling)")
    parser.add_argument("--haproxy", action="store_true",
                        help="start the app with Ray's HAProxy front door in place of Serve's HTTP proxy on its port "
                             "(RAY_SERVE_ENABLE_HA_PROXY=1); implies --direct-ingress")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait until the app and every lane answer")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--requests, --concurrency and --rounds must be >= 1, --warmup >= 0")

    try:
        rate_concurrency = [int(level) for level in args.rate_concurrency.split(",") if level.strip()]
    except ValueError:
        parser.error(f"--rate-concurrency {args.rate_concurrency!r}: give comma-separated integers, e.g. 16,64,256")
    if any(level < 1 for level in rate_concurrency) or args.rate_requests < 1 or args.rate_clients < 1:
        parser.error("--rate-concurrency levels, --rate-requests and --rate-clients must be >= 1")
    try:
        base_config = load_serve_config(args.serve_config, args.set)
    except OverlayError as error:
        parser.error(str(error))
    described = args.serve_config + "".join(f" --set {s}" for s in args.set)
    settings = Settings(described, Path(args.out), args.requests, args.concurrency, args.warmup,
                        args.max_tokens, args.prompt_words, args.rounds, args.seed, args.ready_timeout,
                        args.variant or list(TRACING_VARIANTS), rate_concurrency, args.rate_requests,
                        args.direct_ingress or args.haproxy, args.haproxy, args.rate_clients)
    llm_lanes_application(base_config)  # fail before starting anything
    settings.out_dir.mkdir(parents=True, exist_ok=True)

    started_at = _now()
    with tempfile.TemporaryDirectory(prefix="llm-lanes-spans-") as span_dir:
        runs = [run_variant(settings, base_config, TRACING_VARIANTS[name], Path(span_dir))
                for name in settings.variants]
    report = build_report(settings, started_at, runs)
    (settings.out_dir / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    markdown = render_markdown(report)
    (settings.out_dir / "report.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    _log(f"report: {settings.out_dir / 'report.json'}, {settings.out_dir / 'report.md'}")
    router = report["router_overhead"] or {}
    return 1 if any(run["error"] for run in runs) or router.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
