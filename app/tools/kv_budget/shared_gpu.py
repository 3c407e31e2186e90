"""Engines sharing one GPU (--shared-gpu): every replica of a lane with a fractional num_gpus, summed against the GPU,
and vLLM's start-up rule for each engine started last."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from app.config import AppConfig
from app.tools.kv_budget.budget import ASSUMED_GPU_MEMORY_GIB, FAIL, PASS, Check, _gib
from app.tools.kv_budget.inputs import gpu_memory_gib_from_device, model_shape, read_serve_config, weight_precision_of
from app.tools.kv_budget.shape import GIB, ModelShape, dtype_bytes, parameter_count

# What an engine holds beyond its weights and KV cache: activation peak, CUDA graphs, CUDA / MPS context. Three engines
# of the Llama-3.1-8B-shaped model on one H200 peak at 134,023 MiB, their weights + KV + 2.0 GiB each
# (docs/history.md, round 10); at ready it is 1.0 GiB (hot) and 1.8 GiB (cold).
ENGINE_OVERHEAD_GIB = 2.0


@dataclass(frozen=True)
class SharedEngine:
    """One engine process on the shared GPU: a replica of a lane with a fractional `num_gpus`."""

    name: str  # "hot_lane replica 2"
    lane_field: str  # "hot_lane": where its settings live, for the fix
    weight_bytes: int
    kv_cache_memory_bytes: int | None  # None: vLLM sizes the engine to gpu_memory_utilization x the GPU
    gpu_memory_utilization: float
    num_gpus: float


def engine_footprint(engine: SharedEngine, gpu_bytes: int, overhead_bytes: int) -> int:
    """GPU memory the engine holds at its peak."""
    if engine.kv_cache_memory_bytes is None:
        return int(engine.gpu_memory_utilization * gpu_bytes)
    return engine.weight_bytes + engine.kv_cache_memory_bytes + overhead_bytes


def shared_gpu_checks(engines: list[SharedEngine], gpu_bytes: int,
                      overhead_bytes: int) -> tuple[list[str], list[Check]]:
    """(arithmetic lines, checks) for engines that share one GPU: do they fit, and does each pass vLLM's start-up
    check (free memory >= gpu_memory_utilization x the GPU) if it is the last to start?"""
    footprints = [engine_footprint(e, gpu_bytes, overhead_bytes) for e in engines]
    lines = []
    for engine, footprint in zip(engines, footprints):
        parts = (f"weights {_gib(engine.weight_bytes)} + KV {_gib(engine.kv_cache_memory_bytes)} + overhead "
                 f"{_gib(overhead_bytes)}" if engine.kv_cache_memory_bytes is not None
                 else f"gpu_memory_utilization {engine.gpu_memory_utilization} x {_gib(gpu_bytes)}")
        lines.append(f"{engine.name}: {parts} = {_gib(footprint)}")
    total, fractions = sum(footprints), sum(e.num_gpus for e in engines)
    lines.append(f"together: {_gib(total)} of {_gib(gpu_bytes)} ({total / gpu_bytes:.1%}); num_gpus add up to "
                 f"{fractions:g}")
    checks = [Check("one GPU's worth of num_gpus", PASS if fractions <= 1 + 1e-9 else FAIL,
                    f"{fractions:g} GPU" + ("" if fractions <= 1 + 1e-9 else
                                            ": Ray cannot place them all on one GPU; lower the lanes' num_gpus"))]
    spare = gpu_bytes - total
    checks.append(Check("engines fit on the GPU", PASS if spare >= 0 else FAIL,
                        f"{_gib(total)} of {_gib(gpu_bytes)}, {_gib(abs(spare))} "
                        + ("to spare" if spare >= 0 else "short: lower a lane's kv_cache_memory_bytes")))
    for engine, footprint in zip(engines, footprints):
        others = total - footprint
        free_when_last = gpu_bytes - others
        needed = math.ceil(engine.gpu_memory_utilization * gpu_bytes)
        if needed <= free_when_last:
            checks.append(Check(f"{engine.name} starts last", PASS,
                                f"needs {_gib(needed)} free, {_gib(free_when_last)} left by the others"))
        else:
            highest = math.floor(max(free_when_last, 0) / gpu_bytes * 100) / 100
            fix = f"{engine.lane_field}.engine.gpu_memory_utilization <= {highest}" + (
                " with kv_cache_memory_bytes sizing its KV" if engine.kv_cache_memory_bytes is None else "")
            checks.append(Check(f"{engine.name} starts last", FAIL,
                                f"needs {_gib(needed)} free (gpu_memory_utilization {engine.gpu_memory_utilization}), "
                                f"{_gib(free_when_last)} left by the others: vLLM refuses to start; set {fix}"))
    return lines, checks


def shared_engines(app: AppConfig, shape: ModelShape, weight_precision: str | None = None) -> list[SharedEngine]:
    """Every replica of a lane with tensor_parallel_size 1 and a fractional num_gpus: the engines that share GPUs."""
    engines = []
    for lane_field in ("hot_lane", "cold_lane"):
        lane = getattr(app, lane_field)
        if lane is None or lane.engine.tensor_parallel_size != 1 or not 0 < lane.deployment.num_gpus < 1:
            continue
        deployment = lane.deployment
        weight_bytes = parameter_count(shape) * dtype_bytes(weight_precision_of(lane.engine, shape, weight_precision))
        for index in range(deployment.min_replicas):
            engines.append(SharedEngine(f"{lane_field} replica {index + 1}", lane_field, weight_bytes,
                                        lane.engine.kv_cache_memory_bytes, lane.engine.gpu_memory_utilization,
                                        deployment.num_gpus))
    return engines


def shared_gpu_main(args: argparse.Namespace) -> int:
    if not args.serve_config:
        raise SystemExit("--shared-gpu needs --serve-config")
    _, app = read_serve_config(args.serve_config, args.app)
    engines = shared_engines(app, model_shape(args, app), args.weight_precision)
    if not engines:
        print(f"{args.serve_config}: no lane shares a GPU (no replica with tensor_parallel_size 1 and num_gpus < 1)")
        return 0
    gpu_gib = args.gpu_memory_gib or gpu_memory_gib_from_device() or ASSUMED_GPU_MEMORY_GIB
    overhead_gib = args.reserve_gib or ENGINE_OVERHEAD_GIB
    lines, checks = shared_gpu_checks(engines, int(gpu_gib * GIB), int(overhead_gib * GIB))
    print(f"{len(engines)} engines on one GPU of {gpu_gib:.2f} GiB (overhead {overhead_gib:g} GiB each: --reserve-gib)")
    print("\n".join(f"  {line}" for line in lines) + "\n")
    print("\n".join(f"{check.status}  {check.name}: {check.detail}" for check in checks))
    return 1 if any(check.status == FAIL for check in checks) else 0

