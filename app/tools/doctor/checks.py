"""All of the doctor's checks in report order, and the exit code their findings give."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from app.tools.doctor.checks_long_tail import (
    check_latency_tails, check_realtime_reserve, check_slowest_traces, check_tail_breakdown, check_ttft_hops,
)
from app.tools.doctor.checks_oom import (
    check_batched_tokens, check_kv_pressure, check_long_context_degrades, check_prompt_lengths,
)
from app.tools.doctor.checks_throughput import (
    check_admission_queue, check_batch_backlog, check_breakers, check_replica_scheduler, check_request_outcomes,
    check_routing_balance,
)
from app.tools.doctor.model import PROBLEM, DoctorInputs, Finding


CHECKS: tuple[Callable[[DoctorInputs], list[Finding]], ...] = (
    check_prompt_lengths,
    check_long_context_degrades,
    check_batched_tokens,
    check_kv_pressure,
    check_replica_scheduler,
    check_routing_balance,
    check_request_outcomes,
    check_admission_queue,
    check_batch_backlog,
    check_breakers,
    check_latency_tails,
    check_tail_breakdown,
    check_slowest_traces,
    check_realtime_reserve,
    check_ttft_hops,
)


def run_checks(inputs: DoctorInputs) -> list[Finding]:
    findings: list[Finding] = []
    for check in CHECKS:
        findings.extend(check(inputs))
    return findings


def exit_code(findings: Iterable[Finding]) -> int:
    return 1 if any(f.severity == PROBLEM for f in findings) else 0
