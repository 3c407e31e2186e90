"""Preflight: the tuning guide's deployment checklist, checked on this machine.

    python -m app.tools.preflight [--serve-config serve_configs/prod.yaml] [--p99-ms 450] [--json]

Each line is PASS / WARN / FAIL / SKIP with the measured value: GPU architecture consistency, NVLink inside each TP
group, host<->device bandwidth (timed pinned copies), CUDA >= 12.1, Triton matching the installed vLLM / torch,
FlashAttention, driver version, and from the serve config: health-check period < 5 s, request timeout > 3 x P99, the
MPS daemon behind CUDA_MPS_* settings, and CUDA graphs covering the hot lane's prefills.
Without a GPU the GPU lines are SKIP with the reason and the rest is still checked. Exit code 1 only when a line is
FAIL (with --strict also on WARN).

The checks are pure functions of a `Readings` record; `gather_readings` is the only code that touches the machine.
"""


from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from app.tools.preflight.checks import _no_gpu, exit_code, run_checks
from app.tools.preflight.gather import gather_readings
from app.tools.preflight.readings import BANDWIDTH_COPY_BYTES, MIN_HOST_DEVICE_GBPS, Check


def format_checks(checks: list[Check]) -> str:
    width = max(len(check.name) for check in checks)
    lines = []
    for check in checks:
        line = f"{check.status:<4}  {check.name:<{width}}  {check.value}"
        lines.append(line + (f"\n      {'':<{width}}  -> {check.detail}" if check.detail else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.tools.preflight", description=__doc__.splitlines()[0])
    parser.add_argument("--serve-config", help="serve config YAML: health checks, request timeout, hot-lane TP")
    parser.add_argument("--app", help="application name in the serve config (default: the first)")
    parser.add_argument("--tp", type=int, help="TP group size for the NVLink check (default: hot lane's, else 2)")
    parser.add_argument("--request-timeout-s", type=float, help="request timeout, if not in the serve config")
    parser.add_argument("--p99-ms", type=float, help="measured P99 latency (e.g. from the load test report)")
    parser.add_argument("--min-bandwidth-gbps", type=float, default=MIN_HOST_DEVICE_GBPS)
    parser.add_argument("--copy-mib", type=int, default=BANDWIDTH_COPY_BYTES // 1024**2)
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the timed copies")
    parser.add_argument("--strict", action="store_true", help="exit 1 on WARN too")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    readings = gather_readings(
        serve_config=args.serve_config, app_name=args.app, tensor_parallel_size=args.tp,
        request_timeout_s=args.request_timeout_s, p99_ms=args.p99_ms, bandwidth=not args.no_bandwidth,
        copy_bytes=args.copy_mib * 1024**2,
    )
    checks = run_checks(readings, args.min_bandwidth_gbps)
    code = exit_code(checks, args.strict)
    if args.json:
        print(json.dumps({
            "checks": [asdict(c) for c in checks], "readings": asdict(readings), "exit_code": code,
            "seconds": round(time.perf_counter() - started, 2),
        }, indent=2, default=str))
    else:
        if not readings.has_gpu:
            print(
                f"preflight: {_no_gpu(readings)} ({readings.no_gpu_reason or 'none found'}); GPU checks are SKIP, "
                "the rest is checked\n"
            )
        print(format_checks(checks))
    return code

