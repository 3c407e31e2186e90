"""The checklist's checks: pure functions of a Readings record, one Check line each."""

from __future__ import annotations

from typing import Callable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import Version

from app.tools.preflight.readings import (
    FAIL, HOT_PREFILL_GRAPH_TOKENS, MAX_HEALTH_CHECK_PERIOD_S, MIN_CUDA_VERSION, MIN_HOST_DEVICE_GBPS, PASS,
    PCIE_X16_GBPS, SKIP, TIMEOUT_OVER_P99, UNCHECKED, WARN, Check, Readings, mps_pipe_directory, tp_pairs,
)


def _no_gpu(r: Readings) -> str:
    # The reason (CPU build of torch, NVML error...) is printed once at the top and kept in the JSON readings.
    return "no NVIDIA GPU visible"


def gpu_item_status(r: Readings) -> str:
    """A GPU item with no GPU to look at: SKIP only for a CPU serve config (it does not apply); otherwise it applies
    and was not checked, which is no pass (run preflight where the GPUs are, e.g. --cluster from the head)."""
    return SKIP if r.device == "cpu" else UNCHECKED


def _unseen(r: Readings, name: str, value: str, detail: str = "") -> Check:
    return Check(name, gpu_item_status(r), value, detail or _no_gpu(r))


def _version_at_least(version: str, minimum: str) -> bool:
    return Version(version) >= Version(minimum)


# ---- checks: pure functions of the readings -----------------------------------------------------------------------


def check_gpu_architecture(r: Readings) -> Check:
    name = "GPU architecture consistent"
    if not r.has_gpu:
        return _unseen(r, name, "0 GPUs")
    kinds = sorted({f"{gpu} (sm_{cap[0]}{cap[1]})" for gpu, cap in zip(r.gpu_names, r.gpu_capabilities)})
    value = f"{len(r.gpu_names)} x " + ", ".join(kinds)
    if len(kinds) == 1:
        return Check(name, PASS, value)
    return Check(name, FAIL, value, "mixed GPU models: keep a TP group and a lane on one architecture")


def check_nvlink(r: Readings) -> Check:
    name = f"NVLink inside TP-{r.tensor_parallel_size} groups"
    if not r.has_gpu:
        return _unseen(r, name, "-")
    if r.tensor_parallel_size < 2:
        return Check(name, SKIP, "TP 1", "no tensor-parallel groups to connect")
    if len(r.gpu_names) < r.tensor_parallel_size:
        return Check(
            name, WARN, f"{len(r.gpu_names)} GPU(s)",
            f"a TP-{r.tensor_parallel_size} replica needs {r.tensor_parallel_size} GPUs on one node (STRICT_PACK); "
            "this node cannot host one",
        )
    if r.nvlink is None:
        return Check(name, UNCHECKED, "unknown", r.nvlink_unknown_reason or "NVLink state not readable")
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
        return _unseen(r, name, "-")
    if r.h2d_gbps is None or r.d2h_gbps is None:
        reason = r.bandwidth_unknown_reason or "not measured"
        # --no-bandwidth is the operator's choice (SKIP); a copy that failed or could not run is UNCHECKED
        return Check(name, SKIP if reason.startswith("skipped") else UNCHECKED, "not measured", reason)
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
            return _unseen(r, name, f"torch {r.torch_version or 'not installed'} (no CUDA)")
        return Check(name, FAIL, f"torch {r.torch_version} has no CUDA", "install a CUDA build of torch")
    value = f"CUDA {r.cuda_runtime} (torch {r.torch_version})"
    if _version_at_least(r.cuda_runtime, minimum):
        return Check(name, PASS, value)
    return Check(name, FAIL, value, f"upgrade to a torch / vLLM build for CUDA {minimum} or newer")


def check_driver(r: Readings) -> Check:
    name = "driver supports the CUDA runtime"
    if not r.has_gpu:
        return _unseen(r, name, "-")
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
        cpu_note = "; vLLM's CPU engine uses its own attention kernels" if r.device == "cpu" else ""
        return _unseen(r, name, "-", _no_gpu(r) + cpu_note)
    if r.flash_attention is None:
        return Check(name, UNCHECKED, "unknown", r.flash_attention_detail or "not read")
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
        return _unseen(r, name, value)
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


# Items read on a GPU node (--cluster runs them there) and items read from the serve config (once, anywhere).
GPU_CHECKS: list[Callable[..., Check]] = [
    check_gpu_architecture, check_nvlink, check_host_device_bandwidth, check_cuda_version, check_driver, check_triton,
    check_flash_attention, check_mps_daemon,
]
CONFIG_CHECKS: list[Callable[[Readings], Check]] = [
    check_health_check_period, check_request_timeout, check_hot_lane_prefill_graphs,
]


def run_gpu_checks(r: Readings, min_gbps: float = MIN_HOST_DEVICE_GBPS) -> list[Check]:
    return [check(r, min_gbps) if check is check_host_device_bandwidth else check(r) for check in GPU_CHECKS]


def run_config_checks(r: Readings) -> list[Check]:
    return [check(r) for check in CONFIG_CHECKS]


def run_checks(r: Readings, min_gbps: float = MIN_HOST_DEVICE_GBPS) -> list[Check]:
    return run_gpu_checks(r, min_gbps) + run_config_checks(r)


def exit_code(checks: list[Check], strict: bool = False, allow_unchecked: bool = False) -> int:
    """1: a FAIL (with strict, a WARN too); 2: nothing failed but some item could not be checked; 0: all checked."""
    failing = {FAIL, WARN} if strict else {FAIL}
    if any(check.status in failing for check in checks):
        return 1
    if not allow_unchecked and any(check.status == UNCHECKED for check in checks):
        return 2
    return 0
