"""Preflight: the tuning guide's deployment checklist, checked where the GPUs are.

    python -m app.tools.preflight [--serve-config serve_configs/prod.yaml] [--p99-ms 450] [--json]
    python -m app.tools.preflight --cluster --serve-config serve_configs/prod.yaml   # from a cluster's head

Each line is PASS / WARN / FAIL / SKIP (does not apply) / UNCHECKED (applies, could not be checked) with the measured
value: GPU architecture consistency, NVLink inside each TP group, host<->device bandwidth (timed pinned copies),
CUDA >= 12.1, Triton matching the installed vLLM / torch, FlashAttention, driver version, the MPS daemon behind
CUDA_MPS_* settings, and from the serve config: health-check period < 5 s, request timeout > 3 x P99, CUDA graphs
covering the hot lane's prefills.
Without a GPU the GPU lines are UNCHECKED (SKIP for a `device: cpu` serve config) and the rest is still checked.
--cluster runs the GPU lines as a Ray task on every GPU node of the running cluster (app.tools.preflight.cluster).
Exit code 1 when a line is FAIL (with --strict also on WARN), else 2 when a line is UNCHECKED (unless
--allow-unchecked), else 0.

The checks are pure functions of a `Readings` record; `gather_readings` is the only code that touches the machine.
"""


from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from app.tools.preflight.checks import (
    _no_gpu, exit_code, gpu_item_status, run_checks, run_config_checks, run_gpu_checks,
)
from app.tools.preflight.gather import gather_readings
from app.tools.preflight.readings import BANDWIDTH_COPY_BYTES, MIN_HOST_DEVICE_GBPS, Check, Readings


def format_checks(checks: list[Check]) -> str:
    width = max(len(check.name) for check in checks)
    lines = []
    status_width = max(len(check.status) for check in checks)
    for check in checks:
        line = f"{check.status:<{status_width}}  {check.name:<{width}}  {check.value}"
        lines.append(line + (f"\n{'':<{status_width}}  {'':<{width}}  -> {check.detail}" if check.detail else ""))
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
    parser.add_argument("--allow-unchecked", action="store_true", help="exit 0 even when items are UNCHECKED")
    parser.add_argument("--cluster", nargs="?", const="auto", metavar="ADDRESS",
                        help="run the GPU checks on every GPU node of the running Ray cluster (default address: auto)")
    parser.add_argument("--node-timeout-s", type=float, default=60,
                        help="--cluster: how long a node's task may wait for its GPUs, then for an answer")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    readings = gather_readings(
        serve_config=args.serve_config, app_name=args.app, tensor_parallel_size=args.tp,
        request_timeout_s=args.request_timeout_s, p99_ms=args.p99_ms, bandwidth=not args.no_bandwidth,
        copy_bytes=args.copy_mib * 1024**2,
    )
    if args.cluster:
        return _cluster_main(args, readings, started)
    checks = run_checks(readings, args.min_bandwidth_gbps)
    code = exit_code(checks, args.strict, args.allow_unchecked)
    if args.json:
        print(json.dumps({
            "checks": [asdict(c) for c in checks], "readings": asdict(readings), "exit_code": code,
            "seconds": round(time.perf_counter() - started, 2),
        }, indent=2, default=str))
    else:
        if not readings.has_gpu:
            print(
                f"preflight: {_no_gpu(readings)} ({readings.no_gpu_reason or 'none found'}); GPU checks are "
                f"{gpu_item_status(readings)}, the rest is checked (on a cluster: --cluster from the head)\n"
            )
        print(format_checks(checks))
    return code


def _cluster_main(args: argparse.Namespace, head: Readings, started: float) -> int:
    from app.tools.preflight.cluster import (
        gather_on_gpu_nodes, no_gpu_nodes_check, node_task_kwargs, unanswered_node_check,
    )

    results = gather_on_gpu_nodes(args.cluster, node_task_kwargs(head, not args.no_bandwidth, args.copy_mib * 1024**2),
                                  args.node_timeout_s)
    sections: dict[str, list[Check]] = {"serve config": run_config_checks(head)}
    node_readings = {}
    for node, result in results.items():
        if isinstance(result, Readings):
            result.serve_config = head.serve_config  # the node read the head's facts of it, not the file
            sections[node.label] = run_gpu_checks(result, args.min_bandwidth_gbps)
            node_readings[node.label] = asdict(result)
        else:
            sections[node.label] = [unanswered_node_check(node, result)]
    if not results:
        sections["GPU nodes"] = [no_gpu_nodes_check()]
    code = exit_code([c for checks in sections.values() for c in checks], args.strict, args.allow_unchecked)
    if args.json:
        print(json.dumps({
            "sections": {name: [asdict(c) for c in checks] for name, checks in sections.items()},
            "readings": node_readings, "exit_code": code, "seconds": round(time.perf_counter() - started, 2),
        }, indent=2, default=str))
    else:
        print(f"preflight --cluster: {len(results)} GPU node(s)")
        for name, checks in sections.items():
            print(f"\n== {name}\n{format_checks(checks)}")
    return code
