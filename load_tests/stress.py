"""The interactive promise under stress, one command and one report: retry storms of naive and polite clients, and
kill -9 of each lane replica and of one of two Router replicas under load.

    python -m load_tests.stress --serve-config serve_configs/local.yaml --out load_tests/results/stress

Scenarios, each on an app of its own started and stopped by the tool that drives it (`--scenarios` picks some):
- `storm-naive`: `load_tests.overload` (light traffic, a quiet spell, then `--interactive` interactive and `--flex`
  flex streaming clients for `--burst-s` s from two client processes), each refused client sending the same request
  again 0.2 s after the refusal without waiting for its Retry-After, as retry loops do;
- `storm-polite`: the same, each refused client waiting the Retry-After;
- `storm-flood`: the same, each refused client sending a new request at once (no retry of the refused one, so the
  proxy's replay of refusals, app/router/refusal_replay.py, never answers it);
- `fuzz-under-load`: `load_tests.fuzz_load`, the fuzz corpus of tests/hostile_requests.py sent idle and again while
  60 interactive streams fill the hot lane: no request that is a 4xx idle may be a 429 under load;
- `kills`: `load_tests.chaos` on the config with two Router replicas, `--chaos-interactive` interactive and
  `--chaos-flex` flex streams and a batch, killing the HotLane, the ColdLane and then one Router replica in turn.

The report (`report.md`, `report.json`) gives per scenario, or per kill: the admitted interactive TTFT p50 / p99 at
the client; for the storms, the share of the stats samples in which a Router held interactive requests that had the
hot engines running some (`/v1/admin/stats` every `--sample-interval` s), the refusals per second and the client
processes' own CPU waits; for the kills, the interactive requests sent while the replacement started and how many
were answered, the streams under way at the kill and how many finished without an error event; and every failure by
class (HTTP status, or `stream` for an error event mid-stream). Each tool's own report is kept beside it
(`<scenario>/report.md`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from load_tests.overload import REPLAYED_HEADER
from load_tests.report import _num

SCENARIOS = ("storm-naive", "storm-polite", "storm-flood", "fuzz-under-load", "kills")
NAIVE_RETRY_S = 0.2  # a naive retry loop's pause after a 429
KILLS = "HotLane,ColdLane,Router"


def scenario_command(name: str, args: argparse.Namespace, out: Path) -> list[str]:
    """The tool and arguments that run one scenario."""
    python = [sys.executable, "-m"]
    sets = [item for value in args.overrides for item in ("--set", value)]
    if name.startswith("storm-"):
        command = [*python, "load_tests.overload", "--serve-config", args.serve_config, "--out", str(out),
                   "--interactive", str(args.interactive), "--flex", str(args.flex), "--burst-s", str(args.burst_s),
                   "--sample-interval", str(args.sample_interval), *sets]
        return command + {"storm-naive": ["--resend-refused-after", str(NAIVE_RETRY_S)],
                          "storm-flood": ["--no-wait-on-refusal"]}.get(name, [])
    if name == "fuzz-under-load":
        return [*python, "load_tests.fuzz_load", "--serve-config", args.serve_config, "--out", str(out), *sets]
    return [*python, "load_tests.chaos", "--serve-config", args.serve_config, "--out", str(out),
            "--interactive", str(args.chaos_interactive), "--flex", str(args.chaos_flex),
            "--batch-lines", str(args.batch_lines), "--kill", KILLS, "--set", "router.num_replicas=2", *sets]


def storm_row(name: str, report: dict[str, Any]) -> dict[str, Any]:
    """A storm's figures from load_tests.overload's report."""
    head = report["headline"]
    burst = report["phases"].get("burst") or {}
    classes = burst.get("classes") or {}
    window_s = burst.get("window_s") or report["settings"].get("burst_s")
    held = head.get("samples_interactive_held") or 0
    idle = head.get("samples_held_while_hot_running_none") or 0
    waiting = head.get("samples_waiting_for_hot_slot") or 0
    waiting_idle = head.get("samples_waiting_for_hot_slot_while_hot_running_none") or 0
    refusals = sum(c.get("rejected_429") or 0 for c in classes.values())
    replayed = sum(1 for record in (report.get("records") or {}).get("burst") or []
                   if record.get("status") == 429 and (record.get("headers") or {}).get(REPLAYED_HEADER))
    failures = {("flex" if cls == "batch" else cls): dict(c.get("other_errors") or {}) for cls, c in classes.items()}
    return {
        "scenario": name,
        "interactive_ttft_p50_ms": head.get("interactive_ttft_p50_ms"),
        "interactive_ttft_p99_ms": head.get("interactive_ttft_p99_ms"),
        "interactive_admitted": head.get("interactive_admitted"),
        "interactive_tpot_p50_ms": head.get("interactive_tpot_p50_ms"),
        "interactive_tpot_p99_ms": head.get("interactive_tpot_p99_ms"),
        "samples_router_held_interactive": held,
        "hot_running_while_held_share": round((held - idle) / held, 3) if held else None,
        "samples_waiting_for_hot_slot": waiting,
        "hot_running_while_waiting_share": round((waiting - waiting_idle) / waiting, 3) if waiting else None,
        "refusals_per_s": round(refusals / window_s, 1) if window_s else None,
        "refusals_replayed_share": round(replayed / refusals, 3) if refusals else None,
        "server_errors_5xx": head.get("server_errors_5xx"),
        "failures": failures,
        "client_cpu": (report["settings"].get("generators") or {}).get("burst"),
        "autogroup": report["settings"].get("autogroup"),
    }


def fuzz_row(report: dict[str, Any]) -> dict[str, Any]:
    """The fuzz corpus's figures from load_tests.fuzz_load's report."""
    result = report["result"]
    return {"scenario": "fuzz-under-load", "fuzz_requests": result["requests"],
            "client_error_idle_429_loaded": result["client_error_idle_429_loaded"],
            "ok_idle_429_loaded": result["ok_idle_429_loaded"], "other_changes": result["other_changes"],
            "slots_full": report["slots_full_before"], "server_errors_5xx": result["server_errors"]["loaded"]}


def kill_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per kill from load_tests.chaos's report."""
    rows = []
    for kill in report["kills"]:
        down = kill.get("interactive_while_down") or {}
        ttft = down.get("ttft_ms") or {}
        failures = {("flex" if cls == "batch" else cls): errors for cls, errors in kill["errors"].items()}
        rows.append({
            "scenario": f"kill -9 {kill['deployment']}",
            "interactive_ttft_p50_ms": ttft.get("p50"),
            "interactive_ttft_p99_ms": ttft.get("p99"),
            "interactive_sent_while_down": down.get("sent"),
            "interactive_answered_while_down": down.get("answered"),
            "replacement_running_s": kill.get("replaced_s"),
            "back_on_hot_s": kill.get("interactive_back_on_hot_s"),
            "streams_under_way": down.get("under_way_at_kill"),
            "streams_under_way_finished": down.get("under_way_finished"),
            "failures": failures,
            "server_errors_5xx": sum(n for errors in kill["errors"].values() for key, n in errors.items()
                                     if key.isdigit() and int(key) >= 500),
        })
    return rows


def _share(share: float | None) -> str:
    return "–" if share is None else f"{share * 100:.0f} %"


def _failures(failures: dict[str, dict[str, int]]) -> str:
    shown = [f"{cls} {key}: {n}" for cls, errors in failures.items() for key, n in sorted(errors.items())]
    return ", ".join(shown) or "none"


def render_markdown(report: dict[str, Any]) -> str:
    lines = [f"# Stress: `{report['serve_config']}`", ""]
    storms = [row for row in report["rows"] if "refusals_per_s" in row]
    fuzz = [row for row in report["rows"] if "fuzz_requests" in row]
    kills = [row for row in report["rows"] if "replacement_running_s" in row]
    if storms:
        lines += ["| scenario | admitted interactive TTFT p50 / p99 (ms) | their TPOT p50 / p99 (ms) | admitted | "
                  "samples with interactive held by a Router (admitted, before their first token, or waiting for a "
                  "hot slot): hot engines running some | of them with some waiting for a hot slot: hot engines "
                  "running some | refusals/s (replayed by the proxy) | 5xx | other failures | client processes on a "
                  "CPU / waiting (s per s) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for row in storms:
            share = row["hot_running_while_held_share"]
            cpu = ", ".join(f"{u['on_cpu_per_s']:.2f} / {u['runqueue_wait_per_s']:.2f}"
                            for u in row.get("client_cpu") or [] if u) or "–"
            lines.append(f"| {row['scenario']} | {_num(row['interactive_ttft_p50_ms'], 0)} / "
                         f"{_num(row['interactive_ttft_p99_ms'], 0)} | {_num(row.get('interactive_tpot_p50_ms'), 1)} / "
                         f"{_num(row.get('interactive_tpot_p99_ms'), 1)} | {_num(row['interactive_admitted'], 0)} | "
                         f"{_share(share)} of {row['samples_router_held_interactive']} | "
                         f"{_share(row.get('hot_running_while_waiting_share'))} of "
                         f"{row.get('samples_waiting_for_hot_slot', 0)} | {_num(row['refusals_per_s'], 1)} "
                         f"({_share(row.get('refusals_replayed_share'))}) | "
                         f"{_num(row['server_errors_5xx'], 0)} | {_failures(row['failures'])} | {cpu} |")
        autogroup = {row["autogroup"] for row in storms}
        lines += ["", "The kernel's autogroup scheduling: " + ", ".join(
            "on" if a else ("off" if a is False else "unknown") for a in autogroup) + " (load_tests/README.md).", ""]
    for row in fuzz:
        changes = ", ".join(f"{change}: {n}" for change, n in row["other_changes"].items()) or "none"
        lines += ["| fuzz corpus | requests | a 4xx idle, 429 under load | a 200 idle, 429 under load | other "
                  "changes | hot slots full as it began | 5xx or no answer under load |",
                  "|---|---|---|---|---|---|---|",
                  f"| under load | {row['fuzz_requests']} | **{row['client_error_idle_429_loaded']}** | "
                  f"{row['ok_idle_429_loaded']} | {changes} | {'yes' if row['slots_full'] else 'no'} | "
                  f"{row['server_errors_5xx']} |", ""]
    if kills:
        lines += ["| kill | interactive sent until the replacement ran | answered | TTFT p50 / p99 (ms) | replacement "
                  "RUNNING (s) | interactive back on the hot lane after it (s) | streams under way: finished | 5xx | "
                  "failures |", "|---|---|---|---|---|---|---|---|---|"]
        for row in kills:
            lines.append(f"| {row['scenario']} | {_num(row['interactive_sent_while_down'], 0)} | "
                         f"{_num(row['interactive_answered_while_down'], 0)} | "
                         f"{_num(row['interactive_ttft_p50_ms'], 0)} / {_num(row['interactive_ttft_p99_ms'], 0)} | "
                         f"{_num(row['replacement_running_s'], 1)} | {_num(row.get('back_on_hot_s'), 1)} | "
                         f"{_num(row['streams_under_way_finished'], 0)} of {_num(row['streams_under_way'], 0)} | "
                         f"{_num(row['server_errors_5xx'], 0)} | {_failures(row['failures'])} |")
        lines.append("")
    lines += ["Each scenario's own report: " + ", ".join(f"`{name}/report.md`" for name in report["scenarios"]), ""]
    return "\n".join(lines)


def build_report(serve_config: str, out: Path, scenarios: list[str]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for name in scenarios:
        path = out / name / "report.json"
        if not path.exists():
            rows.append({"scenario": name, "missing": str(path)})
            continue
        report = json.loads(path.read_text(encoding="utf-8"))
        rows.extend(kill_rows(report) if name == "kills" else [fuzz_row(report)] if name == "fuzz-under-load"
                    else [storm_row(name, report)])
    return {"serve_config": serve_config, "scenarios": scenarios, "rows": [r for r in rows if "missing" not in r],
            "missing": [r for r in rows if "missing" in r]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-config", required=True, help="a full serve config (not an overlay)")
    parser.add_argument("--out", required=True, help="directory for report.md, report.json and each scenario's")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"some of {','.join(SCENARIOS)}")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the app's args (dotted path without `args.`, YAML value)")
    parser.add_argument("--interactive", type=int, default=160, help="interactive streams in a storm")
    parser.add_argument("--flex", type=int, default=16, help="flex streams in a storm")
    parser.add_argument("--burst-s", type=float, default=40.0, help="seconds a storm lasts")
    parser.add_argument("--sample-interval", type=float, default=1.0, help="seconds between stats samples")
    parser.add_argument("--chaos-interactive", type=int, default=4, help="interactive streams during the kills")
    parser.add_argument("--chaos-flex", type=int, default=2, help="flex streams during the kills")
    parser.add_argument("--batch-lines", type=int, default=100, help="lines of the batch during the kills")
    parser.add_argument("--rebuild", action="store_true", help="only rebuild the report from the scenarios' reports")
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"--scenarios: {', '.join(unknown)} is not one of {', '.join(SCENARIOS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    status = 0
    if not args.rebuild:
        for name in scenarios:
            command = scenario_command(name, args, out / name)
            print(f"[stress] {name}: {' '.join(command)}", flush=True)
            status = subprocess.run(command).returncode or status
    report = build_report(args.serve_config, out, scenarios)
    (out / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    (out / "report.md").write_text(render_markdown(report), encoding="utf-8")
    print((out / "report.md").read_text(encoding="utf-8"))
    if report["missing"]:
        print(f"[stress] no report from: {', '.join(r['scenario'] for r in report['missing'])}", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
