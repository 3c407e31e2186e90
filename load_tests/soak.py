"""Soak: steady mixed load for `--minutes` on one running app. Do the app's processes grow, and are engine requests
left behind once the load has drained?

    python -m load_tests.soak --serve-config serve_configs/local.yaml --minutes 30 --out load_tests/results/soak

Load (load_tests.chaos's): `--interactive` closed-loop interactive streams and `--flex` closed-loop flex
completions for the whole time, and a Batch API batch of `--batch-lines` lines submitted again whenever the last one
finished (`--batch-lines 0`: none). Each process of the app is sampled at the start (after `--warmup` seconds of
load) and at the end of the load: resident memory (VmRSS) and open file descriptors, for the Router, the lane
replicas, the PrefixCache and the HTTP proxy (their pids from Serve's REST API on `--dashboard`) and each lane
replica's vLLM engine processes (`VLLM::*` under it). After the load has stopped and `--drain` seconds passed, the
lanes' `GET /v1/admin/stats` must show no request left in any engine (running, waiting) or replica (in flight):
anything there is a leaked engine request. Every batch must come back exact (each line once).

Outputs in `--out`: report.json, report.md, samples.jsonl (every sample, one per `--sample-interval`), and with
`--serve-config` alone the derived config and the `serve run` log (the app is started and stopped as in chaos). The
report's RSS trend is the least-squares slope over the second half of the samples: a fresh engine's memory climbs for
a while before it levels off, a leak keeps climbing. `python -m load_tests.soak rebuild OUT` recomputes a saved
report from its report.json and samples.jsonl.

`--memory-snapshots S` has every Router, lane and PrefixCache replica trace its Python heap and write a tracemalloc
snapshot every S seconds into OUT/memory (`observability.memory_snapshots`, app/observability/memory.py); the report
then gives, per replica process, its traced memory at the start sample and at the end with the trend over the second
half, and the source lines whose memory grew most between the first snapshot after the start sample and the last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from load_tests.chaos import (LANES, MixedLoad, _log, batch_exactness, batch_output_ids, batch_state,
                              children_table, class_summary, common_arguments, engine_processes, proxy_pids,
                              run_with_app, running, serve_replicas, submit_batch)
from load_tests import chaos
from load_tests.gpu_campaign import lane_entries

MEMORY_DIR = "memory"  # under --out: the replicas' tracemalloc snapshots
MEMORY_TOP_LINES = 8

# Requests still inside a lane replica, as its stats report them.
LEAK_FIELDS = ("running", "waiting")


def read_process(pid: int, proc: Path = Path("/proc")) -> dict[str, Any] | None:
    """RSS (MiB) and open file descriptors of one process; None once it is gone."""
    try:
        status = (proc / str(pid) / "status").read_text()
        fds = len(list((proc / str(pid) / "fd").iterdir()))
    except OSError:
        return None
    rss_kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return {"rss_mib": round(rss_kb / 1024, 1), "open_files": fds}


def app_processes(dashboard: str) -> dict[str, int]:
    """Role -> pid: `Router`, `HotLane`, ... (`#n` after the name where a deployment has several replicas), `proxy`,
    and `HotLane engine VLLM::EngineCore` etc. for each lane replica's engine processes."""
    table = children_table()
    roles: dict[str, int] = {}
    for deployment, replicas in sorted(serve_replicas(dashboard).items()):
        for n, replica in enumerate(sorted(running(replicas), key=lambda r: r["replica_id"])):
            role = deployment if n == 0 else f"{deployment}#{n}"
            roles[role] = int(replica["pid"])
            if deployment in LANES:
                for pid in engine_processes(table, int(replica["pid"])):
                    name = f"{role} engine {table[pid][1]}"
                    roles[name if name not in roles else f"{name} {pid}"] = pid
    for n, pid in enumerate(proxy_pids()):
        roles["proxy" if n == 0 else f"proxy#{n}"] = pid
    return roles


def sample(dashboard: str) -> dict[str, Any]:
    processes = {}
    for role, pid in app_processes(dashboard).items():
        reading = read_process(pid)
        if reading is not None:
            processes[role] = {"pid": pid, **reading}
    return {"t_unix": time.time(), "processes": processes}


def growth(start: dict[str, Any], end: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per role: start and end RSS and open files and their change; a role whose pid changed (a restarted process)
    is marked, as its growth is not one process's."""
    rows = {}
    for role in sorted(set(start["processes"]) | set(end["processes"])):
        a, b = start["processes"].get(role), end["processes"].get(role)
        row: dict[str, Any] = {"start": a, "end": b}
        if a and b:
            row.update(rss_growth_mib=round(b["rss_mib"] - a["rss_mib"], 1),
                       open_files_growth=b["open_files"] - a["open_files"], same_process=a["pid"] == b["pid"])
        rows[role] = row
    return rows


def rss_slope_mib_per_h(samples: Sequence[dict[str, Any]], role: str, from_fraction: float = 0.5) -> float | None:
    """Least-squares slope of the role's RSS over the samples from `from_fraction` of the run on (the early climb of
    a fresh engine left out), in MiB per hour; None with fewer than 3 samples of one process there."""
    if not samples:
        return None
    t0, t1 = samples[0]["t_unix"], samples[-1]["t_unix"]
    end = samples[-1]["processes"].get(role)
    points = [(s["t_unix"] / 3600, s["processes"][role]["rss_mib"]) for s in samples
              if s["t_unix"] >= t0 + from_fraction * (t1 - t0) and role in s["processes"]
              and end is not None and s["processes"][role]["pid"] == end["pid"]]
    if len(points) < 3:
        return None
    mean_t = sum(t for t, _ in points) / len(points)
    mean_r = sum(r for _, r in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return round(sum((t - mean_t) * (r - mean_r) for t, r in points) / spread, 1) if spread else None


def leaked_requests(stats: Any) -> dict[str, Any]:
    """Requests left in the lanes after the load drained: per lane replica, the engine's running and waiting and the
    replica's in-flight requests by class; `total` sums them (0 when nothing leaked)."""
    replicas, total = [], 0
    for lane, entries in lane_entries(stats).items():
        for entry in entries:
            left = {name: int(entry.get(name) or 0) for name in LEAK_FIELDS}
            left["in_flight"] = sum(int(v) for v in (entry.get("inflight_by_class") or {}).values())
            total += sum(left.values())
            replicas.append({"lane": lane, "replica_id": entry.get("replica_id"), **left})
    return {"total": total, "replicas": replicas}


def traced_growth(directory: Path, start_unix: float, top: int = MEMORY_TOP_LINES) -> list[dict[str, Any]]:
    """Per replica process that wrote tracemalloc snapshots into `directory`: its traced memory at the first snapshot
    from `start_unix` on and at its last, the trend of the traced memory over the second half of its snapshots
    (MiB/h), and the `top` lines that grew most between those two snapshots."""
    from app.observability.memory import growth as line_growth
    from app.observability.memory import read_index

    by_process: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for entry in read_index(directory):
        by_process.setdefault((entry["component"], entry["pid"]), []).append(entry)
    rows = []
    for (component, pid), entries in sorted(by_process.items()):
        entries.sort(key=lambda e: e["n"])
        after_start = [e for e in entries if e["t_unix"] >= start_unix] or entries[-1:]
        first, last = after_start[0], entries[-1]
        # The traced total read as one process's RSS: the same least-squares trend over the second half.
        as_samples = [{"t_unix": e["t_unix"], "processes": {"p": {"pid": pid, "rss_mib": e["traced_mib"]}}}
                      for e in entries]
        trend = rss_slope_mib_per_h(as_samples, "p")
        rows.append({"component": component, "pid": pid, "snapshots": len(entries),
                     "traced_mib_first": first["traced_mib"], "traced_mib_last": last["traced_mib"],
                     "traced_slope_mib_per_h": trend,
                     "lines": (line_growth(directory / first["path"], directory / last["path"], top)
                               if first is not last else [])})
    return rows


def build_report(settings: dict[str, Any], start: dict[str, Any], end: dict[str, Any], leaks: dict[str, Any],
                 records: Sequence[Any], batches: list[dict[str, Any]],
                 samples: Sequence[dict[str, Any]] = (), memory: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    rows = growth(start, end)
    for role, row in rows.items():
        row["rss_slope_mib_per_h"] = rss_slope_mib_per_h(samples, role)
    return {"settings": settings, "start": start, "end": end, "growth": rows, "leaked": leaks,
            "classes": class_summary(records), "batches": batches, "memory": memory or [],
            "records": [r.to_json() for r in records]}


def _cell(reading: dict[str, Any] | None, key: str) -> str:
    return "–" if reading is None else str(reading[key])


def render_markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    elapsed = (report["end"]["t_unix"] - report["start"]["t_unix"]) / 60
    lines = [f"# Soak: {settings.get('serve_config', '')}, {settings['minutes']:g} min", "",
             f"Load: {settings['interactive']} interactive streams, {settings['flex']} flex completions, batches of "
             f"{settings['batch_lines']} lines one after another. Samples {elapsed:.1f} min apart (start after "
             f"{settings['warmup_s']:g} s of load, end as the load stops).", "",
             "| process | pid | RSS start → end (MiB) | growth (MiB) | RSS trend, second half (MiB/h) | "
             "open files start → end | growth |",
             "|---|---|---|---|---|---|---|"]
    for role, row in report["growth"].items():
        a, b = row["start"], row["end"]
        pid = str((b or a)["pid"]) + ("" if row.get("same_process", True) else " (restarted)")
        lines.append(f"| {role} | {pid} | {_cell(a, 'rss_mib')} → {_cell(b, 'rss_mib')} | "
                     f"{row.get('rss_growth_mib', '–')} | "
                     f"{'–' if row.get('rss_slope_mib_per_h') is None else row['rss_slope_mib_per_h']} | "
                     f"{_cell(a, 'open_files')} → {_cell(b, 'open_files')} | "
                     f"{row.get('open_files_growth', '–')} |")
    leaks = report["leaked"]
    lines += ["", f"Engine requests left {settings['drain_s']:g} s after the load stopped: **{leaks['total']}** "
              f"(" + ", ".join(f"{r['lane']} {r['replica_id']}: running {r['running']}, waiting {r['waiting']}, "
                               f"in flight {r['in_flight']}" for r in leaks["replicas"]) + ")", "",
              "| class | requests | ok | errors | E2E p50 / p99 of ok (ms) |", "|---|---|---|---|---|"]
    for cls, summary in report["classes"].items():
        e2e = summary["e2e_ms"]
        errors = ", ".join(f"{k}: {n}" for k, n in sorted(summary["errors"].items())) or "0"
        p50, p99 = e2e.get("p50"), e2e.get("p99")
        lines.append(f"| {'flex' if cls == 'batch' else cls} | {summary['requests']} | {summary['ok']} | {errors} | "
                     f"{'–' if p50 is None else f'{p50:.0f}'} / {'–' if p99 is None else f'{p99:.0f}'} |")
    batches = report["batches"]
    exact = sum(b["exactness"]["exact"] for b in batches)
    lines += ["", f"Batches: {len(batches)} finished, {exact} exact (every line once), "
              f"{sum(b['exactness']['returned'] for b in batches)} lines returned."]
    for row in report.get("memory") or []:
        slope = row["traced_slope_mib_per_h"]
        lines += ["", f"Traced Python heap of {row['component']} (pid {row['pid']}, {row['snapshots']} snapshots): "
                      f"{row['traced_mib_first']} → {row['traced_mib_last']} MiB from the start sample on, trend over "
                      f"the second half {'–' if slope is None else slope} MiB/h.", ""]
        if row["lines"]:
            lines += ["| line | growth (KiB) | now (KiB) | allocations added |", "|---|---|---|---|"]
            lines += [f"| `{line['where']}` | {line['size_diff_kib']} | {line['size_kib']} | {line['count_diff']} |"
                      for line in row["lines"]]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    return chaos.write_report(report, out_dir, render=render_markdown)


def finished_batch(url: str, batch_id: str, lines: int) -> dict[str, Any] | None:
    state = batch_state(url, batch_id)
    if state.get("status") not in ("completed", "failed", "cancelled", "expired"):
        return None
    return {"id": batch_id, "status": state.get("status"), "request_counts": state.get("request_counts"),
            "exactness": batch_exactness(lines, batch_output_ids(url, state))}


def run_soak(url: str, dashboard: str, model: str, settings: dict[str, Any], out: Path) -> dict[str, Any]:
    load = MixedLoad(url, model, settings["interactive"], settings["flex"], settings["interactive_tokens"],
                     settings["flex_tokens"])
    thread = load.start_thread()
    batches: list[dict[str, Any]] = []
    lines = settings["batch_lines"]
    batch_id = submit_batch(url, model, lines, settings["batch_max_tokens"]) if lines else None
    samples_path = out / "samples.jsonl"
    try:
        time.sleep(settings["warmup_s"])
        start = sample(dashboard)
        _log(f"start sample: {len(start['processes'])} processes; load for {settings['minutes']:g} min")
        with samples_path.open("w", encoding="utf-8") as samples:
            samples.write(json.dumps(start) + "\n")
            end_at = time.monotonic() + settings["minutes"] * 60
            next_sample = time.monotonic() + settings["sample_interval_s"]
            while time.monotonic() < end_at:
                time.sleep(2)
                if batch_id and (done := finished_batch(url, batch_id, lines)) is not None:
                    batches.append(done)
                    batch_id = submit_batch(url, model, lines, settings["batch_max_tokens"])
                if time.monotonic() >= next_sample:
                    samples.write(json.dumps(sample(dashboard)) + "\n")
                    samples.flush()
                    next_sample += settings["sample_interval_s"]
            end = sample(dashboard)
            samples.write(json.dumps(end) + "\n")
    finally:
        load.stop.set()
        thread.join(timeout=360)
    _log("load stopped; waiting for the last batch, then the drain")
    if batch_id:
        deadline = time.monotonic() + settings["batch_timeout_s"]
        while (done := finished_batch(url, batch_id, lines)) is None and time.monotonic() < deadline:
            time.sleep(2)
        if done is not None:
            batches.append(done)
    time.sleep(settings["drain_s"])
    leaks = leaked_requests(httpx.get(f"{url}/v1/admin/stats", timeout=30).json())
    memory = (traced_growth(out / MEMORY_DIR, start["t_unix"]) if settings.get("memory_snapshot_interval_s")
              else None)
    return build_report(settings, start, end, leaks, list(load.records), batches, read_samples(samples_path), memory)


def read_samples(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def rebuild(out_dir: Path) -> dict[str, Path]:
    """Recompute report.json's summaries and report.md from its own records and samples.jsonl."""
    from load_tests.client import RequestRecord

    saved = json.loads((out_dir / "report.json").read_text(encoding="utf-8"))
    report = build_report(saved["settings"], saved["start"], saved["end"], saved["leaked"],
                          [RequestRecord(**raw) for raw in saved["records"]], saved["batches"],
                          read_samples(out_dir / "samples.jsonl"), saved.get("memory"))
    return write_report(report, out_dir)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "rebuild":
        print(rebuild(Path(argv[1]))["markdown"].read_text(encoding="utf-8"))
        return 0
    parser = argparse.ArgumentParser(prog="python -m load_tests.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common_arguments(parser)
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes of load between the two samples")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of load before the start sample")
    parser.add_argument("--drain", type=float, default=10.0,
                        help="seconds after the load stops before the lanes are checked for leaked requests")
    parser.add_argument("--sample-interval", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--memory-snapshots", type=float, default=None, metavar="S",
                        help="every Router, lane and PrefixCache replica traces its heap and writes a tracemalloc "
                             "snapshot every S seconds (OUT/memory); the report names the lines that grew")
    args = parser.parse_args(argv)
    settings = {"serve_config": args.serve_config, "overrides": args.overrides, "minutes": args.minutes,
                "interactive": args.interactive, "flex": args.flex, "interactive_tokens": args.interactive_tokens,
                "flex_tokens": args.flex_tokens, "batch_lines": args.batch_lines,
                "batch_max_tokens": args.batch_max_tokens, "batch_timeout_s": args.batch_timeout,
                "warmup_s": args.warmup, "drain_s": args.drain, "sample_interval_s": args.sample_interval,
                "memory_snapshot_interval_s": args.memory_snapshots}
    out = Path(args.out)
    if args.memory_snapshots:
        args.overrides += [f"observability.memory_snapshots.dir={(out / MEMORY_DIR).resolve()}",
                           f"observability.memory_snapshots.interval_s={args.memory_snapshots}"]
    report = run_with_app(args, lambda url, model: run_soak(url, args.dashboard, model, settings, out))
    if report is None:
        return 1
    paths = write_report(report, out)
    print(paths["markdown"].read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
