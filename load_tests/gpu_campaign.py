"""Helpers of load_tests/gpu_campaign.sh: wait for the app, smoke it, sample its stats, summarize the campaign.

    python3 -m load_tests.gpu_campaign wait-ready --url http://127.0.0.1:8000 --model llama-8b-dummy --pid PID
    python3 -m load_tests.gpu_campaign smoke --url ... --model ... --out smoke.json
    python3 -m load_tests.gpu_campaign sample-stats --url ... --out stats.jsonl [--interval 2]
    python3 -m load_tests.gpu_campaign stats --url ... --out stats-final.json
    python3 -m load_tests.gpu_campaign summary --campaign /tmp/campaign --out /tmp/campaign/combined

HTTP goes through the standard library (these run on the GPU host beside the app, before and after the load
generator). The summary reads what the shell script left in the campaign folder: one folder per phase (config) with
phase.json, smoke.json, stats.jsonl, stats-final.json, gpu.csv and one load_tests report per scenario, plus
preflight/kv-<config>-<lane>.json from kv_budget.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

# The target: the lanes keep batch output throughput at >= 95 % of the single FCFS engine's.
BATCH_THROUGHPUT_FLOOR = 0.95
BASELINE_PHASE = "baseline-fcfs"
# Phases in the order tables list them; the first measured lanes phase and the FCFS baseline make the combined
# report's "first / second" ratios.
PHASE_ORDER = ("lanes-tuned", "lanes", "lanes-tuned-mps", "baseline-fcfs", "baseline-priority")
HEADLINE_SCENARIO = "gpu_mixed"
# gpu_campaign.sh names a phase <phase><DIRECT_INGRESS_SUFFIX> when it sends the scenarios past the HTTP proxy.
DIRECT_INGRESS_SUFFIX = "-di"
# A phase run again in one campaign folder (gpu_campaign.sh numbers it rather than replacing the first run).
RUN_SUFFIX = re.compile(r"-run\d+$")
# A GET of /v1/models a second costs the starting app nothing and measures its ready time to the second.
READY_POLL_S = 1.0
# Long enough that one request normally waits out a lane still starting (Serve holds it until a replica is up):
# repeated client timeouts would count as lane failures for the circuit breaker.
READY_REQUEST_TIMEOUT_S = 150.0
LANES_SETTLE_TIMEOUT_S = 180.0
STATS_TIMEOUT_S = 10.0


# --------------------------------------------------------------------------------------------------------------------
# HTTP (standard library only)
# --------------------------------------------------------------------------------------------------------------------


def http_json(method: str, url: str, body: dict[str, Any] | None = None,
              timeout_s: float = 10.0) -> tuple[int | None, Any]:
    """(status, parsed JSON or text); status None when no answer came (refused, timed out)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    except (urllib.error.URLError, OSError, TimeoutError) as error:
        return None, f"{type(error).__name__}: {error}"
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")[:2000]


def chat_body(model: str, content: str, max_tokens: int, stream: bool = False,
              service_tier: str = "default") -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                            "service_tier": service_tier, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def lane_entries(stats: Any) -> dict[str, list[dict[str, Any]]]:
    """{lane: [replica stats without errors]} from /v1/admin/stats, whatever lanes the app has."""
    lanes = stats.get("lanes") if isinstance(stats, dict) else None
    if not isinstance(lanes, dict):
        return {}
    result = {}
    for lane, entries in lanes.items():
        entries = entries if isinstance(entries, list) else [entries]
        result[lane] = [e for e in entries if isinstance(e, dict) and "error" not in e]
    return result


def lanes_answering(stats: Any) -> bool:
    """Every lane the stats list has at least one replica answering, and its engine has sized its KV cache."""
    lanes = stats.get("lanes") if isinstance(stats, dict) else None
    if not isinstance(lanes, dict) or not lanes:
        return False
    healthy = lane_entries(stats)
    return all(healthy.get(lane) and all(e.get("kv_capacity_tokens") for e in healthy[lane]) for lane in lanes)


# --------------------------------------------------------------------------------------------------------------------
# wait-ready / smoke / stats
# --------------------------------------------------------------------------------------------------------------------


class NotReady(RuntimeError):
    pass


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by the shell) still answers kill 0; /proc says what it is.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def wait_ready(url: str, model: str, timeout_s: float, pid: int | None = None,
               poll_s: float = READY_POLL_S) -> dict[str, Any]:
    """Ready = GET /v1/models is 200, a one-token chat completion (hot lane) is 200, and then every lane in
    /v1/admin/stats answers with a sized KV cache (waited for up to LANES_SETTLE_TIMEOUT_S more, not fatal).
    Returns the seconds each step took; raises NotReady when the server process dies or time runs out."""
    began = time.monotonic()
    marks: dict[str, Any] = {}
    steps = ("models", "chat")
    step = 0
    last = None
    while step < len(steps):
        if not _alive(pid):
            raise NotReady(f"the serve process {pid} exited before the app was ready (last answer: {last})")
        if time.monotonic() - began > timeout_s:
            raise NotReady(f"not ready after {timeout_s:.0f} s at step {steps[step]!r} (last answer: {last})")
        if steps[step] == "models":
            status, last = http_json("GET", url + "/v1/models", timeout_s=5)
        else:
            left = timeout_s - (time.monotonic() - began)
            status, last = http_json("POST", url + "/v1/chat/completions", chat_body(model, "ready?", 1),
                                     timeout_s=max(5.0, min(READY_REQUEST_TIMEOUT_S, left)))
        if status == 200:
            marks[f"{steps[step]}_s"] = round(time.monotonic() - began, 1)
            step += 1
            continue
        time.sleep(poll_s)
    settle_until = time.monotonic() + LANES_SETTLE_TIMEOUT_S
    while True:
        status, stats = http_json("GET", url + "/v1/admin/stats", timeout_s=STATS_TIMEOUT_S)
        if status == 200 and lanes_answering(stats):
            marks["lanes_s"] = round(time.monotonic() - began, 1)
            break
        if time.monotonic() > settle_until or not _alive(pid):
            marks["lanes_s"] = None
            marks["lanes_warning"] = f"not every lane answered /v1/admin/stats: {str(stats)[:500]}"
            break
        time.sleep(poll_s)
    marks["ready_s"] = round(time.monotonic() - began, 1)
    return marks


def smoke(url: str, model: str) -> dict[str, Any]:
    """One non-streamed and one streamed chat request through the OpenAI API; what came back, and how fast."""
    result: dict[str, Any] = {}
    started = time.perf_counter()
    status, payload = http_json("POST", url + "/v1/chat/completions",
                                chat_body(model, "Say hello from the H200.", 16), timeout_s=120)
    answer = None
    if status == 200 and isinstance(payload, dict):
        choices = payload.get("choices") or [{}]
        answer = (choices[0].get("message") or {}).get("content")
    result["chat"] = {"status": status, "seconds": round(time.perf_counter() - started, 3), "answer": answer,
                      "usage": payload.get("usage") if isinstance(payload, dict) else None,
                      "response": payload if status != 200 else None}
    result["stream"] = smoke_stream(url, model)
    result["ok"] = status == 200 and result["stream"]["status"] == 200
    return result


def smoke_stream(url: str, model: str) -> dict[str, Any]:
    body = json.dumps(chat_body(model, "Stream a few tokens.", 16, stream=True, service_tier="priority")).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    chunks, first_s, text, usage, headers = 0, None, "", None, {}
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            headers = {k: v for k, v in response.headers.items() if k.lower().startswith("x-llm-lanes")}
            for raw in response:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if "role" in delta:
                        continue
                    chunks += 1
                    first_s = first_s if first_s is not None else time.perf_counter() - started
                    text += delta.get("content") or ""
            status = response.status
    except urllib.error.HTTPError as error:
        status = error.code
    except (urllib.error.URLError, OSError, TimeoutError, ValueError) as error:
        return {"status": None, "error": f"{type(error).__name__}: {error}"}
    return {"status": status, "headers": headers, "token_chunks": chunks, "first_token_s": first_s,
            "seconds": round(time.perf_counter() - started, 3), "text": text, "usage": usage}


def sample_stats(url: str, out: Path, interval_s: float, max_samples: int | None = None) -> None:
    """Append {"t": unix time, "stats": /v1/admin/stats} to `out` every interval until killed."""
    taken = 0
    with open(out, "a", encoding="utf-8") as handle:
        while max_samples is None or taken < max_samples:
            began = time.monotonic()
            status, stats = http_json("GET", url + "/v1/admin/stats", timeout_s=STATS_TIMEOUT_S)
            handle.write(json.dumps({"t": round(time.time(), 3), "status": status, "stats": stats}) + "\n")
            handle.flush()
            taken += 1
            time.sleep(max(0.0, interval_s - (time.monotonic() - began)))


# --------------------------------------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_stats_samples(path: Path) -> list[dict[str, Any]]:
    samples = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return samples
    for line in lines:
        try:
            samples.append(json.loads(line))
        except ValueError:
            continue  # a line cut short when the sampler was killed
    return samples


def kv_and_prefix(samples: list[dict[str, Any]], final: Any) -> dict[str, dict[str, Any]]:
    """Per lane: peak KV usage and most requests running/waiting over the samples; capacity and prefix-cache hit
    rate from the final snapshot (else the last sample)."""
    lanes: dict[str, dict[str, Any]] = {}
    for sample in samples:
        for lane, entries in lane_entries(sample.get("stats")).items():
            row = lanes.setdefault(lane, {"peak_kv_usage": None, "peak_running": None, "peak_waiting": None})
            for entry in entries:
                for key, field in (("peak_kv_usage", "kv_cache_usage"), ("peak_running", "running"),
                                   ("peak_waiting", "waiting")):
                    value = entry.get(field)
                    if isinstance(value, (int, float)):
                        row[key] = value if row[key] is None else max(row[key], value)
    last = final if lane_entries(final) else (samples[-1].get("stats") if samples else None)
    for lane, entries in lane_entries(last).items():
        row = lanes.setdefault(lane, {"peak_kv_usage": None, "peak_running": None, "peak_waiting": None})
        if entries:
            row["kv_capacity_tokens"] = sum(e.get("kv_capacity_tokens") or 0 for e in entries) or None
            queries = sum(e.get("prefix_cache_queries") or 0 for e in entries)
            hits = sum(e.get("prefix_cache_hits") or 0 for e in entries)
            row["prefix_cache_hit_rate"] = hits / queries if queries else None
            # The lane's total over its replicas (the hot lane has two with the realtime reserve).
            row["served_by_class"] = dict(sum((Counter(e.get("served_by_class") or {}) for e in entries), Counter()))
            # Per replica: with more than one (the hot lane's realtime reserve), which served which class.
            row["served_by_replica"] = {str(e.get("replica_id", i)).rsplit("#", 1)[-1]: e.get("served_by_class") or {}
                                        for i, e in enumerate(entries)}
    return lanes


def _prefix_counters(stats: Any) -> dict[str, dict[str, tuple[int, int]]]:
    """{lane: {replica id: (prefix-cache queries, hits)}} from one /v1/admin/stats snapshot."""
    return {lane: {str(e.get("replica_id", i)): (e.get("prefix_cache_queries") or 0, e.get("prefix_cache_hits") or 0)
                   for i, e in enumerate(entries)}
            for lane, entries in lane_entries(stats).items()}


def prefix_hit_rate_in_window(samples: list[dict[str, Any]], start_unix: float, end_unix: float,
                              final: Any = None) -> dict[str, float | None]:
    """Per lane, the engines' prefix-cache hit rate over one scenario's run: the counters' growth from the last
    sample at or before `start_unix` to the first at or after `end_unix` (else `final`, the snapshot taken after
    the phase's last scenario: the sampler stops with the scenarios). A phase runs several scenarios and the
    engine counters only ever grow, so the final snapshot's rate mixes them (gpu_mixed shares no prefixes). A
    replica missing from either snapshot, or whose counters went back (restarted), is left out."""
    timed = [s for s in samples if isinstance(s.get("t"), (int, float)) and lane_entries(s.get("stats"))]
    before = [s["stats"] for s in timed if s["t"] <= start_unix]
    after = [s["stats"] for s in timed if s["t"] >= end_unix] or ([final] if lane_entries(final) else [])
    if not before or not after:
        return {}
    first, last = _prefix_counters(before[-1]), _prefix_counters(after[0])
    rates: dict[str, float | None] = {}
    for lane, replicas in last.items():
        queries = hits = 0
        for replica, (q_end, h_end) in replicas.items():
            q_start, h_start = first.get(lane, {}).get(replica, (None, None))
            if q_start is None or q_end < q_start or h_end < h_start:
                continue
            queries += q_end - q_start
            hits += h_end - h_start
        rates[lane] = hits / queries if queries else None
    return rates


def replica_routing(final: Any) -> dict[str, dict[str, Any]]:
    """Per lane deployment, the answering Router replica's prefix-affinity decisions from the final admin stats:
    decision time p50/p99, reasons and lookup outcomes (a lookup that misses its budget routes on load only, so a
    high timeout share means "affinity" mostly ran as pow2)."""
    if not isinstance(final, dict):
        return {}
    routing = (final.get("router") or {}).get("replica_routing") or {}
    rows = {}
    for deployment, entry in sorted(routing.items()):
        lookups = entry.get("lookups") or {}
        total = sum(lookups.values())
        rows[deployment] = {"p50_ms": entry.get("p50_ms"), "p99_ms": entry.get("p99_ms"),
                            "reasons": entry.get("reasons") or {}, "lookups": lookups,
                            "reserve_routing": entry.get("reserve_routing") or {},
                            "lookups_ok_share": lookups.get("ok", 0) / total if total else None}
    return rows


def read_gpu_csv(path: Path) -> dict[str, Any]:
    """nvidia-smi --query-gpu=timestamp,memory.used,memory.total,utilization.gpu,power.draw,clocks.sm
    --format=csv,noheader,nounits, one row a second."""
    used, util, power = [], [], []
    total = None
    try:
        rows = list(csv.reader(path.read_text(encoding="utf-8").splitlines()))
    except OSError:
        return {}
    for row in rows:
        try:
            values = [float(v) for v in row[1:5]]
        except ValueError:
            continue  # a header or [N/A]
        if len(values) < 4:
            continue  # a line cut short when the sampler was killed
        used.append(values[0])
        total = values[1]
        util.append(values[2])
        power.append(values[3])
    if not used:
        return {}
    busy = [u for u in util if u > 0]
    return {"samples": len(used), "memory_used_mib_max": max(used), "memory_total_mib": total,
            "utilization_mean": sum(util) / len(util), "utilization_mean_when_busy": (sum(busy) / len(busy))
            if busy else 0.0, "power_w_max": max(power)}


def _class_row(summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "requests": summary["requests"], "ok": summary["ok"], "errors": summary["errors"],
        "ttft_ms": {k: summary["ttft_ms"].get(k) for k in ("p50", "p90", "p99")},
        "tpot_ms": {k: summary["tpot_ms"].get(k) for k in ("p50", "p99")},
        "e2e_ms": {k: summary["e2e_ms"].get(k) for k in ("p50", "p99")},
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "goodput_fraction": summary["goodput"]["fraction"],
        "headers": summary.get("headers", {}),
    }


def phase_summary(phase_dir: Path, kv_predictions: dict[str, dict[str, int]]) -> dict[str, Any]:
    phase = _read_json(phase_dir / "phase.json") or {"label": phase_dir.name, "status": "unknown"}
    config_stem = Path(phase.get("config") or "").stem
    result: dict[str, Any] = {**phase, "scenarios": {}}
    samples, final = read_stats_samples(phase_dir / "stats.jsonl"), _read_json(phase_dir / "stats-final.json")
    for report_path in sorted(phase_dir.glob("*/report.json")):
        report = _read_json(report_path)
        if not report or not report.get("runs"):
            continue
        run = report["runs"][0]
        entry: dict[str, Any] = {"wall_s": run.get("wall_s"), "error": run.get("error"),
                                 "slo": report["scenario"].get("slo", {})}
        if not run.get("error"):
            entry["classes"] = {name: _class_row(s) for name, s in run["summary"]["classes"].items()}
            entry["errors_total"] = sum(sum(s["errors"].values()) for s in run["summary"]["classes"].values())
            began, wall_s = run.get("measured_from_unix"), run.get("wall_s")
            if began is not None and wall_s is not None:
                entry["prefix_hit_rate_by_lane"] = prefix_hit_rate_in_window(samples, began, began + wall_s, final)
        result["scenarios"][report_path.parent.name] = entry
    lanes = kv_and_prefix(samples, final)
    for lane, row in lanes.items():
        predicted = kv_predictions.get(config_stem, {}).get(lane)
        row["kv_budget_tokens"] = predicted
        measured = row.get("kv_capacity_tokens")
        row["kv_measured_over_budget"] = measured / predicted if measured and predicted else None
    result["lanes"] = lanes
    result["replica_routing"] = replica_routing(final)
    result["gpu"] = read_gpu_csv(phase_dir / "gpu.csv")
    smoke_result = _read_json(phase_dir / "smoke.json")
    if smoke_result:
        result["smoke"] = {"ok": smoke_result.get("ok"), "answer": (smoke_result.get("chat") or {}).get("answer"),
                           "usage": (smoke_result.get("chat") or {}).get("usage"),
                           "stream_first_token_s": (smoke_result.get("stream") or {}).get("first_token_s"),
                           "stream_lane": ((smoke_result.get("stream") or {}).get("headers") or {}).get(
                               "x-llm-lanes-lane")}
    return result


def phase_name(label: str) -> str:
    """The phase a label names, whichever ingress it ran through and however many times it ran in the campaign:
    'baseline-fcfs-di' and 'baseline-fcfs-di-run2' -> 'baseline-fcfs'."""
    return RUN_SUFFIX.sub("", label).removesuffix(DIRECT_INGRESS_SUFFIX)


def is_baseline(label: str) -> bool:
    return phase_name(label).startswith("baseline-")


def evaluate_targets(phases: list[dict[str, Any]], scenario: str) -> None:
    """Adds phase["targets"][scenario]: the GPU benchmark's three conditions (SLO p99s from the scenario, batch >= 0.95 x
    the FCFS baseline's output tokens/s: the mean of the campaign's FCFS runs of the scenario), each True / False /
    None (not measured)."""
    base_runs = [(p["scenarios"][scenario]["classes"].get("batch") or {}).get("output_tokens_per_s")
                 for p in phases if phase_name(p.get("label", "")) == BASELINE_PHASE
                 and "classes" in p["scenarios"].get(scenario, {})]
    base_runs = [tps for tps in base_runs if tps]
    base_batch = sum(base_runs) / len(base_runs) if base_runs else None
    for phase in phases:
        entry = phase["scenarios"].get(scenario)
        if not entry or "classes" not in entry:
            continue
        classes, checks = entry["classes"], {}
        for name in ("interactive", "realtime"):
            limit = (entry["slo"].get(name) or {}).get("ttft_ms")
            p99 = ((classes.get(name) or {}).get("ttft_ms") or {}).get("p99")
            checks[f"{name}_ttft_p99_ms"] = {"limit": limit, "value": p99,
                                            "met": None if limit is None or p99 is None else p99 <= limit}
        batch = (classes.get("batch") or {}).get("output_tokens_per_s")
        ratio = batch / base_batch if batch and base_batch else None
        checks["batch_vs_fcfs"] = {"limit": BATCH_THROUGHPUT_FLOOR, "value": ratio,
                                   "met": None if ratio is None else ratio >= BATCH_THROUGHPUT_FLOOR}
        known = [c["met"] for c in checks.values()]
        checks["all_met"] = None if None in known else all(known)
        phase.setdefault("targets", {})[scenario] = checks


def kv_predictions_from(preflight_dir: Path) -> dict[str, dict[str, int]]:
    """{config stem: {lane: tokens}} from preflight/kv-<config stem>-<lane>.json (kv_budget --json)."""
    predictions: dict[str, dict[str, int]] = {}
    for path in sorted(preflight_dir.glob("kv-*-*.json")):
        stem, _, lane = path.stem[len("kv-"):].rpartition("-")
        data = _read_json(path)
        if isinstance(data, dict) and data.get("tokens_capacity") is not None:
            predictions.setdefault(stem, {})[lane] = data["tokens_capacity"]
    return predictions


def ordered_phase_dirs(campaign: Path) -> list[Path]:
    dirs = [p.parent for p in campaign.glob("*/phase.json")]
    rank = {name: i for i, name in enumerate(PHASE_ORDER)}
    return sorted(dirs, key=lambda d: (rank.get(phase_name(d.name), len(rank)), d.name))


def build_summary(campaign: Path) -> dict[str, Any]:
    predictions = kv_predictions_from(campaign / "preflight")
    phases = [phase_summary(d, predictions) for d in ordered_phase_dirs(campaign)]
    scenarios = sorted({name for p in phases for name in p["scenarios"]},
                       key=lambda n: (n != HEADLINE_SCENARIO, n))
    for scenario in scenarios:
        evaluate_targets(phases, scenario)
    deferred = (campaign / "deferred.txt").read_text().split() if (campaign / "deferred.txt").exists() else []
    return {"generated_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "scenarios": scenarios, "phases": phases, "deferred": deferred,
            "preflight": _read_json(campaign / "preflight" / "summary.json")}


def _ms(value: Any) -> str:
    return "–" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def _triple(row: dict[str, Any] | None, key: str = "ttft_ms") -> str:
    if not row:
        return "–"
    return " / ".join(_ms(row[key].get(q)) for q in ("p50", "p90", "p99"))


def _mark(check: dict[str, Any] | None) -> str:
    if not check or check.get("met") is None:
        return "–"
    return "yes" if check["met"] else "**no**"


def render_summary_md(summary: dict[str, Any]) -> str:
    lines = ["# GPU campaign summary", "", f"Generated {summary['generated_at']}.", ""]
    if summary["deferred"]:
        lines += [f"**Deferred (not run yet, no time left in that call): {', '.join(summary['deferred'])}**", ""]
    lines += ["## Phases", "", "| phase | config | status | ready (s) | scenario wall (s) | GPU mem max (MiB) | "
              "GPU util mean (%) | smoke |", "|---|---|---|---|---|---|---|---|"]
    for p in summary["phases"]:
        walls = ", ".join(f"{n}: {e['wall_s']:.0f}" for n, e in p["scenarios"].items() if e.get("wall_s"))
        gpu = p.get("gpu") or {}
        smoke_result = p.get("smoke") or {}
        smoke_cell = "–" if not smoke_result else ("ok" if smoke_result.get("ok") else "**failed**") + (
            f" (lane {smoke_result['stream_lane']})" if smoke_result.get("stream_lane") else "")
        timings = p.get("timings") or {}
        lines.append(
            f"| {p.get('label')} | `{p.get('config', '')}` | {p.get('status')} | {_ms(timings.get('ready_s'))} | "
            f"{walls or '–'} | {_ms(gpu.get('memory_used_mib_max'))} | {_ms(gpu.get('utilization_mean'))} | "
            f"{smoke_cell} |")
    lines.append("")
    for scenario in summary["scenarios"]:
        measured = [p for p in summary["phases"] if "classes" in p["scenarios"].get(scenario, {})]
        if not measured:
            continue
        lines += [f"## {scenario}", "",
                  "| config | interactive TTFT p50 / p90 / p99 (ms) | realtime TTFT p50 / p90 / p99 (ms) | "
                  "interactive TPOT p50 (ms) | batch output tok/s | batch ÷ FCFS | errors | interactive ≤ SLO | "
                  "realtime ≤ SLO | batch ≥ 0.95× | all |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in measured:
            entry = p["scenarios"][scenario]
            classes, targets = entry["classes"], (p.get("targets") or {}).get(scenario, {})
            batch = classes.get("batch") or {}
            ratio = (targets.get("batch_vs_fcfs") or {}).get("value")
            interactive = classes.get("interactive")
            tpot = _ms(interactive["tpot_ms"].get("p50")) if interactive else "–"
            lines.append(
                f"| {p['label']} | {_triple(interactive)} | {_triple(classes.get('realtime'))} | {tpot} | "
                f"{_ms(batch.get('output_tokens_per_s'))} | {'–' if ratio is None else f'{ratio:.3f}'} | "
                f"{entry.get('errors_total', '–')} | {_mark(targets.get('interactive_ttft_p99_ms'))} | "
                f"{_mark(targets.get('realtime_ttft_p99_ms'))} | {_mark(targets.get('batch_vs_fcfs'))} | "
                f"{_mark({'met': targets.get('all_met')})} |")
        lines.append("")
    lines += ["## KV cache and prefix cache per lane", "",
              "| phase | lane | peak KV usage | peak running / waiting | KV capacity (tokens, engine) | "
              "kv_budget (tokens) | engine ÷ kv_budget | prefix hit rate (whole phase) |",
              "|---|---|---|---|---|---|---|---|"]
    for p in summary["phases"]:
        for lane, row in (p.get("lanes") or {}).items():
            usage = row.get("peak_kv_usage")
            ratio = row.get("kv_measured_over_budget")
            hit = row.get("prefix_cache_hit_rate")
            lines.append(
                f"| {p['label']} | {lane} | {'–' if usage is None else f'{usage * 100:.1f} %'} | "
                f"{row.get('peak_running', '–')} / {row.get('peak_waiting', '–')} | "
                f"{_ms(row.get('kv_capacity_tokens'))} | {_ms(row.get('kv_budget_tokens'))} | "
                f"{'–' if ratio is None else f'{ratio:.3f}'} | {'–' if hit is None else f'{hit * 100:.1f} %'} |")
    lines += ["", "kv_budget is run without `--reserve-gib`, so it is an upper bound: the engine also subtracts the "
              "activation peak and CUDA-graph memory it measures at start-up.", ""]
    by_scenario = [(p["label"], scenario, lane, rate) for p in summary["phases"]
                   for scenario, entry in p["scenarios"].items()
                   for lane, rate in (entry.get("prefix_hit_rate_by_lane") or {}).items()]
    if by_scenario:
        lines += ["## Prefix-cache hit rate per scenario (engine counters over the scenario's run)", "",
                  "| phase | scenario | lane | hit rate |", "|---|---|---|---|"]
        lines += [f"| {label} | {scenario} | {lane} | {'–' if rate is None else f'{rate * 100:.1f} %'} |"
                  for label, scenario, lane, rate in by_scenario]
        lines += ["", "Per class, the share of prompt tokens the engines reported as cached is in each scenario's "
                  "report (`prefix hit rate (cached ÷ prompt tokens)`).", ""]
    served = [(p["label"], lane, replica, by_class) for p in summary["phases"]
              for lane, row in (p.get("lanes") or {}).items()
              for replica, by_class in (row.get("served_by_replica") or {}).items()]
    if served:
        lines += ["## Requests served per replica (final stats, warm-ups included)", "",
                  "| phase | lane | replica | served by class |", "|---|---|---|---|"]
        lines += [f"| {label} | {lane} | {replica} | "
                  f"{', '.join(f'{k} {v}' for k, v in sorted(by_class.items())) or '–'} |"
                  for label, lane, replica, by_class in served]
        lines.append("")
    routed = [(p["label"], deployment, row) for p in summary["phases"]
              for deployment, row in (p.get("replica_routing") or {}).items()]
    if routed:
        lines += ["## Prefix-affinity routing (one Router replica, whole phase)", "",
                  "| phase | deployment | decision p50 / p99 (ms) | lookups | ok share | reasons | realtime reserve |",
                  "|---|---|---|---|---|---|---|"]
        for label, deployment, row in routed:
            share = row["lookups_ok_share"]
            lookups = ", ".join(f"{k} {v}" for k, v in sorted(row["lookups"].items())) or "–"
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(row["reasons"].items())) or "–"
            reserve = ", ".join(f"{k} {v}" for k, v in sorted((row.get("reserve_routing") or {}).items())) or "–"
            p50, p99 = row.get("p50_ms"), row.get("p99_ms")
            lines.append(f"| {label} | {deployment} | {'–' if p50 is None else f'{p50:.2f}'} / "
                         f"{'–' if p99 is None else f'{p99:.2f}'} | {lookups} | "
                         f"{'–' if share is None else f'{share * 100:.0f} %'} | {reasons} | {reserve} |")
        lines.append("")
    return "\n".join(lines)


def write_combined_reports(campaign: Path, out: Path) -> dict[str, Path]:
    """One load_tests report per scenario with every phase side by side (first measured lanes phase ÷ FCFS
    baseline as the ratios). Imported late: needs matplotlib and pydantic, which the summary tables do not."""
    from load_tests.client import RequestRecord
    from load_tests.report import RunResult, write_report
    from load_tests.scenario import parse_scenario

    written: dict[str, Path] = {}
    phase_dirs = ordered_phase_dirs(campaign)
    scenarios = sorted({p.parent.name for d in phase_dirs for p in d.glob("*/report.json")})
    for scenario_name in scenarios:
        runs, scenario = [], None
        for phase_dir in phase_dirs:
            report = _read_json(phase_dir / scenario_name / "report.json")
            if not report or not report.get("runs"):
                continue
            scenario = scenario or parse_scenario(report["scenario"])
            run = report["runs"][0]
            phase = _read_json(phase_dir / "phase.json") or {}
            runs.append(RunResult(label=phase_dir.name, target=phase.get("config", run.get("target", "")),
                                  started_at=run.get("started_at", ""), wall_s=run.get("wall_s") or 0.0,
                                  records=[RequestRecord(**r) for r in run.get("records", [])],
                                  error=run.get("error")))
        if not runs or scenario is None:
            continue
        lanes = [r for r in runs if not is_baseline(r.label) and not r.error]
        baseline = [r for r in runs if phase_name(r.label) == BASELINE_PHASE and not r.error]
        if lanes and baseline:  # ratios are first ÷ second
            first, second = lanes[0], baseline[0]
            runs = [first, second] + [r for r in runs if r is not first and r is not second]
        paths = write_report(scenario, runs, out / scenario_name)
        written[scenario_name] = paths["markdown"].parent
    return written


def write_campaign_summary(campaign: Path, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    summary = build_summary(campaign)
    paths = {"json": out / "summary.json", "markdown": out / "summary.md"}
    paths["json"].write_text(json.dumps(summary, indent=1, default=str), encoding="utf-8")
    paths["markdown"].write_text(render_summary_md(summary), encoding="utf-8")
    try:
        for name, folder in write_combined_reports(campaign, out).items():
            paths[f"report:{name}"] = folder
    except Exception as error:  # the tables above are written already; plots are a bonus
        print(f"combined report failed: {type(error).__name__}: {error}", file=sys.stderr)
    return paths


# --------------------------------------------------------------------------------------------------------------------
# Traced phases (TRACING=1): the config's copy writes every span to a file, for load_tests.ttft_breakdown
# --------------------------------------------------------------------------------------------------------------------


def traced_serve_config(config_text: str, spans_path: str) -> str:
    """The serve config with every application tracing every request to `spans_path` (JSON lines, written as each
    span ends: nothing is lost when the phase stops the app)."""
    import yaml

    document = yaml.safe_load(config_text)
    for application in document["applications"]:
        observability = application.setdefault("args", {}).setdefault("observability", {})
        observability["tracing"] = {"exporter": "file", "file_path": spans_path, "sample_ratio": 1.0}
    return yaml.safe_dump(document, sort_keys=False)


# CLI
# --------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.gpu_campaign", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ready = sub.add_parser("wait-ready")
    ready.add_argument("--url", required=True)
    ready.add_argument("--model", required=True)
    ready.add_argument("--timeout", type=float, default=420.0)
    ready.add_argument("--pid", type=int, help="the serve process: give up at once if it exits")
    ready.add_argument("--out", type=Path)
    smoke_parser = sub.add_parser("smoke")
    smoke_parser.add_argument("--url", required=True)
    smoke_parser.add_argument("--model", required=True)
    smoke_parser.add_argument("--out", type=Path, required=True)
    sample = sub.add_parser("sample-stats")
    sample.add_argument("--url", required=True)
    sample.add_argument("--out", type=Path, required=True)
    sample.add_argument("--interval", type=float, default=2.0)
    sample.add_argument("--max-samples", type=int)
    stats = sub.add_parser("stats")
    stats.add_argument("--url", required=True)
    stats.add_argument("--out", type=Path, required=True)
    traced = sub.add_parser("traced-config", help="a copy of a serve config that traces every request to a file")
    traced.add_argument("--config", type=Path, required=True)
    traced.add_argument("--spans", required=True, help="the span file the app appends to")
    traced.add_argument("--out", type=Path, required=True)
    summary_parser = sub.add_parser("summary")
    summary_parser.add_argument("--campaign", type=Path, required=True)
    summary_parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    if args.command == "wait-ready":
        try:
            marks = wait_ready(args.url, args.model, args.timeout, args.pid)
        except NotReady as error:
            print(f"NOT READY: {error}", file=sys.stderr)
            if args.out:
                args.out.write_text(json.dumps({"ready": False, "error": str(error)}, indent=1))
            return 1
        print(json.dumps(marks))
        if args.out:
            args.out.write_text(json.dumps({"ready": True, **marks}, indent=1))
        return 0
    if args.command == "smoke":
        result = smoke(args.url, args.model)
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps({"ok": result["ok"], "answer": result["chat"]["answer"],
                          "usage": result["chat"]["usage"], "stream": {k: result["stream"].get(k) for k in
                                                                      ("status", "token_chunks", "first_token_s")}}))
        return 0 if result["ok"] else 1
    if args.command == "sample-stats":
        sample_stats(args.url, args.out, args.interval, args.max_samples)
        return 0
    if args.command == "stats":
        status, payload = http_json("GET", args.url + "/v1/admin/stats", timeout_s=STATS_TIMEOUT_S)
        args.out.write_text(json.dumps(payload, indent=1, default=str))
        return 0 if status == 200 else 1
    if args.command == "traced-config":
        args.out.write_text(traced_serve_config(args.config.read_text(), args.spans))
        return 0
    paths = write_campaign_summary(args.campaign, args.out)
    print("summary: " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
