"""load_tests/vs_vllm.py's report: the figures it reads from each `vllm bench serve` result, the ratios the project
targets, and the Markdown page."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The figures compared, as (label, the bench result's key).
FIGURES = (("TTFT p50", "median_ttft_ms"), ("TTFT p99", "p99_ttft_ms"), ("TPOT p50", "median_tpot_ms"),
           ("ITL p50", "median_itl_ms"), ("E2E p50", "median_e2el_ms"))
# The ratios the project targets (app ÷ vLLM's server, lower is better), per app config file name.
TARGETS = {"baseline-local.yaml": {"median_ttft_ms": 1.2, "median_tpot_ms": 1.2},
           "local.yaml": {"median_ttft_ms": 2.0, "p99_ttft_ms": 2.0}}
# The ratios targeted against Ray Serve LLM on the same engine and proxy (app ÷ Ray Serve LLM).
SERVE_LLM_TARGETS = {"baseline-local.yaml": {"median_ttft_ms": 1.0, "p99_ttft_ms": 1.0, "median_tpot_ms": 1.0}}


def render_markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = ["# The app against vLLM's own OpenAI server", "",
             f"`vllm bench serve`, openai-chat, random {settings['input_len']} in / {settings['output_len']} out, "
             f"{settings['num_prompts']} prompts at {settings['request_rate']} req/s, {settings['runs']} run(s) per "
             f"target, targets one after the other on one machine ({report['when']}). Each vLLM server gets the "
             f"engine arguments of a config's hot lane:", ""]
    lines += [f"- {target['name']}: `{' '.join(target['server_flags'])}`" for target in report["targets"]
              if target.get("server_flags")]
    lines += [f"- {target['name']}: Ray Serve LLM's OpenAI app, `LLMConfig` `{json.dumps(target['llm_config'])}`"
              for target in report["targets"] if target.get("llm_config")]
    lines.append("")
    if report.get("autogroup"):
        lines += ["**The kernel's autogroup scheduling was on**: the figures include its distortion "
                  "(load_tests/README.md).", ""]
    header = ("| target | " + " | ".join(f"{label} (ms)" for label, _ in FIGURES)
              + " | output tok/s | completed / failed |")
    lines += [header, "|" + "---|" * (len(FIGURES) + 3)]
    for target in report["targets"]:
        s = target["summary"]
        cells = " | ".join(f"{s[key]:.1f}" for _, key in FIGURES)
        per_run = " · ".join(f"{run['median_ttft_ms']:.1f}/{run['p99_ttft_ms']:.1f}" for run in target["runs"])
        lines.append(f"| {target['name']} (TTFT p50/p99 per run: {per_run}) | {cells} | "
                     f"{s['output_throughput']:.0f} | {s['completed']} / {s['failed']} |")
    lines += saturation_table(report["targets"])
    lines += ["", "Ratios to vLLM's server (medians of the runs; lower is better; the target where one is set):", ""]
    lines += ratio_table(report["targets"], "ratios", "compared_with", TARGETS)
    if any("ratios_serve_llm" in target for target in report["targets"]):
        lines += ["", "Ratios to Ray Serve LLM on the same engine arguments (medians of the runs; lower is better; "
                  "the target where one is set):", ""]
        lines += ratio_table(report["targets"], "ratios_serve_llm", "compared_with_serve_llm", SERVE_LLM_TARGETS)
    for target in report["targets"]:
        profile = target.get("profile")
        if not profile:
            continue
        cores = ", ".join(f"{label} {value:.2f}" for label, value in profile["cores_by_process"].items())
        lines += ["", f"## Profile: {target['name']} (an extra run, py-spy on)", "",
                  f"CPU cores by process: {cores}.", ""]
        for process, functions in profile["top_functions"].items():
            lines += [f"{process} (flame graph: `profile/{target['name']}-{process}.svg`), share of the samples "
                      "holding the GIL:", "",
                      "| function | own | on the stack |", "|---|---|---|"]
            lines += [f"| `{name}` | {own:.1%} | {anywhere:.1%} |" for name, own, anywhere in functions]
            lines.append("")
    return "\n".join(lines) + "\n"


def ratio_table(targets: list[dict[str, Any]], ratios_key: str, compared_key: str,
                goals: dict[str, dict[str, float]]) -> list[str]:
    """Markdown rows: each target that has `ratios_key` over the target named by `compared_key`, each ratio judged
    against the goal set for the target's config file name."""
    lines = ["| target | " + " | ".join(label for label, _ in FIGURES) + " |", "|" + "---|" * (len(FIGURES) + 1)]
    for target in targets:
        if ratios_key not in target:
            continue
        goal = goals.get(Path(target["config"]).name, {})
        cells = []
        for _, key in FIGURES:
            value = target[ratios_key].get(key)
            text = "–" if value is None else f"{value:.2f}"
            if value is not None and key in goal:
                text += f" (≤ {goal[key]}: {'yes' if value <= goal[key] else 'no'})"
            cells.append(text)
        lines.append(f"| {target['name']} ÷ {target[compared_key]} | " + " | ".join(cells) + " |")
    return lines


def saturation_table(targets: list[dict[str, Any]]) -> list[str]:
    """Markdown rows: each target's requests/s in its saturation run, and an app's over the targets it is compared
    with (higher is better)."""
    measured = {target["name"]: target["saturation"] for target in targets if "saturation" in target}
    if not measured:
        return []
    concurrency = next(iter(measured.values()))["concurrency"]
    lines = ["", f"Requests/s at saturation (every request sent at once, {concurrency} in flight; higher is better):",
             "", "| target | req/s | output tok/s | completed / failed | ÷ vLLM's server | ÷ Ray Serve LLM |",
             "|---|---|---|---|---|---|"]
    for target in targets:
        figures = measured.get(target["name"])
        if figures is None:
            continue
        over = []
        for key in ("compared_with", "compared_with_serve_llm"):
            other = measured.get(target.get(key, ""))
            over.append(f"{figures['request_throughput'] / other['request_throughput']:.2f}"
                        if other and other["request_throughput"] else "–")
        lines.append(f"| {target['name']} | {figures['request_throughput']:.1f} | {figures['output_throughput']:.0f} "
                     f"| {figures['completed']} / {figures['failed']} | {over[0]} | {over[1]} |")
    return lines
