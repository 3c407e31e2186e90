"""The doctor's report: findings as text (grouped by flow) or as JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from app.tools.doctor.checks import exit_code
from app.tools.doctor.model import (
    FLOW_LONG_TAIL, FLOW_OOM, FLOW_THROUGHPUT, FLOW_TITLES, OK, PROBLEM, WARN, DoctorInputs, Finding,
)


def render_text(findings: list[Finding], inputs: DoctorInputs, header: str, profiling: list[str]) -> str:
    lines = [header]
    if inputs.notes:
        lines += ["not checked / notes:"] + [f"  - {note}" for note in inputs.notes]
    for flow in (FLOW_OOM, FLOW_THROUGHPUT, FLOW_LONG_TAIL):
        in_flow = [f for f in findings if f.flow == flow]
        lines += ["", f"== {FLOW_TITLES[flow]} =="]
        if not in_flow:
            lines.append("  (no data for this flow)")
        for f in in_flow:
            lines.append(f"{f.severity:<8} {f.check} [{f.subject}]: {f.summary}")
            lines.append(f"{'':<9}evidence: {f.evidence}")
            if f.action:
                lines.append(f"{'':<9}action:   {f.action}")
        if flow == FLOW_LONG_TAIL:
            lines += ["", "how to profile (nsys):"] + [f"  {line}" for line in profiling]
    counts = {s: sum(f.severity == s for f in findings) for s in (PROBLEM, WARN, OK)}
    lines += ["", f"summary: {counts[PROBLEM]} PROBLEM, {counts[WARN]} WARN, {counts[OK]} OK "
                  f"(exit {exit_code(findings)})"]
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "+Inf"
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def render_json(findings: list[Finding], inputs: DoctorInputs, url: str, metrics_url: str | None,
                profiling: list[str]) -> str:
    return json.dumps(_json_safe({
        "url": url,
        "metrics_url": metrics_url,
        "window_s": inputs.window_s,
        "max_model_len": inputs.max_model_len,
        "exit_code": exit_code(findings),
        "findings": [asdict(f) for f in findings],
        "notes": inputs.notes,
        "replicas": [asdict(r) for r in inputs.replicas],
        "profiling": profiling,
    }), indent=2)
