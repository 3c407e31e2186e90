"""Write a run's report: report.json (raw records + summaries), report.md (tables side by side), PNG plots."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from load_tests import host  # noqa: E402
from load_tests.client import RequestRecord  # noqa: E402
from load_tests.scenario import Scenario  # noqa: E402
from load_tests.stats import compare, summarize, throughput_series  # noqa: E402

THROUGHPUT_BIN_S = 1.0


@dataclass
class RunResult:
    """One config's run of the scenario."""

    label: str
    target: str  # the URL, or the serve config that was started
    started_at: str  # ISO time
    wall_s: float = 0.0
    records: list[RequestRecord] = field(default_factory=list)
    error: str | None = None  # set when the run could not happen (app failed to start...)
    # The generator's event-loop thread over the run (load_tests.host.usage): CPU time and run-queue wait, and
    # whether the kernel's autogroup scheduling was on.
    generator: dict[str, float | bool | None] | None = None
    # Unix time the measured part began (after the warm-up requests): span files and server logs are cut here.
    measured_from_unix: float | None = None


def build_report(scenario: Scenario, runs: list[RunResult]) -> dict[str, Any]:
    summaries = [summarize(run.records, scenario.slo, scenario.tally_headers) for run in runs]
    report: dict[str, Any] = {
        "scenario": scenario.model_dump(mode="json"),
        "runs": [
            {
                "label": run.label,
                "target": run.target,
                "started_at": run.started_at,
                "wall_s": run.wall_s,
                "measured_from_unix": run.measured_from_unix,
                "error": run.error,
                "generator": run.generator,
                "summary": summary,
                "records": [record.to_json() for record in run.records],
            }
            for run, summary in zip(runs, summaries)
        ],
    }
    usable = [(run, s) for run, s in zip(runs, summaries) if run.error is None]
    if len(usable) >= 2:
        (first, s1), (second, s2) = usable[:2]
        report["comparison"] = {"first": first.label, "second": second.label, "ratios": compare(s1, s2)}
    return report


def write_report(scenario: Scenario, runs: list[RunResult], out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(scenario, runs)
    paths = {
        "json": out / "report.json",
        "markdown": out / "report.md",
        "latency_cdf": out / "latency_cdf.png",
        "throughput": out / "throughput.png",
    }
    paths["json"].write_text(json.dumps(report, indent=1), encoding="utf-8")
    paths["markdown"].write_text(render_markdown(report), encoding="utf-8")
    plot_latency_cdf(runs, paths["latency_cdf"])
    plot_throughput(runs, paths["throughput"])
    return paths


# --------------------------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------------------------


def _num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


CLASS_ROWS: list[tuple[str, Any]] = [
    ("requests (ok / sent)", lambda s: f"{s['ok']} / {s['requests']}"),
    ("errors", lambda s: ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"),
    ("TTFT p50 / p90 / p99 (ms)", lambda s: " / ".join(_num(s["ttft_ms"][f"p{q}"]) for q in (50, 90, 99))),
    ("TPOT p50 / p99 (ms)", lambda s: " / ".join(_num(s["tpot_ms"][f"p{q}"], 2) for q in (50, 99))),
    ("ITL p50 / p99 (ms)", lambda s: " / ".join(_num(s["itl_ms"][f"p{q}"], 2) for q in (50, 99))),
    ("E2E p50 / p90 / p99 (ms)", lambda s: " / ".join(_num(s["e2e_ms"][f"p{q}"]) for q in (50, 90, 99))),
    ("load generator send lag p50 / p99 (ms)", lambda s: _send_lag(s.get("send_lag_ms"))),
    ("output tokens", lambda s: _num(s["output_tokens"])),
    ("output tokens/s", lambda s: _num(s["output_tokens_per_s"])),
    ("requests/s (ok)", lambda s: _num(s["requests_per_s"], 2)),
    ("prefix hit rate (cached ÷ prompt tokens)", lambda s: _num(s.get("prefix_hit_rate"), 3)),
    ("goodput (fraction within SLO)", lambda s: _goodput(s["goodput"])),
]


# Open-loop arrivals sent later than this at p99 mean the generator, not only the app, shaped the latencies.
SEND_LAG_WARN_MS = 50.0


def _send_lag(lag: dict[str, Any] | None) -> str:
    if not lag or not lag.get("count"):
        return "– (closed loop)"
    text = f"{_num(lag['p50'])} / {_num(lag['p99'])}"
    return text + (" **(generator fell behind)**" if lag["p99"] > SEND_LAG_WARN_MS else "")


def _goodput(goodput: dict[str, Any]) -> str:
    if goodput["fraction"] is None:
        return "–"
    slo = ", ".join(f"{k} ≤ {v:g}" for k, v in goodput["slo"].items()) or "no SLO"
    return f"{goodput['fraction'] * 100:.1f} % ({goodput['good']}; {slo})"


def _generator(usage: dict[str, float | bool | None] | None) -> str:
    if not usage:
        return "–"
    return f"{usage['on_cpu_per_s']:.2f} / {usage['runqueue_wait_per_s']:.2f}"


def render_markdown(report: dict[str, Any]) -> str:
    scenario = report["scenario"]
    runs = report["runs"]
    lines = [f"# Load test: {scenario['name']}", ""]
    if scenario.get("description"):
        lines += [scenario["description"].strip(), ""]
    lines += ["| config | target | started | wall (s) | load generator on a CPU / waiting for one (s per s) | status |",
              "|---|---|---|---|---|---|"]
    for run in runs:
        status = f"failed: {run['error']}" if run["error"] else "ok"
        lines.append(f"| {run['label']} | `{run['target']}` | {run['started_at']} | {_num(run['wall_s'])} | "
                     f"{_generator(run.get('generator'))} | {status} |")
    lines += ["", "The load generator's share of the host: its event loop's CPU time and the time it was runnable "
              "but waited for a CPU, per second of the run. Waiting near or above its CPU time means the host, not "
              "the app, delayed the sends and the measured latencies.", ""]
    if any((run.get("generator") or {}).get("autogroup") for run in runs):
        lines += [f"**The kernel's autogroup scheduling was on** (`{host.AUTOGROUP_SWITCH}` = 1): the CPU is shared "
                  "between sessions before nice values count, so the app's Ray workers (niceness 15) compete with "
                  "the load generator as equals. On a host with few cores, turn it off as root "
                  f"(`echo 0 > {host.AUTOGROUP_SWITCH}`) or run the generator on another host.", ""]

    comparison = report.get("comparison")
    if comparison:
        first, second, ratios = comparison["first"], comparison["second"], comparison["ratios"]
        lines += [f"## Ratios: {first} ÷ {second}", ""]
        headline = []
        if "interactive" in ratios:
            headline.append(f"- interactive TTFT p50: **{_ratio(ratios['interactive']['ttft_p50'])}**, "
                            f"p99: **{_ratio(ratios['interactive']['ttft_p99'])}**")
        if "batch" in ratios:
            headline.append(f"- batch output throughput: **{_ratio(ratios['batch']['output_tokens_per_s'])}**")
        lines += headline + ([""] if headline else [])
        lines += ["| class | TTFT p50 | TTFT p99 | E2E p99 | output tokens/s | prefix hit rate | goodput |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in ratios.items():
            lines.append(
                f"| {name} | {_ratio(r['ttft_p50'])} | {_ratio(r['ttft_p99'])} | {_ratio(r['e2e_p99'])} | "
                f"{_ratio(r['output_tokens_per_s'])} | {_ratio(r.get('prefix_hit_rate'))} | "
                f"{_ratio(r['goodput_fraction'])} |"
            )
        lines.append("")

    measured = [run for run in runs if not run["error"]]
    class_names = [
        c for c in ("realtime", "interactive", "batch") if any(c in r["summary"]["classes"] for r in measured)
    ]
    for name in class_names:
        lines += [f"## {name}", "", "| metric | " + " | ".join(r["label"] for r in measured) + " |",
                  "|---|" + "---|" * len(measured)]
        for title, cell in CLASS_ROWS:
            cells = [
                cell(r["summary"]["classes"][name]) if name in r["summary"]["classes"] else "–" for r in measured
            ]
            lines.append(f"| {title} | " + " | ".join(cells) + " |")
        lines.append("")
        headers = scenario.get("tally_headers") or []
        for header in headers:
            per_run = []
            for r in measured:
                if name in r["summary"]["classes"]:
                    counts = r["summary"]["classes"][name]["headers"].get(header, {})
                    per_run.append(f"{r['label']}: " + (", ".join(f"{v}={n}" for v, n in counts.items()) or "–"))
            lines.append(f"`{header}`: " + "; ".join(per_run))
        if headers:
            lines.append("")
    lines += [
        "Plots: `latency_cdf.png` (TTFT and E2E CDF per class), `throughput.png` (output tokens/s over time).",
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------------------------


def _classes(runs: list[RunResult]) -> list[str]:
    present = {r.request_class for run in runs for r in run.records}
    return [c for c in ("realtime", "interactive", "batch") if c in present] or ["interactive"]


def plot_latency_cdf(runs: list[RunResult], path: Path) -> None:
    """One column per class; TTFT on top, E2E below; one line per config."""
    classes = _classes(runs)
    fig, axes = plt.subplots(2, len(classes), figsize=(5 * len(classes), 7), squeeze=False)
    for col, name in enumerate(classes):
        for row, (metric, label) in enumerate((("ttft_s", "TTFT"), ("e2e_s", "E2E"))):
            ax = axes[row][col]
            for run in runs:
                values = sorted(getattr(r, metric) * 1000 for r in run.records
                                if r.request_class == name and r.ok and getattr(r, metric) is not None)
                if values:
                    # Start the curve at 0 on the first value, so even one sample draws a visible step.
                    fractions = [0.0] + [(i + 1) / len(values) for i in range(len(values))]
                    ax.step([values[0]] + values, fractions, where="post", label=run.label)
            ax.set_title(f"{name}: {label}")
            ax.set_xlabel("ms")
            ax.set_ylabel("fraction of requests ≤ x")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_throughput(runs: list[RunResult], path: Path) -> None:
    """One panel per config; one line per class: output tokens/s over time."""
    fig, axes = plt.subplots(len(runs) or 1, 1, figsize=(10, 3.2 * max(1, len(runs))), squeeze=False)
    for row, run in enumerate(runs):
        ax = axes[row][0]
        for name, (times, rates) in throughput_series(run.records, THROUGHPUT_BIN_S).items():
            ax.plot(times, rates, label=name)
        ax.set_title(f"{run.label}: output tokens/s" + (f" (failed: {run.error})" if run.error else ""))
        ax.set_xlabel("s since start")
        ax.set_ylabel("tokens/s")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
