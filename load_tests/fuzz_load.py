"""The fuzz corpus under load: a request that is a 4xx when the app is idle is the same 4xx while the hot lane is full,
never a 429 (a client told 429 retries what will never work).

    python -m load_tests.fuzz_load --serve-config serve_configs/local.yaml --out load_tests/results/fuzz-load

The corpus is tests/hostile_requests.py's, the bodies tests/integration/test_bad_input.py sends: `--hostile`
generated hostile chat and completion bodies and `--edges` bodies at the engine's edges. Phases on one app:
  idle  the corpus, `--concurrency` requests at a time, nothing else running;
  fill  `--streams` interactive streaming clients (closed loop, `--max-tokens` each, one client process, waiting the
        Retry-After of a refusal) until the answering Router's hot slots are all taken (`/v1/admin/stats`);
  load  the corpus again while they run.
Each request's status is read from its answer's status line (a stream is closed after it). The report gives the
statuses of both passes, the requests that were a 4xx other than 429 idle and a 429 under load (the target: none),
any other change of status class, and the 5xx of either pass. The app is started and stopped here (`serve run` of
the config with `--set` overrides), as load_tests.overload does.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml

FILL_TIMEOUT_S = 120.0


def _log(message: str) -> None:
    print(f"[fuzz-load {dt.datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def corpus(hostile: int, edges: int) -> list[tuple[str, bytes]]:
    """(path, raw body) of the fuzz corpus: the same requests for the same counts, every run."""
    from tests.hostile_requests import edge_requests, generated, requests_

    return generated(requests_(), hostile) + generated(edge_requests(), edges)


async def send_corpus(url: str, requests: list[tuple[str, bytes]], concurrency: int) -> list[int]:
    """Each request's HTTP status, in the corpus's order (0: no answer)."""
    gate = asyncio.Semaphore(concurrency)
    statuses = [0] * len(requests)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=30.0)) as client:

        async def one(index: int, path: str, body: bytes) -> None:
            async with gate:
                try:
                    async with client.stream("POST", url + path, content=body,
                                             headers={"content-type": "application/json"}) as response:
                        statuses[index] = response.status_code
                except httpx.HTTPError:
                    statuses[index] = 0

        await asyncio.gather(*(one(i, path, body) for i, (path, body) in enumerate(requests)))
    return statuses


def hot_slots_full(url: str) -> bool:
    from load_tests.overload import stats_view

    try:
        view = stats_view(httpx.get(url + "/v1/admin/stats", timeout=10).json())
    except (httpx.HTTPError, ValueError):
        return False
    slots = (view or {}).get("hot_slots")
    return bool(slots) and slots["limit"] > 0 and slots["in_flight"] >= slots["limit"]


def compare(idle: list[int], loaded: list[int]) -> dict[str, Any]:
    """The statuses of both passes and what changed between them."""
    pairs = list(zip(idle, loaded))
    client_error_then_429 = sum(1 for a, b in pairs if 400 <= a < 500 and a != 429 and b == 429)
    other_changes = Counter(f"{a}->{b}" for a, b in pairs
                            if a // 100 != b // 100 and not (a == 200 and b == 429)
                            and not (400 <= a < 500 and b == 429))
    return {
        "requests": len(pairs),
        "idle": dict(sorted(Counter(str(s) for s in idle).items())),
        "loaded": dict(sorted(Counter(str(s) for s in loaded).items())),
        "client_error_idle_429_loaded": client_error_then_429,
        "ok_idle_429_loaded": sum(1 for a, b in pairs if a == 200 and b == 429),
        "other_changes": dict(sorted(other_changes.items())),
        "server_errors": {"idle": sum(1 for s in idle if s >= 500 or s == 0),
                          "loaded": sum(1 for s in loaded if s >= 500 or s == 0)},
    }


def render_markdown(report: dict[str, Any]) -> str:
    result, settings = report["result"], report["settings"]
    return "\n".join([
        f"# The fuzz corpus under load: `{settings['serve_config']}`", "",
        f"{result['requests']} requests (tests/hostile_requests.py: {settings['hostile']} hostile, {settings['edges']} "
        f"at the engine's edges), sent idle and again while {settings['streams']} interactive streams filled the "
        f"hot lane (the answering Router's hot slots all taken as the second pass began: "
        f"{'yes' if report['slots_full_before'] else 'no'}; as it ended: "
        f"{'yes' if report['slots_full_after'] else 'no'}).", "",
        "| pass | statuses |", "|---|---|",
        f"| idle | {', '.join(f'{k}: {v}' for k, v in result['idle'].items())} |",
        f"| under load | {', '.join(f'{k}: {v}' for k, v in result['loaded'].items())} |", "",
        f"- a 4xx other than 429 idle, a 429 under load: **{result['client_error_idle_429_loaded']}**",
        f"- a 200 idle, a 429 under load (refused for the load, as it should be): {result['ok_idle_429_loaded']}",
        f"- other changes of status class: {result['other_changes'] or 'none'}",
        f"- 5xx or no answer: idle {result['server_errors']['idle']}, under load {result['server_errors']['loaded']}",
        ""])


def measure(url: str, args: argparse.Namespace, model: str, out: Path) -> dict[str, Any]:
    from load_tests.overload import burst_scenarios, run_clients

    requests = corpus(args.hostile, args.edges)
    _log(f"idle: {len(requests)} requests")
    idle = asyncio.run(send_corpus(url, requests, args.concurrency))
    duration_s = args.fill_s
    fill = burst_scenarios(model, args.streams, 0, 1, duration_s, args.max_tokens,
                           {"dist": "uniform", "min": 48, "max": 80}, 0, 300.0)
    _log(f"fill: {args.streams} interactive streams for up to {duration_s:g} s")
    clients = threading.Thread(target=run_clients, args=(fill, url, out / "clients", "fill"), daemon=True)
    clients.start()
    deadline = time.monotonic() + FILL_TIMEOUT_S
    while not hot_slots_full(url) and time.monotonic() < deadline:
        time.sleep(0.5)
    slots_full_before = hot_slots_full(url)
    _log(f"load: the corpus again (hot slots full: {slots_full_before})")
    loaded = asyncio.run(send_corpus(url, requests, args.concurrency))
    slots_full_after = hot_slots_full(url)
    clients.join()
    return {"settings": {"serve_config": args.serve_config, "hostile": args.hostile, "edges": args.edges,
                         "streams": args.streams, "max_tokens": args.max_tokens, "concurrency": args.concurrency},
            "slots_full_before": slots_full_before, "slots_full_after": slots_full_after,
            "result": compare(idle, loaded),
            "requests": [{"path": path, "idle": a, "loaded": b, "body": body.decode("utf-8", "replace")[:300]}
                         for (path, body), a, b in zip(requests, idle, loaded) if a != b]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the app's args (dotted path without `args.`, YAML value)")
    parser.add_argument("--hostile", type=int, default=600, help="generated hostile bodies")
    parser.add_argument("--edges", type=int, default=150, help="generated bodies at the engine's edges")
    parser.add_argument("--streams", type=int, default=60, help="interactive streams filling the hot lane")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens of each filling stream")
    parser.add_argument("--fill-s", type=float, default=90.0, help="seconds the filling streams run")
    parser.add_argument("--concurrency", type=int, default=8, help="corpus requests in flight at once")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)

    from load_tests.chaos import served_model
    from load_tests.overload import derived_config
    from load_tests.serve_runner import serve_and_run

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    document = derived_config(yaml.safe_load(Path(args.serve_config).read_text(encoding="utf-8")), args.overrides,
                              out)
    model = served_model(document)
    report = serve_and_run(document, Path(args.serve_config).name, out, args.ready_timeout,
                           lambda url: measure(url, args, model, out), _log)
    (out / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    (out / "report.md").write_text(render_markdown(report), encoding="utf-8")
    print((out / "report.md").read_text(encoding="utf-8"))
    result = report["result"]
    return 1 if result["client_error_idle_429_loaded"] or result["server_errors"]["loaded"] else 0


if __name__ == "__main__":
    sys.exit(main())
