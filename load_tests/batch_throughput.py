"""Batch throughput: the same batch through the app's Batch API and on the bare engine, in one run.

One seeded batch (--prompts prompts of --min/--max-prompt-tokens random token ids, --max-tokens output tokens each
with ignore_eos, so every line makes exactly that many tokens) is run three ways:

(a) bare engine, cold-lane settings: vLLM's offline `LLM.generate` with the serve config's cold-lane engine
    settings (app.lanes.engine.offline_generate), every prompt handed over at once;
(b) bare engine, hot-lane settings: the same with the hot lane's settings (the tuning guide expects the cold lane's
    throughput settings to give x3-5 the batch throughput);
(c) the app: `serve run` of the serve config (its batch store moved to a fresh file under --out, so no earlier job
    is drained along), the batch uploaded as JSONL (/v1/completions lines, prompt = token ids) through the `openai`
    SDK's Files API, a batch created and polled until it completes. Throughput = completion tokens in the output
    file / (batch create -> completed seen). Every custom_id must come back exactly once. While it runs, GET
    /v1/admin/stats is read once a second: the Router's batch window and the cold engine's running requests say how
    full the batch API keeps the engine.

(a) and (b) each run in a fresh Python process, so one engine's threads and memory are gone before the next phase
starts. Each phase warms up first (a few short generations; a small warm-up batch for (c)); warm-ups and engine
start-up are not timed. Start Ray / vLLM only under the machine's lock:

    flock /tmp/llm-lanes-ray.lock .venv/bin/python -m load_tests.batch_throughput \\
        --serve-config serve_configs/local.yaml --out load_tests/results/batch-throughput-cpu

Outputs in --out: report.json (settings, engine settings per run, results, ratios), report.md (the table),
prompts.json (the batch, token ids), the derived serve config, the batch input/output files and the logs of every
phase. Run it from the repository root, as `load_tests.run`.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import io
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from load_tests.overhead import app_url, llm_lanes_application
from load_tests.overlay import OverlayError, add_set_argument, load_serve_config
from load_tests.report import _num, _ratio
from load_tests.stats import percentile, ratio
from load_tests.serve_runner import (
    AppStartError,
    ServedApp,
    default_cleanup_commands,
    default_start_command,
    default_stop_commands,
)

BATCH_ENDPOINT = "/v1/completions"
# The target for the Batch API against the bare engine on the cold lane's settings, on CPU.
TARGET_BATCH_API_VS_BARE_ENGINE = 0.8
TERMINAL_BATCH_STATUSES = ("completed", "failed", "cancelled", "expired")
WARMUP_MAX_TOKENS = 8
# How often (c) reads GET /v1/admin/stats while the batch runs: often enough for a mean, rare enough not to load the
# Router it measures.
OCCUPANCY_INTERVAL_S = 1.0
# An offline phase is one engine start (~15-30 s on CPU) plus the batch; beyond this something is stuck.
OFFLINE_PHASE_TIMEOUT_S = 1800.0
RUN_TITLES = {
    "offline_cold": "(a) bare engine, cold-lane settings",
    "offline_hot": "(b) bare engine, hot-lane settings",
    "batch_api": "(c) Batch API through the app",
}


# --------------------------------------------------------------------------------------------------------------------
# The batch (pure)
# --------------------------------------------------------------------------------------------------------------------


def make_prompts(seed: int, count: int, min_tokens: int, max_tokens: int, token_ids: Sequence[int],
                 salt: str = "batch") -> list[list[int]]:
    """`count` prompts of token ids drawn from `token_ids` (the model's ordinary tokens), each min..max tokens long;
    the same for the same arguments. Random ids make no two prompts share a prefix block (no prefix-cache hits);
    `salt` keeps warm-up prompts apart from the measured ones."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"prompt lengths must satisfy 1 <= min <= max, got {min_tokens}..{max_tokens}")
    if not token_ids:
        raise ValueError("no token ids to draw prompts from")
    rng = random.Random(f"{seed}:{salt}")
    return [[rng.choice(token_ids) for _ in range(rng.randint(min_tokens, max_tokens))] for _ in range(count)]


def custom_id(index: int, prefix: str = "line") -> str:
    return f"{prefix}-{index}"


def batch_input_lines(prompts: list[list[int]], model: str, max_tokens: int, temperature: float,
                      id_prefix: str = "line") -> list[dict[str, Any]]:
    """One OpenAI batch line per prompt: a /v1/completions request with the token ids as prompt."""
    return [
        {"custom_id": custom_id(index, id_prefix), "method": "POST", "url": BATCH_ENDPOINT,
         "body": {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                  "temperature": temperature}}
        for index, prompt in enumerate(prompts)
    ]


def check_batch_output(output_lines: list[dict[str, Any]], expected_ids: Sequence[str],
                       max_tokens: int) -> dict[str, Any]:
    """Tally an output file: completion tokens, and whether every expected custom_id came back exactly once with a
    200 and exactly `max_tokens` tokens (ignore_eos)."""
    expected = set(expected_ids)
    seen: dict[str, int] = {}
    output_tokens = prompt_tokens = 0
    not_ok: list[str] = []
    short: list[str] = []
    for line in output_lines:
        line_id = line.get("custom_id")
        seen[line_id] = seen.get(line_id, 0) + 1
        response = line.get("response") or {}
        usage = (response.get("body") or {}).get("usage") or {}
        if response.get("status_code") != 200:
            not_ok.append(line_id)
            continue
        output_tokens += int(usage.get("completion_tokens", 0))
        prompt_tokens += int(usage.get("prompt_tokens", 0))
        if usage.get("completion_tokens") != max_tokens:
            short.append(line_id)
    missing = sorted(expected - set(seen))
    duplicated = sorted(i for i, n in seen.items() if n > 1)
    unexpected = sorted(str(i) for i in set(seen) - expected)
    return {
        "lines": len(output_lines),
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "missing": missing,
        "duplicated": duplicated,
        "unexpected": unexpected,
        "not_ok": sorted(str(i) for i in not_ok),
        "wrong_length": sorted(short),
        "each_id_once": not missing and not duplicated and not unexpected,
    }


def occupancy_sample(admin_stats: dict[str, Any]) -> dict[str, int | None]:
    """From GET /v1/admin/stats: the Router's batch window and the cold lane's running / waiting requests (summed
    over its replicas): how full the batch API keeps the engine."""
    cold = [entry for entry in (admin_stats.get("lanes") or {}).get("cold") or [] if "error" not in entry]
    router = admin_stats.get("router") or {}
    return {
        "batch_window": router.get("batch_window"),
        # Lines the Router's dispatcher had in flight (claimed, not yet recorded): the window is only the limit.
        "batch_in_flight": router.get("batch_in_flight"),
        "cold_running": sum(int(entry.get("running", 0)) for entry in cold),
        "cold_waiting": sum(int(entry.get("waiting", 0)) for entry in cold),
    }


def summarize_occupancy(samples: list[dict[str, int | None]]) -> dict[str, float | int | None]:
    def values(key: str) -> list[int]:
        return [sample[key] for sample in samples if sample.get(key) is not None]

    summary: dict[str, float | int | None] = {"samples": len(samples)}
    for key in ("batch_window", "batch_in_flight", "cold_running", "cold_waiting"):
        seen = values(key)
        summary[f"{key}_mean"] = sum(seen) / len(seen) if seen else None
        summary[f"{key}_max"] = max(seen) if seen else None
    return summary


# --------------------------------------------------------------------------------------------------------------------
# Report shaping (pure)
# --------------------------------------------------------------------------------------------------------------------


def tokens_per_s(output_tokens: int | None, seconds: float | None) -> float | None:
    if output_tokens is None or not seconds:
        return None
    return output_tokens / seconds


def settings_label(engine: dict[str, Any]) -> str:
    """The engine settings that differ between lanes, short enough for a table cell."""
    parts = [f"max_num_seqs {engine['max_num_seqs']}", f"max_num_batched_tokens {engine['max_num_batched_tokens']}"]
    if engine.get("cpu_threads_bind"):
        parts.append(f"cores {engine['cpu_threads_bind']}")
    if engine.get("cpu_engine_core_bind"):
        parts.append(f"engine core on {engine['cpu_engine_core_bind']}")
    if engine.get("cpu_frontend_bind"):
        parts.append(f"frontend on {engine['cpu_frontend_bind']}")
    return ", ".join(parts)


def shape_round(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One round: `runs` maps offline_cold / offline_hot / batch_api to a result with output_tokens and seconds (or
    error); adds tokens/s to each and the round's two ratios."""
    shaped = {}
    for name, run in runs.items():
        shaped[name] = {**run, "output_tokens_per_s": None if run.get("error") else
                        tokens_per_s(run.get("output_tokens"), run.get("seconds"))}
    rate = {name: run["output_tokens_per_s"] for name, run in shaped.items()}
    return {
        "runs": shaped,
        "ratios": {
            "batch_api_vs_offline_cold": ratio(rate.get("batch_api"), rate.get("offline_cold")),
            "offline_cold_vs_offline_hot": ratio(rate.get("offline_cold"), rate.get("offline_hot")),
        },
    }


def spread(values: list[float | None]) -> dict[str, float | int | None]:
    """Median, min and max of the rounds that produced a value. The median is what the report judges: the bare
    engine alone moved 2x between runs on this machine, so one round's ratio carries its own run's noise."""
    seen = sorted(v for v in values if v is not None)
    if not seen:
        return {"median": None, "min": None, "max": None, "rounds": 0}
    return {"median": percentile(seen, 50), "min": seen[0], "max": seen[-1], "rounds": len(seen)}


def build_report(settings: dict[str, Any], started_at: str, finished_at: str, machine: dict[str, Any],
                 engines: dict[str, dict[str, Any]], batch_window: dict[str, int],
                 rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """`rounds` holds one `runs` dict per round (see shape_round). Ratios are paired within a round, so a slow or
    fast minute of the machine moves both sides of a ratio; the report's ratios are the medians over rounds."""
    shaped = [shape_round(runs) for runs in rounds]
    ratios = {name: spread([round_["ratios"][name] for round_ in shaped])
              for name in ("batch_api_vs_offline_cold", "offline_cold_vs_offline_hot")}
    batch_vs_bare = ratios["batch_api_vs_offline_cold"]["median"]
    return {
        "started_at": started_at,
        "finished_at": finished_at,
        "machine": machine,
        "settings": settings,
        "engine_settings": engines,
        "batch_window": batch_window,
        "rounds": shaped,
        "ratios": {name: value["median"] for name, value in ratios.items()},
        "ratio_spread": ratios,
        "target": {
            "batch_api_vs_offline_cold_min": TARGET_BATCH_API_VS_BARE_ENGINE,
            "met": None if batch_vs_bare is None else batch_vs_bare >= TARGET_BATCH_API_VS_BARE_ENGINE,
        },
    }


def render_markdown(report: dict[str, Any]) -> str:
    settings, rounds, ratios = report["settings"], report["rounds"], report["ratios"]
    window = report["batch_window"]
    several = len(rounds) > 1
    lines = [
        "# Batch throughput: Batch API vs bare engine",
        "",
        f"Serve config `{settings['serve_config']}`, {settings['prompts']} prompts of "
        f"{settings['min_prompt_tokens']}-{settings['max_prompt_tokens']} random tokens (seed {settings['seed']}), "
        f"{settings['max_tokens']} output tokens each (ignore_eos, temperature {settings['temperature']}). "
        f"Started {report['started_at']} on {report['machine']['cpus']} CPUs"
        + (f"; {len(rounds)} rounds, each run in turn in every round." if several else "."),
        "",
        "| " + ("round | " if several else "") + "run | engine settings | requests | output tokens | seconds | "
        "output tokens/s |",
        "|---" * (7 if several else 6) + "|",
    ]
    for number, round_ in enumerate(rounds, start=1):
        lead = f"| {number} " if several else ""
        for name, title in RUN_TITLES.items():
            run = round_["runs"].get(name)
            if run is None:
                continue
            engine = settings_label(report["engine_settings"][run["engine"]])
            if name == "batch_api":
                engine += f"; Router window {window['window_min']}-{window['window_max']} in flight"
            if run.get("error"):
                lines.append(f"{lead}| {title} | {engine} | failed: {run['error']} | | | |")
                continue
            lines.append(f"{lead}| {title} | {engine} | {run['requests']} | {run['output_tokens']:,} | "
                         f"{_num(run['seconds'], 2)} | {_num(run['output_tokens_per_s'])} |")
    met = report["target"]["met"]
    verdict = "–" if met is None else ("met" if met else "not met")
    spreads = report["ratio_spread"]

    def each_round(name: str) -> str:
        if not several:
            return ""
        values = ", ".join(_ratio(round_["ratios"][name]) for round_ in rounds)
        return f"; median of {spreads[name]['rounds']} rounds, each round: {values}"

    lines += [
        "",
        f"- (c) ÷ (a), Batch API ÷ bare engine: **{_ratio(ratios['batch_api_vs_offline_cold'])}** "
        f"(target ≥ {report['target']['batch_api_vs_offline_cold_min']}: {verdict}"
        f"{each_round('batch_api_vs_offline_cold')})",
    ]
    if any("offline_hot" in round_["runs"] for round_ in rounds):
        lines.append(
            f"- (a) ÷ (b), cold-lane ÷ hot-lane engine settings: **{_ratio(ratios['offline_cold_vs_offline_hot'])}**"
            + (f" ({each_round('offline_cold_vs_offline_hot')[2:]})" if several else ""))
    for number, round_ in enumerate(rounds, start=1):
        batch = round_["runs"].get("batch_api") or {}
        prefix = f"Round {number}: " if several else ""
        check = batch.get("check")
        if check:
            lines.append(
                f"- {prefix}Batch output: {check['lines']} lines, every custom_id once: "
                f"{'yes' if check['each_id_once'] else 'NO'} (missing {len(check['missing'])}, duplicated "
                f"{len(check['duplicated'])}, not 200 {len(check['not_ok'])}, not {settings['max_tokens']} tokens "
                f"{len(check['wrong_length'])})")
        occupancy = batch.get("occupancy")
        if occupancy and occupancy["samples"]:
            lines.append(
                f"- {prefix}While (c) ran ({occupancy['samples']} samples of GET /v1/admin/stats): Router batch "
                f"window mean {_num(occupancy['batch_window_mean'])} (max {_num(occupancy['batch_window_max'])}), "
                + (f"lines in flight mean {_num(occupancy['batch_in_flight_mean'])}, "
                   if occupancy.get("batch_in_flight_mean") is not None else "") +
                f"cold engine running mean {_num(occupancy['cold_running_mean'])} "
                f"(max {_num(occupancy['cold_running_max'])}), waiting mean {_num(occupancy['cold_waiting_mean'])}")
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Settings:
    serve_config: str
    out_dir: Path
    prompts: int
    min_prompt_tokens: int
    max_prompt_tokens: int
    max_tokens: int
    temperature: float
    warmup_prompts: int
    seed: int
    poll_interval_s: float
    batch_timeout_s: float
    ready_timeout_s: float

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _log(message: str) -> None:
    print(f"[batch-throughput] {message}", file=sys.stderr, flush=True)


def app_config_of(serve_config: dict[str, Any]):
    from app.config import load_app_config

    return load_app_config(llm_lanes_application(serve_config).get("args") or {})


def ordinary_token_ids(tokenizer_source: str) -> list[int]:
    """The tokenizer's ids minus its added (special) tokens: what a prompt of ordinary text is made of."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    special = set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def with_batch_store(serve_config: dict[str, Any], store: str) -> dict[str, Any]:
    """A copy of the serve config whose app keeps batches in `store` (a fresh file: nothing queued before is drained
    along with the measured batch)."""
    derived = copy.deepcopy(serve_config)
    args = llm_lanes_application(derived).setdefault("args", {})
    args["batch"] = {**(args.get("batch") or {}), "store": store}
    return derived


def run_offline(settings: Settings, lane: str, config_path: Path, prompts_path: Path, run_dir: Path) -> dict[str, Any]:
    """Phase (a) or (b) in a fresh process (`--offline-lane`); its log goes to RUN_DIR/offline-<lane>.log."""
    result_path = run_dir / f"offline-{lane}.json"
    log_path = run_dir / f"offline-{lane}.log"
    result_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "load_tests.batch_throughput", "--offline-lane", lane,
               "--serve-config", str(config_path), "--prompts-file", str(prompts_path),
               "--result-file", str(result_path), "--max-tokens", str(settings.max_tokens),
               "--temperature", str(settings.temperature)]
    _log(f"offline {lane}: {' '.join(command[1:])} (log: {log_path})")
    with open(log_path, "wb") as log:
        try:
            completed = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=OFFLINE_PHASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"engine": lane, "error": f"timed out after {OFFLINE_PHASE_TIMEOUT_S:.0f} s"}
    if completed.returncode != 0 or not result_path.exists():
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:] or [""]
        return {"engine": lane, "error": f"exit {completed.returncode}: {tail[0][:200]}"}
    result = json.loads(result_path.read_text(encoding="utf-8"))
    _log(f"offline {lane}: {result['output_tokens']:,} tokens in {result['generate_s']:.2f} s "
         f"(engine start {result['engine_start_s']:.1f} s)")
    return {"engine": lane, "requests": result["requests"], "output_tokens": result["output_tokens"],
            "prompt_tokens": result["prompt_tokens"], "seconds": result["generate_s"],
            "engine_start_s": result["engine_start_s"]}


def offline_worker(args: argparse.Namespace) -> int:
    """Inside the fresh process: one offline_generate on the named lane's settings, result as JSON."""
    from app.lanes.engine import offline_generate

    cfg = app_config_of(load_serve_config(args.serve_config))
    batch = json.loads(Path(args.prompts_file).read_text(encoding="utf-8"))
    result = offline_generate(cfg, cfg.lane(args.offline_lane).engine, batch["prompts"], args.max_tokens,
                              temperature=args.temperature, warmup_prompts=batch["warmup_prompts"],
                              warmup_max_tokens=WARMUP_MAX_TOKENS)
    Path(args.result_file).write_text(json.dumps(result), encoding="utf-8")
    return 0


def submit_batch(client: Any, lines: list[dict[str, Any]], filename: str) -> tuple[Any, float]:
    """Upload the lines and create the batch; (batch, monotonic time just before the create call)."""
    payload = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=(filename, io.BytesIO(payload)), purpose="batch")
    created_at = time.perf_counter()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=BATCH_ENDPOINT, completion_window="24h")
    return batch, created_at


def wait_for_batch(client: Any, batch_id: str, poll_interval_s: float, timeout_s: float,
                   sample: Callable[[], None] | None = None) -> tuple[Any, float]:
    """Poll until the batch is in a terminal state; (batch, monotonic time it was first seen terminal). `sample` is
    called at most every OCCUPANCY_INTERVAL_S while waiting."""
    deadline = time.perf_counter() + timeout_s
    last_sample = float("-inf")
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in TERMINAL_BATCH_STATUSES:
            return batch, time.perf_counter()
        if time.perf_counter() > deadline:
            raise TimeoutError(f"batch {batch_id} still {batch.status} after {timeout_s:.0f} s: {batch.request_counts}")
        if sample is not None and time.perf_counter() - last_sample >= OCCUPANCY_INTERVAL_S:
            last_sample = time.perf_counter()
            sample()
        time.sleep(poll_interval_s)


def output_lines_of(client: Any, batch: Any) -> list[dict[str, Any]]:
    if not batch.output_file_id:
        return []
    return [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines() if line]


def run_batch_api(settings: Settings, config_path: Path, serve_config: dict[str, Any], model: str,
                  prompts: list[list[int]], warmup_prompts: list[list[int]], run_dir: Path) -> dict[str, Any]:
    """Phase (c): start the app, warm up with a small batch, then the measured batch; the app is stopped after."""
    import openai

    url = app_url(serve_config)
    result: dict[str, Any] = {"engine": "cold", "serve_config": str(config_path)}
    app = ServedApp(url, run_dir / "serve.log", default_start_command(str(config_path)),
                    stop_commands=default_stop_commands(), cleanup_commands=default_cleanup_commands(),
                    ready_timeout_s=settings.ready_timeout_s)
    _log(f"batch API: starting `serve run {config_path}` (log: {app.log_path})")
    try:
        app.start()
        result["ready_s"] = app.wait_ready()
        _log(f"batch API: ready after {result['ready_s']:.0f} s")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120.0)

        if warmup_prompts:
            warmup_lines = batch_input_lines(warmup_prompts, model, WARMUP_MAX_TOKENS, settings.temperature,
                                             id_prefix="warmup")
            warmup, _ = submit_batch(client, warmup_lines, "warmup.jsonl")
            warmup, _ = wait_for_batch(client, warmup.id, settings.poll_interval_s, settings.batch_timeout_s)
            _log(f"batch API: warm-up batch {warmup.status}")

        lines = batch_input_lines(prompts, model, settings.max_tokens, settings.temperature)
        (run_dir / "batch-input.jsonl").write_text(
            "".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
        batch, created = submit_batch(client, lines, "batch-throughput.jsonl")
        _log(f"batch API: created {batch.id} with {len(lines)} lines; polling every {settings.poll_interval_s} s")
        occupancy: list[dict[str, int | None]] = []

        def sample_occupancy() -> None:
            try:
                occupancy.append(occupancy_sample(httpx.get(f"{url}/v1/admin/stats", timeout=10).json()))
            except (httpx.HTTPError, ValueError):
                pass  # a missed sample only thins the mean

        batch, done = wait_for_batch(client, batch.id, settings.poll_interval_s, settings.batch_timeout_s,
                                     sample_occupancy)
        output = output_lines_of(client, batch)
        (run_dir / "batch-output.jsonl").write_text(
            "".join(json.dumps(line) + "\n" for line in output), encoding="utf-8")
        check = check_batch_output(output, [line["custom_id"] for line in lines], settings.max_tokens)
        result.update({
            "batch_id": batch.id,
            "status": batch.status,
            "request_counts": batch.request_counts.model_dump(),
            "requests": check["lines"],
            "output_tokens": check["output_tokens"],
            "prompt_tokens": check["prompt_tokens"],
            "seconds": done - created,
            # The store's own timestamps, for comparison with the client-side window above.
            "server_timestamps": {key: getattr(batch, key, None)
                                  for key in ("created_at", "in_progress_at", "finalizing_at", "completed_at")},
            "check": check,
            "occupancy": summarize_occupancy(occupancy),
        })
        if batch.status != "completed":
            result["error"] = f"batch ended {batch.status}: {batch.request_counts}"
        elif not check["each_id_once"]:
            result["error"] = (f"custom_ids not returned exactly once: missing {len(check['missing'])}, "
                               f"duplicated {len(check['duplicated'])}, unexpected {len(check['unexpected'])}")
        _log(f"batch API: {batch.status}, {check['output_tokens']:,} tokens in {done - created:.2f} s")
    except (AppStartError, TimeoutError, openai.OpenAIError) as error:
        _log(f"batch API: {error}")
        result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"[:300]
    finally:
        _log("batch API: shutting down")
        app.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.batch_throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-config", default="serve_configs/local.yaml",
                        help="serve config or overlay (load_tests/configs): its lanes' engine settings and the app "
                             "for (c)")
    add_set_argument(parser)
    parser.add_argument("--out", default="load_tests/results/batch-throughput-cpu",
                        help="directory for report.json, report.md, the batch files and logs")
    parser.add_argument("--prompts", type=int, default=192, help="lines in the batch")
    parser.add_argument("--min-prompt-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens per line (ignore_eos)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--warmup-prompts", type=int, default=4,
                        help=f"unmeasured {WARMUP_MAX_TOKENS}-token generations before each measurement")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--poll-interval", type=float, default=0.25, help="seconds between batch status polls")
    parser.add_argument("--batch-timeout", type=float, default=1800.0, help="seconds to wait for the batch")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait until the app and every lane answer")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run (a), (b) and (c) in turn this many times; the report's ratios are the medians of "
                             "the rounds' paired ratios (the machine's speed drifts between minutes)")
    parser.add_argument("--skip", action="append", choices=list(RUN_TITLES), default=[],
                        help="leave out a run (repeatable)")
    # Internal: one offline phase inside the fresh process the main run starts.
    parser.add_argument("--offline-lane", choices=("hot", "cold"), help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.offline_lane:
        return offline_worker(args)
    if args.prompts < 1 or args.max_tokens < 1 or args.warmup_prompts < 0 or args.rounds < 1:
        parser.error("--prompts, --max-tokens and --rounds must be >= 1, --warmup-prompts >= 0")
    if not 1 <= args.min_prompt_tokens <= args.max_prompt_tokens:
        parser.error("need 1 <= --min-prompt-tokens <= --max-prompt-tokens")

    try:
        base_config = load_serve_config(args.serve_config, args.set)
    except OverlayError as error:
        parser.error(str(error))
    described = args.serve_config + "".join(f" --set {s}" for s in args.set)
    settings = Settings(described, Path(args.out), args.prompts, args.min_prompt_tokens,
                        args.max_prompt_tokens, args.max_tokens, args.temperature, args.warmup_prompts, args.seed,
                        args.poll_interval, args.batch_timeout, args.ready_timeout)
    cfg = app_config_of(base_config)  # fails on a bad config before anything starts
    if cfg.cold_lane is None:
        parser.error(f"{settings.serve_config} has no cold lane (cold_lane: null): nothing to compare")
    settings.out_dir.mkdir(parents=True, exist_ok=True)

    token_ids = ordinary_token_ids(cfg.model.tokenizer_source)
    prompts = make_prompts(settings.seed, settings.prompts, settings.min_prompt_tokens, settings.max_prompt_tokens,
                           token_ids)
    warmup_prompts = make_prompts(settings.seed, settings.warmup_prompts, settings.min_prompt_tokens,
                                  settings.max_prompt_tokens, token_ids, salt="warmup")
    prompts_path = settings.out_dir / "prompts.json"
    prompts_path.write_text(json.dumps({"prompts": prompts, "warmup_prompts": warmup_prompts}), encoding="utf-8")

    started_at = _now()
    rounds: list[dict[str, dict[str, Any]]] = []
    for number in range(1, args.rounds + 1):
        # One round: every run in turn, each in fresh processes (the app is started and stopped within (c)).
        run_dir = settings.out_dir if args.rounds == 1 else settings.out_dir / f"round-{number}"
        run_dir.mkdir(parents=True, exist_ok=True)
        # A fresh store per round: nothing a failed round left queued is drained along with the next round's batch.
        for path in run_dir.glob("batches.sqlite3*"):
            path.unlink()
        derived = with_batch_store(base_config, str((run_dir / "batches.sqlite3").resolve()))
        config_path = run_dir / "serve-batch-throughput.yaml"
        config_path.write_text(yaml.safe_dump(derived, sort_keys=False), encoding="utf-8")
        if args.rounds > 1:
            _log(f"round {number} of {args.rounds} (files in {run_dir})")
        runs: dict[str, dict[str, Any]] = {}
        if "offline_cold" not in args.skip:
            runs["offline_cold"] = run_offline(settings, "cold", config_path, prompts_path, run_dir)
        if "offline_hot" not in args.skip:
            runs["offline_hot"] = run_offline(settings, "hot", config_path, prompts_path, run_dir)
        if "batch_api" not in args.skip:
            runs["batch_api"] = run_batch_api(settings, config_path, derived, cfg.model.served_name, prompts,
                                              warmup_prompts, run_dir)
        rounds.append(runs)

    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    engines = {lane: cfg.lane(lane).engine.model_dump() for lane in cfg.lane_names}
    window = {"window_min": cfg.batch.window_min, "window_max": cfg.batch.window_max}
    report = build_report({**settings.to_json(), "rounds": args.rounds}, started_at, _now(), machine, engines, window,
                          rounds)
    (settings.out_dir / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    markdown = render_markdown(report)
    (settings.out_dir / "report.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    _log(f"report: {settings.out_dir / 'report.json'}, {settings.out_dir / 'report.md'}")
    return 1 if any(run.get("error") for runs in rounds for run in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
