"""Chaos: mixed load on one running app while each deployment's replica is killed (SIGKILL) in turn. What does each
kill cost each request class, how long until the deployment serves again, and is the batch exact?

    python -m load_tests.chaos --serve-config serve_configs/local.yaml --out load_tests/results/chaos

Load, from the start to the end: `--interactive` closed-loop interactive streams (chat, streamed), `--flex`
closed-loop flex completions (`service_tier: "flex"`, not streamed) and one Batch API batch of `--batch-lines` lines
(submitted once the load runs; `--batch-lines 0`: none). Kills, in `--kill` order (default Router, HotLane,
ColdLane, PrefixCache): the deployment's replica process gets SIGKILL (`kill -9` of the pid the Serve API reports),
and for a lane its vLLM engine processes with it (the process tree under the replica named `VLLM::*`), as when a
host's OOM killer or a node agent takes the whole lane. After each kill the tool waits until the deployment has a
new RUNNING replica and a request sent after the kill was served through it (`--recover-timeout`), then `--settle`
seconds before the next kill.

Per kill the report gives: the time to the replacement replica (RUNNING in Serve's API) and to the first 200 served
through the deployment after the kill (for a lane, one carrying a new replica's `x-llm-lanes-replica`; for the Router
and the PrefixCache, any request sent after the kill), and the failed requests by class and error (HTTP status, or
`stream` / `transport` / `timeout`) from that kill to the next. Then the batch: its counts and whether every
`custom_id` came back exactly once. Outputs in `--out`: report.json (settings, kills, every request's record),
report.md, the derived serve config and the `serve run` log. With `--url` the app already running there is used
(its dashboard at `--dashboard`); otherwise `serve run` of a derived copy of the config (`--set` overrides, the
batch store under `--out`), stopped afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from load_tests.client import RequestRecord, RequestSpec, send, words
from load_tests.stats import distribution_ms

DEFAULT_DASHBOARD = "http://127.0.0.1:8265"
APP_NAME = "llm-lanes"
DEPLOYMENTS = ("Router", "HotLane", "ColdLane", "PrefixCache")
LANES = {"HotLane": "hot", "ColdLane": "cold"}
LANE_HEADER = "x-llm-lanes-lane"
REPLICA_HEADER = "x-llm-lanes-replica"
DEGRADED_HEADER = "x-llm-lanes-degraded"
TALLY_HEADERS = [LANE_HEADER, REPLICA_HEADER, DEGRADED_HEADER]
CLASSES = ("interactive", "batch")  # batch = the flex completions (service_tier flex)


def _log(message: str) -> None:
    tool = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "chaos"
    print(f"[{tool} {dt.datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------------------
# The app's replicas (Ray Serve's REST API on the dashboard)
# --------------------------------------------------------------------------------------------------------------------


def serve_replicas(dashboard: str, app: str = APP_NAME) -> dict[str, list[dict[str, Any]]]:
    """deployment -> its replicas (replica_id, state, pid, node_id...); {} while the API answers nothing usable."""
    try:
        body = httpx.get(f"{dashboard}/api/serve/applications/", timeout=10).json()
        return {name: d.get("replicas") or [] for name, d in body["applications"][app]["deployments"].items()}
    except (httpx.HTTPError, KeyError, ValueError, TypeError):
        return {}


def proxy_pids(proc: Path = Path("/proc")) -> list[int]:
    """Serve's HTTP proxies on this host (their process title, `ray::ProxyActor`; Serve's API gives no pid for
    them)."""
    pids = []
    for entry in os.listdir(proc):
        try:
            if entry.isdigit() and (proc / entry / "cmdline").read_bytes().startswith(b"ray::ProxyActor"):
                pids.append(int(entry))
        except OSError:
            continue
    return sorted(pids)


def running(replicas: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in replicas if r.get("state") == "RUNNING"]


# --------------------------------------------------------------------------------------------------------------------
# Processes (/proc)
# --------------------------------------------------------------------------------------------------------------------


def children_table(proc: Path = Path("/proc")) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, name) of every process."""
    table = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            stat = (proc / entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        table[int(entry)] = (int(stat[stat.rindex(")") + 2:].split()[1]), name)
    return table


def engine_processes(table: dict[int, tuple[int, str]], replica_pid: int) -> list[int]:
    """The vLLM engine processes (`VLLM::*`) anywhere under the replica's process."""
    under, frontier = [], [replica_pid]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _name) in table.items():
            if ppid == parent:
                under.append(pid)
                frontier.append(pid)
    return sorted(pid for pid in under if table[pid][1].startswith("VLLM::"))


def kill_replica(dashboard: str, deployment: str) -> dict[str, Any]:
    """SIGKILL the deployment's (first RUNNING) replica, with its engine processes for a lane: what was killed."""
    replicas = running(serve_replicas(dashboard).get(deployment, []))
    if not replicas:
        raise RuntimeError(f"{deployment} has no RUNNING replica to kill")
    victim = sorted(replicas, key=lambda r: r["replica_id"])[0]
    pid = int(victim["pid"])
    engines = engine_processes(children_table(), pid) if deployment in LANES else []
    for target in [pid, *engines]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # The kill's moment is after the signals, not before the look-up: a request sent during the look-up (~0.1-1 s on
    # a busy host) can still be answered by the old replica and must not count as served after the kill.
    return {"replica_id": victim["replica_id"], "pid": pid, "engine_pids": engines,
            "replicas_before": [r["replica_id"] for r in replicas], "killed_perf": time.perf_counter()}


# --------------------------------------------------------------------------------------------------------------------
# Mixed load
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class MixedLoad:
    """Closed-loop interactive streams and flex completions against `url` until `stop` is set; every record kept,
    its start relative to `origin` (perf_counter)."""

    url: str
    model: str
    interactive: int = 2
    flex: int = 2
    interactive_tokens: int = 64
    flex_tokens: int = 64
    timeout_s: float = 300.0
    origin: float = field(default_factory=time.perf_counter)
    records: list[RequestRecord] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def spec(self, kind: str, index: int) -> RequestSpec:
        if kind == "interactive":
            return RequestSpec("interactive", "interactive", index, "chat", True, {
                "model": self.model, "messages": [{"role": "user", "content": f"request {index} " + words(
                    _rng(index), 32)}], "max_tokens": self.interactive_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}})
        return RequestSpec("flex", "batch", index, "completions", False, {
            "model": self.model, "prompt": f"request {index} " + words(_rng(index), 48),
            "max_tokens": self.flex_tokens, "ignore_eos": True, "service_tier": "flex"})

    async def _worker(self, client: httpx.AsyncClient, kind: str, worker: int) -> None:
        index = 0
        while not self.stop.is_set():
            record = await send(client, self.spec(kind, worker * 1_000_000 + index), self.origin, TALLY_HEADERS,
                                self.timeout_s)
            self.records.append(record)
            index += 1
            if not record.ok:
                await asyncio.sleep(0.5)  # a failure is counted, not hammered on

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(self.timeout_s, connect=30)) as client:
            await asyncio.gather(*[self._worker(client, "interactive", i) for i in range(self.interactive)],
                                 *[self._worker(client, "flex", self.interactive + i) for i in range(self.flex)])

    def now_s(self) -> float:
        return time.perf_counter() - self.origin

    def start_thread(self) -> threading.Thread:
        thread = threading.Thread(target=lambda: asyncio.run(self.run()), daemon=True)
        thread.start()
        return thread


def _rng(index: int) -> random.Random:
    return random.Random(index)


# --------------------------------------------------------------------------------------------------------------------
# The Batch API
# --------------------------------------------------------------------------------------------------------------------


def batch_input(model: str, lines: int, max_tokens: int) -> bytes:
    return "\n".join(json.dumps({
        "custom_id": f"chaos-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": max_tokens,
                 "ignore_eos": True}}) for i in range(lines)).encode()


def submit_batch(url: str, model: str, lines: int, max_tokens: int) -> str:
    with httpx.Client(base_url=url, timeout=60) as client:
        uploaded = client.post("/v1/files", data={"purpose": "batch"},
                               files={"file": ("chaos.jsonl", batch_input(model, lines, max_tokens))})
        uploaded.raise_for_status()
        batch = client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                                 "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        batch.raise_for_status()
        return batch.json()["id"]


def batch_state(url: str, batch_id: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/batches/{batch_id}", timeout=30).json()


def batch_output_ids(url: str, batch: dict[str, Any]) -> list[str]:
    ids = []
    for file_key in ("output_file_id", "error_file_id"):
        if batch.get(file_key):
            text = httpx.get(f"{url}/v1/files/{batch[file_key]}/content", timeout=60).text
            ids += [json.loads(line)["custom_id"] for line in text.splitlines() if line.strip()]
    return ids


def batch_exactness(expected: int, custom_ids: Sequence[str], prefix: str = "chaos-") -> dict[str, Any]:
    """Every expected custom_id back exactly once? Lost, duplicated and unexpected ids."""
    counts = Counter(custom_ids)
    wanted = {f"{prefix}{i}" for i in range(expected)}
    lost = sorted(wanted - set(counts))
    duplicated = sorted(cid for cid, n in counts.items() if n > 1)
    unexpected = sorted(set(counts) - wanted)
    return {"expected": expected, "returned": len(custom_ids), "lost": len(lost), "duplicated": len(duplicated),
            "unexpected": len(unexpected), "exact": not (lost or duplicated or unexpected),
            "examples": {"lost": lost[:5], "duplicated": duplicated[:5], "unexpected": unexpected[:5]}}


# --------------------------------------------------------------------------------------------------------------------
# Recovery and errors (pure: over records and kill times)
# --------------------------------------------------------------------------------------------------------------------


def served_through(deployment: str, new_replicas: set[str]) -> Callable[[RequestRecord], bool]:
    """Whether a successful request went through the deployment's replacement: for a lane, its replica header names
    a replica that was not there before the kill; the Router and the PrefixCache are on every request's path."""
    if deployment not in LANES:
        return lambda record: True

    def through(record: RequestRecord) -> bool:
        replica = record.headers.get(REPLICA_HEADER, "")
        return record.headers.get(LANE_HEADER) == LANES[deployment] and replica.split("#")[-1] in new_replicas

    return through


def first_success_s(records: Iterable[RequestRecord], killed_s: float,
                    through: Callable[[RequestRecord], bool]) -> float | None:
    """Seconds from the kill to the end of the first successful request sent after it that `through` accepts."""
    ends = [r.end_s for r in records if r.ok and r.start_s >= killed_s and r.end_s is not None and through(r)]
    return round(min(ends) - killed_s, 2) if ends else None


def errors_by_class(records: Iterable[RequestRecord], start_s: float, end_s: float | None) -> dict[str, dict[str, int]]:
    """class -> error key -> count, for requests that ended in [start_s, end_s) (end_s None: to the end)."""
    errors: dict[str, Counter] = {c: Counter() for c in CLASSES}
    for record in records:
        end = record.end_s if record.end_s is not None else record.start_s
        if record.ok or end < start_s or (end_s is not None and end >= end_s):
            continue
        errors.setdefault(record.request_class, Counter())[record.error_key or "unknown"] += 1
    return {cls: dict(counter) for cls, counter in errors.items()}


def interactive_while_down(records: Iterable[RequestRecord], killed_s: float,
                           replaced_s: float | None) -> dict[str, Any]:
    """The interactive requests sent from the kill until the replacement was RUNNING (`replaced_s` after the kill;
    None: never, to the end): how many were answered, their TTFT, and the lanes (and degrade reasons) that served
    them; and the streams under way at the kill that still finished."""
    end = killed_s + replaced_s if replaced_s is not None else float("inf")
    mine = [r for r in records if r.request_class == "interactive"]
    sent = [r for r in mine if killed_s <= r.start_s < end]
    answered = [r for r in sent if r.ok]
    across = [r for r in mine if r.start_s < killed_s and r.end_s is not None and r.end_s > killed_s]
    served_on = Counter(f"{r.headers.get(LANE_HEADER, '?')}"
                        + (f" ({r.headers[DEGRADED_HEADER]})" if r.headers.get(DEGRADED_HEADER) else "")
                        for r in answered)
    return {"sent": len(sent), "answered": len(answered),
            "answered_share": round(len(answered) / len(sent), 4) if sent else None,
            "ttft_ms": distribution_ms(r.ttft_s for r in answered if r.ttft_s is not None),
            "served_on": dict(served_on),
            "under_way_at_kill": len(across), "under_way_finished": sum(r.ok for r in across)}


def back_on_lane_s(records: Iterable[RequestRecord], killed_s: float, replaced_s: float | None,
                   lane: str = "hot") -> float | None:
    """Seconds from the replacement's RUNNING to the first interactive request sent since that `lane` answered: how
    soon interactive work goes back to its lane once it has a replica again (negative: one was sent a moment before
    RUNNING was read and answered there). None without a replacement or without such an answer."""
    if replaced_s is None:
        return None
    running_at = killed_s + replaced_s
    back = [r.start_s for r in records if r.request_class == "interactive" and r.ok and r.start_s >= killed_s
            and r.headers.get(LANE_HEADER) == lane and not r.headers.get(DEGRADED_HEADER)
            and r.start_s >= running_at - 1.0]
    return round(min(back) - running_at, 2) if back else None


def class_summary(records: Sequence[RequestRecord]) -> dict[str, dict[str, Any]]:
    summary = {}
    for cls in CLASSES:
        mine = [r for r in records if r.request_class == cls]
        summary[cls] = {"requests": len(mine), "ok": sum(r.ok for r in mine),
                        "errors": dict(Counter(r.error_key for r in mine if not r.ok)),
                        "e2e_ms": distribution_ms(r.e2e_s for r in mine if r.ok and r.e2e_s is not None)}
    return summary


def build_report(settings: dict[str, Any], kills: list[dict[str, Any]], records: Sequence[RequestRecord],
                 batch: dict[str, Any] | None) -> dict[str, Any]:
    """Each kill with its recovery and the errors from it to the next kill; totals per class; the batch."""
    kills = sorted(kills, key=lambda k: k["killed_s"])
    for kill, following in zip(kills, kills[1:] + [None]):
        kill["errors"] = errors_by_class(records, kill["killed_s"], following["killed_s"] if following else None)
        kill["interactive_while_down"] = interactive_while_down(records, kill["killed_s"], kill.get("replaced_s"))
        if kill["deployment"] == "HotLane":
            kill["interactive_back_on_hot_s"] = back_on_lane_s(records, kill["killed_s"], kill.get("replaced_s"))
    before = errors_by_class(records, float("-inf"), kills[0]["killed_s"]) if kills else errors_by_class(
        records, float("-inf"), None)
    return {"settings": settings, "kills": kills, "errors_before_first_kill": before,
            "classes": class_summary(records), "batch": batch,
            "records": [r.to_json() for r in records]}


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{key}: {n}" for key, n in sorted(errors.items())) or "0"


def render_markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [f"# Chaos: {settings.get('serve_config', '')}", "",
             f"Load: {settings['interactive']} interactive streams ({settings['interactive_tokens']} tokens), "
             f"{settings['flex']} flex completions ({settings['flex_tokens']} tokens), a batch of "
             f"{settings['batch_lines']} lines ({settings['batch_max_tokens']} tokens); kills in turn: "
             f"{', '.join(settings['kill'])}.", "",
             "| kill | killed (s) | engine processes killed | replacement RUNNING (s) | first 200 through it (s) | "
             "interactive errors | flex errors |", "|---|---|---|---|---|---|---|"]
    for kill in report["kills"]:
        lines.append(f"| {kill['deployment']} | {kill['killed_s']:.0f} | {len(kill.get('engine_pids', []))} | "
                     f"{_s(kill.get('replaced_s'))} | {_s(kill.get('first_ok_s'))} | "
                     f"{_errors(kill['errors'].get('interactive', {}))} | {_errors(kill['errors'].get('batch', {}))} |")
    lines += ["", "Times are seconds after the kill. Errors: requests that ended between this kill and the next, by "
              "HTTP status or `stream` (an error event mid-stream) / `transport` / `timeout`.", "",
              "Interactive requests from each kill until its replacement was RUNNING, and the streams under way at "
              "the kill:", "",
              "| kill | sent | answered | TTFT p50 / p99 (ms) | served on | under way at the kill: finished | "
              "back on the hot lane after RUNNING (s) |", "|---|---|---|---|---|---|---|"]
    for kill in report["kills"]:
        down = kill.get("interactive_while_down") or {}
        ttft = down.get("ttft_ms") or {}
        served = ", ".join(f"{lane}: {n}" for lane, n in sorted((down.get("served_on") or {}).items())) or "–"
        lines.append(f"| {kill['deployment']} | {down.get('sent', 0)} | {down.get('answered', 0)} | "
                     f"{_s(ttft.get('p50'))} / {_s(ttft.get('p99'))} | {served} | "
                     f"{down.get('under_way_finished', 0)} of {down.get('under_way_at_kill', 0)} | "
                     f"{_s(kill.get('interactive_back_on_hot_s'))} |")
    lines += ["",
              "| class | requests | ok | errors | E2E p50 / p99 of ok (ms) |", "|---|---|---|---|---|"]
    for cls, summary in report["classes"].items():
        e2e = summary["e2e_ms"]
        name = "flex" if cls == "batch" else cls
        lines.append(f"| {name} | {summary['requests']} | {summary['ok']} | {_errors(summary['errors'])} | "
                     f"{_s(e2e.get('p50'))} / {_s(e2e.get('p99'))} |")
    batch = report.get("batch")
    if batch:
        exact = batch["exactness"]
        lines += ["", f"Batch {batch['id']}: {batch['status']}, {batch['request_counts']}; "
                  f"{exact['returned']} lines returned for {exact['expected']}: {exact['lost']} lost, "
                  f"{exact['duplicated']} duplicated, {exact['unexpected']} unexpected -> "
                  f"{'exact' if exact['exact'] else 'NOT exact'} (finished {_s(batch.get('finished_s'))} s into the "
                  "run)."]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path, name: str = "report",
                 render: Callable[[dict[str, Any]], str] | None = None) -> dict[str, Path]:
    """`name`.json and `name`.md (rendered by `render`, this tool's render_markdown by default) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "markdown": out_dir / f"{name}.md"}
    paths["json"].write_text(json.dumps(report, indent=1), encoding="utf-8")
    paths["markdown"].write_text((render or render_markdown)(report), encoding="utf-8")
    return paths


# --------------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------------


def wait_recovered(load: MixedLoad, dashboard: str, deployment: str, killed: dict[str, Any], timeout_s: float) -> None:
    """Fill killed['replaced_s'] and ['first_ok_s'] (None where the timeout came first)."""
    killed_s = killed["killed_s"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fresh = {r["replica_id"] for r in running(serve_replicas(dashboard).get(deployment, []))
                 if r["replica_id"] not in killed["replicas_before"]}
        if fresh and killed.get("replaced_s") is None:
            killed["replaced_s"] = round(load.now_s() - killed_s, 2)
        if fresh:
            killed["new_replicas"] = sorted(fresh)
            first = first_success_s(list(load.records), killed_s, served_through(deployment, fresh))
            if first is not None:
                killed["first_ok_s"] = first
                return
        time.sleep(0.5)
    killed.setdefault("replaced_s", None)
    killed.setdefault("first_ok_s", None)


def run_chaos(url: str, dashboard: str, model: str, settings: dict[str, Any]) -> dict[str, Any]:
    load = MixedLoad(url, model, settings["interactive"], settings["flex"], settings["interactive_tokens"],
                     settings["flex_tokens"])
    thread = load.start_thread()
    batch_id = (submit_batch(url, model, settings["batch_lines"], settings["batch_max_tokens"])
                if settings["batch_lines"] else None)
    kills = []
    try:
        time.sleep(settings["settle_s"])
        for deployment in settings["kill"]:
            killed = {"deployment": deployment, **kill_replica(dashboard, deployment)}
            killed["killed_s"] = round(killed.pop("killed_perf") - load.origin, 2)
            _log(f"killed {deployment} replica {killed['replica_id']} (pid {killed['pid']}, engine processes "
                 f"{killed['engine_pids']})")
            wait_recovered(load, dashboard, deployment, killed, settings["recover_timeout_s"])
            _log(f"{deployment}: replacement RUNNING after {_s(killed['replaced_s'])} s, first 200 through it after "
                 f"{_s(killed['first_ok_s'])} s")
            kills.append(killed)
            time.sleep(settings["settle_s"])
        batch = None
        if batch_id:
            deadline = time.monotonic() + settings["batch_timeout_s"]
            state = batch_state(url, batch_id)
            while state.get("status") not in ("completed", "failed", "cancelled", "expired") and \
                    time.monotonic() < deadline:
                time.sleep(2)
                state = batch_state(url, batch_id)
            batch = {"id": batch_id, "status": state.get("status"), "request_counts": state.get("request_counts"),
                     "finished_s": round(load.now_s(), 1),
                     "exactness": batch_exactness(settings["batch_lines"], batch_output_ids(url, state))}
    finally:
        load.stop.set()
        thread.join(timeout=settings.get("request_timeout_s", 300) + 30)
    return build_report(settings, kills, list(load.records), batch)


def served_app(serve_config: str, overrides: list[str], out: Path, ready_timeout_s: float):
    """(ServedApp for a derived copy of the config, its url, the config's document): `serve run` of a copy with the
    overrides and the batch store under `out` (load_tests.overload's derivation)."""
    from load_tests.overload import derived_config
    from load_tests.serve_runner import (ServedApp, app_url, checkout_env, default_cleanup_commands,
                                         default_start_command, default_stop_commands)

    document = derived_config(yaml.safe_load(Path(serve_config).read_text(encoding="utf-8")), overrides, out)
    config_path = out / ("served-" + Path(serve_config).name)
    config_path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    app = ServedApp(app_url(document), out / "serve.log", start_command=default_start_command(str(config_path)),
                    stop_commands=default_stop_commands(), cleanup_commands=default_cleanup_commands(),
                    ready_timeout_s=ready_timeout_s, env=checkout_env())
    return app, app_url(document), document


def served_model(document: dict[str, Any]) -> str:
    from load_tests.serve_runner import llm_lanes_application

    return ((llm_lanes_application(document).get("args") or {}).get("model") or {}).get("served_name") or "tiny-llama"


def common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options chaos and soak share: the app, the load."""
    parser.add_argument("--serve-config", required=True, help="serve config to start (or of the app at --url)")
    parser.add_argument("--url", default=None, help="use the app already running here instead of starting one")
    parser.add_argument("--dashboard", default=DEFAULT_DASHBOARD, help="Ray dashboard (Serve's REST API)")
    parser.add_argument("--out", required=True, help="directory for report.json, report.md and logs")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the app's args (dotted path without `args.`, YAML value)")
    parser.add_argument("--interactive", type=int, default=2, help="closed-loop interactive streams")
    parser.add_argument("--flex", type=int, default=2, help="closed-loop flex completions")
    parser.add_argument("--interactive-tokens", type=int, default=64, help="output tokens per interactive stream")
    parser.add_argument("--flex-tokens", type=int, default=64, help="output tokens per flex completion")
    parser.add_argument("--batch-lines", type=int, default=200, help="lines of the batch (0: no batch)")
    parser.add_argument("--batch-max-tokens", type=int, default=128, help="output tokens per batch line")
    parser.add_argument("--batch-timeout", type=float, default=900.0, help="seconds to wait for the batch at the end")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the app to start")


def run_with_app(args: argparse.Namespace, body: Callable[[str, str], dict[str, Any]]) -> dict[str, Any] | None:
    """body(url, model) against --url, or against the app started from the config (stopped afterwards)."""
    from load_tests.serve_runner import AppStartError

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    app, url, document = served_app(args.serve_config, args.overrides, out, args.ready_timeout)
    model = served_model(document)
    if args.url:
        return body(args.url.rstrip("/"), model)
    _log(f"starting `serve run` (log: {app.log_path})")
    try:
        app.start()
        _log(f"ready after {app.wait_ready():.0f} s")
        return body(url, model)
    except AppStartError as error:
        print(error, file=sys.stderr)
        return None
    finally:
        _log("shutting down")
        app.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common_arguments(parser)
    parser.add_argument("--kill", default=",".join(DEPLOYMENTS),
                        help=f"deployments whose replica is killed, in turn (default {','.join(DEPLOYMENTS)})")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of load before the first kill and "
                                                                    "after each recovery")
    parser.add_argument("--recover-timeout", type=float, default=300.0,
                        help="seconds to wait for a killed deployment to serve again")
    args = parser.parse_args(argv)
    kill = [name.strip() for name in args.kill.split(",") if name.strip()]
    unknown = set(kill) - set(DEPLOYMENTS)
    if unknown:
        parser.error(f"--kill names {sorted(unknown)}: use some of {', '.join(DEPLOYMENTS)}")
    settings = {"serve_config": args.serve_config, "overrides": args.overrides, "kill": kill,
                "interactive": args.interactive, "flex": args.flex, "interactive_tokens": args.interactive_tokens,
                "flex_tokens": args.flex_tokens, "batch_lines": args.batch_lines,
                "batch_max_tokens": args.batch_max_tokens, "batch_timeout_s": args.batch_timeout,
                "settle_s": args.settle, "recover_timeout_s": args.recover_timeout}
    report = run_with_app(args, lambda url, model: run_chaos(url, args.dashboard, model, settings))
    if report is None:
        return 1
    paths = write_report(report, Path(args.out))
    print(paths["markdown"].read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
