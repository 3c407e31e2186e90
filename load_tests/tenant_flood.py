"""Fair share between tenants, measured: one tenant's flood of the hot lane and another tenant's interactive TTFT.

Tenant A floods the hot lane past its slots, so a line of A's requests waits in every Router; tenant B sends short
streamed requests one after another and its time to the first token is measured in three phases that take turns:
B alone, A inside its share (as many requests at once as A may hold, no line), and A's flood. The Routers' turns
and the slot a flooding tenant leaves free (app/router/hot_slots.py) are what keep B out of A's line: B under the
flood should be about B beside A inside its share, not a line's wait (about a second on the CPU default) slower.
The mechanism itself is tested in tests/integration/test_security.py; this measures what it buys.

    # Start the app under the config (the overlay below gives it two Routers and room for the line), measure, stop
    .venv/bin/python -m load_tests.tenant_flood --serve-config load_tests/configs/tenant-flood.yaml \\
        --out load_tests/results/tenant-flood
    # Or an app already running with keys: A's, B's and an admin key in the environment
    TENANT_FLOOD_KEY_A=... TENANT_FLOOD_KEY_B=... TENANT_FLOOD_KEY_ADMIN=... .venv/bin/python -m \\
        load_tests.tenant_flood --url http://127.0.0.1:8000 --model tiny-llama --out load_tests/results/tenant-flood

Started from a config, the app gets three API keys made for the run (tenants team-a, team-b and an admin key),
hashed into the served copy of the config. Outputs in --out: report.json, report.md, serve.log.

Each tenant is its own client, as in production: A's load runs in a process of its own (`python -m
load_tests.tenant_flood flood URL MODEL CONCURRENCY MAX_TOKENS`, key in FLOOD_API_KEY), so its threads do not take
the measuring client's CPU, and B keeps one connection pool for all its requests.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from load_tests import host

PROMPT = "tell me a story " * 8
KEY_ENV = {"a": "TENANT_FLOOD_KEY_A", "b": "TENANT_FLOOD_KEY_B", "admin": "TENANT_FLOOD_KEY_ADMIN"}
AUTOGROUP_WORDS = {True: "on", False: "off"}  # host.autogroup_enabled(); None: no such switch


# ---- A's flood, in a process of its own -----------------------------------------------------------------------------

async def flood(url: str, model: str, key: str, concurrency: int, max_tokens: int) -> dict:
    """`concurrency` completions always in flight until stdin closes; the answers' status counts, under "lanes" how
    many each lane served, under "cpu_s" the CPU seconds the flood's own client took."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    # stdin closing (the caller's signal, or the caller gone) stops the flood.
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


def start_flood(url: str, model: str, key: str, concurrency: int, max_tokens: int) -> subprocess.Popen:
    """A's flood as a process of its own; close its stdin (communicate("")) to stop it and read its JSON line."""
    return subprocess.Popen(
        [sys.executable, "-m", "load_tests.tenant_flood", "flood", url, model, str(concurrency), str(max_tokens)],
        env={**os.environ, "FLOOD_API_KEY": key}, cwd=Path(__file__).resolve().parents[1], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, start_new_session=True)


def stop_flood(process: subprocess.Popen) -> dict:
    return json.loads(process.communicate("", timeout=180)[0])


# ---- B's measurement ------------------------------------------------------------------------------------------------

def ttft_s(client: httpx.Client, url: str, model: str) -> tuple[float, str]:
    """Time to the first streamed token of one short interactive request of B's, and its lane (with any degrade)."""
    started = time.monotonic()
    with client.stream("POST", f"{url}/v1/completions", timeout=120,
                       json={"model": model, "prompt": "a short question", "max_tokens": 4, "stream": True}) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"B's request was answered {answer.status_code}: {answer.read()[:300]!r}")
        lane = f"{answer.headers['x-llm-lanes-lane']}:{answer.headers.get('x-llm-lanes-degraded', '')}"
        for line in answer.iter_lines():
            if line.startswith("data: ") and '"text": ""' not in line:
                return time.monotonic() - started, lane
    raise RuntimeError("no token came")


def measure(url: str, model: str, keys: dict[str, str], *, turns: int, samples: int, flood_concurrency: int,
            in_share_concurrency: int, max_tokens: int, settle_s: float) -> dict[str, Any]:
    """The phases, `turns` times (the two loaded phases in alternating order: B under load got slower from one load
    to the next within a run); each phase's figures over all its turns."""
    # A first flood, not measured: the app has then seen such a load (on a freshly started app B's TTFT under the
    # flood was 70-78 ms, after other traffic 43-59 ms).
    warmup = start_flood(url, model, keys["a"], flood_concurrency, max_tokens)
    time.sleep(settle_s)
    stop_flood(warmup)
    phases: dict[str, list[float]] = {"alone": [], "in_share": [], "flood": []}
    answers: dict[str, list[dict]] = {"in_share": [], "flood": []}
    lanes: Counter[str] = Counter()
    hot_slots: list[dict] = []
    with httpx.Client(headers={"Authorization": f"Bearer {keys['b']}"}) as client_b:
        ttft_s(client_b, url, model)  # B's connection is open before anything is timed
        for turn in range(turns):
            phases["alone"] += [ttft_s(client_b, url, model)[0] for _ in range(samples)]
            loads = (("in_share", in_share_concurrency), ("flood", flood_concurrency))
            for phase, concurrency in (loads if turn % 2 == 0 else loads[::-1]):
                load = start_flood(url, model, keys["a"], concurrency, max_tokens)
                try:
                    # B is measured once A's load runs steadily (in its first seconds B's TTFT was 200-300 ms: the
                    # connections opening, the hot engine's first batches).
                    time.sleep(settle_s)
                    for _ in range(samples):
                        seconds, lane = ttft_s(client_b, url, model)
                        phases[phase].append(seconds)
                        lanes[f"{phase} {lane}"] += 1
                    if phase == "flood":
                        # Where A's requests waited: each read is one Router's view (the proxy picks the Router).
                        hot_slots += [httpx.get(f"{url}/v1/admin/stats", timeout=60, headers={
                            "Authorization": f"Bearer {keys['admin']}"}).json()["router"]["hot_slots"]
                            for _ in range(2)]
                finally:
                    answers[phase].append(stop_flood(load))

    def ms(values: list[float], q: float) -> float:
        return round(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] * 1000, 1)

    summary = {phase: {"count": len(values), "p50_ms": ms(values, 50), "p90_ms": ms(values, 90),
                       "per_turn_p50_ms": [round(statistics.median(values[i:i + samples]) * 1000, 1)
                                           for i in range(0, len(values), samples)]}
               for phase, values in phases.items()}
    return {
        "url": url, "model": model, "turns": turns, "samples_per_turn": samples,
        "flood_concurrency": flood_concurrency, "in_share_concurrency": in_share_concurrency,
        "max_tokens": max_tokens, "phases": summary,
        "ratios": {"flood_vs_in_share_p50": round(summary["flood"]["p50_ms"] / summary["in_share"]["p50_ms"], 2),
                   "flood_vs_alone_p50": round(summary["flood"]["p50_ms"] / summary["alone"]["p50_ms"], 2)},
        "b_lanes": dict(lanes), "a_answers": answers, "hot_slots_during_flood": hot_slots,
        "autogroup": host.autogroup_enabled(),
    }


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Tenant flood: B's interactive TTFT beside A's flood",
        "",
        f"A's flood: {report['flood_concurrency']} requests at once ({report['max_tokens']} tokens each); A inside "
        f"its share: {report['in_share_concurrency']}. {report['turns']} turns of {report['samples_per_turn']} B "
        f"requests per phase. Kernel autogroup scheduling: {AUTOGROUP_WORDS.get(report['autogroup'], 'unknown')}.",
        "",
        "| phase | B requests | TTFT p50 ms | TTFT p90 ms | p50 per turn ms |",
        "|---|---|---|---|---|",
    ]
    for phase, figures in report["phases"].items():
        lines.append(f"| {phase} | {figures['count']} | {figures['p50_ms']} | {figures['p90_ms']} | "
                     f"{', '.join(map(str, figures['per_turn_p50_ms']))} |")
    ratios = report["ratios"]
    lines += ["", f"TTFT p50 during A's flood ÷ A inside its share: **{ratios['flood_vs_in_share_p50']}×**; "
                  f"÷ B alone: {ratios['flood_vs_alone_p50']}×.", "",
              f"B's lanes: {report['b_lanes']}. A's answers per load: {report['a_answers']}.", ""]
    return "\n".join(lines)


# ---- the run --------------------------------------------------------------------------------------------------------

def served_config(path: str, keys: dict[str, str], out: Path) -> tuple[dict[str, Any], str]:
    """The config to serve (overlays merged), with the run's keys and the batch store in `out`; its model name."""
    from app.router.auth import hash_key
    from load_tests.overlay import llm_lanes_application, load_serve_config

    document = load_serve_config(path)
    args = llm_lanes_application(document).setdefault("args", {})
    args["auth"] = {"mode": "keys", "keys": [
        {"sha256": hash_key(keys["a"]), "tenant": "team-a"},
        {"sha256": hash_key(keys["b"]), "tenant": "team-b"},
        {"sha256": hash_key(keys["admin"]), "tenant": "ops", "admin": True}]}
    args["batch"] = {**(args.get("batch") or {}), "store": str((out / "batches.sqlite3").resolve())}
    return document, (args.get("model") or {}).get("served_name") or "tiny-llama"


def _log(message: str) -> None:
    print(f"[tenant_flood {dt.datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["flood"]:
        url, model, concurrency, max_tokens = argv[1], argv[2], int(argv[3]), int(argv[4])
        print(json.dumps(asyncio.run(flood(url, model, os.environ["FLOOD_API_KEY"], concurrency, max_tokens))))
        return 0
    parser = argparse.ArgumentParser(prog="python -m load_tests.tenant_flood", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--serve-config", help="serve config or overlay to start (keys are added for the run)")
    where.add_argument("--url", help="an app already running, with keys in " + ", ".join(KEY_ENV.values()))
    parser.add_argument("--model", default="tiny-llama", help="the served model name (with --url)")
    parser.add_argument("--out", required=True, help="directory for report.json, report.md, serve.log")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--samples", type=int, default=12, help="B's requests per phase and turn")
    parser.add_argument("--flood", type=int, default=12, help="A's requests at once during the flood")
    parser.add_argument("--in-share", type=int, default=6, help="A's requests at once inside its share")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per answer of A's")
    parser.add_argument("--settle-s", type=float, default=8.0, help="seconds of A's load before B is measured")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options = dict(turns=args.turns, samples=args.samples, flood_concurrency=args.flood,
                   in_share_concurrency=args.in_share, max_tokens=args.max_tokens, settle_s=args.settle_s)
    if args.url:
        missing = [name for name in KEY_ENV.values() if not os.environ.get(name)]
        if missing:
            parser.error(f"--url needs the keys in {', '.join(missing)}")
        keys = {tenant: os.environ[name] for tenant, name in KEY_ENV.items()}
        report = measure(args.url.rstrip("/"), args.model, keys, **options)
    else:
        from load_tests.serve_runner import AppStartError, serve_and_run

        keys = {tenant: f"sk-tenant-flood-{tenant}-{secrets.token_hex(8)}" for tenant in KEY_ENV}
        document, model = served_config(args.serve_config, keys, out)
        try:
            report = serve_and_run(document, Path(args.serve_config).name, out, args.ready_timeout,
                                   lambda url: measure(url, model, keys, **options), _log,
                                   headers={"Authorization": f"Bearer {keys['admin']}"})
        except AppStartError as error:
            print(error, file=sys.stderr)
            return 1
        report["serve_config"] = args.serve_config
    (out / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    markdown = render_markdown(report)
    (out / "report.md").write_text(markdown, encoding="utf-8")
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
