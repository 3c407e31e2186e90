"""The KV budget of one engine: its inputs, the report (arithmetic and PASS / WARN / FAIL checks) and its text form."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from app.config import ALLOWED_BLOCK_SIZES, EngineSettings
from app.tools.kv_budget.shape import (
    GIB, ModelShape, dtype_bytes, kv_bytes_per_token, kv_heads_per_rank, max_concurrent_sequences, parameter_count,
    tokens_fitting,
)

# Used when neither --gpu-memory-gib, NVML nor torch can tell the GPU's size (an 80 GB A100/H100).
ASSUMED_GPU_MEMORY_GIB = 80.0
# Without a serve config: the schema's engine settings.
SCHEMA_GPU_MEMORY_UTILIZATION = EngineSettings.model_fields["gpu_memory_utilization"].default
SCHEMA_BLOCK_SIZE = EngineSettings.model_fields["block_size"].default

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS / WARN / FAIL
    detail: str


def block_size_checks(block_size: int, max_seq_len: int) -> list[Check]:
    """The tuning guide's block rules: block_size a power of two in 16..128, max_seq_len % block_size == 0."""
    allowed = list(ALLOWED_BLOCK_SIZES)
    checks = [
        Check(
            "block_size",
            PASS if block_size in ALLOWED_BLOCK_SIZES else FAIL,
            f"block_size {block_size} " + (
                f"is a power of two in {allowed}" if block_size in ALLOWED_BLOCK_SIZES
                else f"is not a power of two in {allowed}"
            ),
        ),
        Check(
            "max_seq_len % block_size",
            FAIL if max_seq_len % block_size else PASS,
            f"{max_seq_len} % {block_size} = {max_seq_len % block_size}"
            + ("" if not max_seq_len % block_size else f": use a max_seq_len divisible by {block_size}"),
        ),
    ]
    return checks


@dataclass(frozen=True)
class BudgetInputs:
    shape: ModelShape
    kv_precision: str
    weight_precision: str
    max_tokens: int  # tokens per sequence (prompt + completion)
    batch_size: int  # sequences resident together
    batch_is_requirement: bool  # the operator asked for it (FAIL if it does not fit) vs. a derived worst case (WARN)
    max_seq_len: int
    block_size: int = SCHEMA_BLOCK_SIZE
    tensor_parallel_size: int = 1
    gpu_memory_gib: float | None = ASSUMED_GPU_MEMORY_GIB  # None: no GPU (CPU engine, kv_cache_memory_bytes given)
    gpu_memory_utilization: float = SCHEMA_GPU_MEMORY_UTILIZATION
    kv_cache_memory_bytes: int | None = None  # explicit KV size per worker: overrides the utilization arithmetic
    reserve_gib: float = 0.0  # activations / CUDA graphs / non-torch memory that vLLM measures by profiling
    context_tokens: int | None = None  # context for the concurrency figure (default: max_seq_len)
    max_num_seqs: int | None = None


@dataclass
class BudgetReport:
    model_type: str
    parameters: int
    weight_bytes: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token: int  # whole model (all TP ranks together)
    kv_bytes_per_token_per_gpu: int
    kv_bytes_per_block_per_gpu: int
    required_kv_bytes: int  # max_tokens x batch_size, whole model
    required_kv_bytes_per_gpu: int
    usable_bytes_per_gpu: int | None
    kv_budget_bytes_per_gpu: int
    tokens_capacity: int
    num_blocks: int
    context_tokens: int
    max_concurrent_sequences: int
    inputs: dict[str, Any]
    arithmetic: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(check.status == FAIL for check in self.checks)


def compute_budget(inputs: BudgetInputs) -> BudgetReport:
    shape, tp, bs = inputs.shape, inputs.tensor_parallel_size, inputs.block_size
    kv_bytes = dtype_bytes(inputs.kv_precision)
    params = parameter_count(shape)
    weight_bytes = params * dtype_bytes(inputs.weight_precision)
    # Weights are sharded across the TP group (norms are replicated: too small to matter).
    weight_per_gpu = math.ceil(weight_bytes / tp)
    per_token = kv_bytes_per_token(shape, kv_bytes, 1)
    per_token_gpu = kv_bytes_per_token(shape, kv_bytes, tp)
    sequence_tokens = inputs.max_tokens * inputs.batch_size
    required = per_token * sequence_tokens
    required_gpu = per_token_gpu * sequence_tokens

    usable: int | None = None
    if inputs.kv_cache_memory_bytes is not None:
        budget = inputs.kv_cache_memory_bytes
    else:
        if inputs.gpu_memory_gib is None:
            raise ValueError("no GPU memory size and no kv_cache_memory_bytes: nothing to size the KV cache from")
        usable = int(inputs.gpu_memory_gib * GIB * inputs.gpu_memory_utilization)
        budget = usable - weight_per_gpu - int(inputs.reserve_gib * GIB)
    capacity = tokens_fitting(max(budget, 0), per_token_gpu, bs)
    context = inputs.context_tokens or inputs.max_seq_len
    concurrent = max_concurrent_sequences(capacity, context, bs)

    report = BudgetReport(
        model_type=shape.model_type,
        parameters=params,
        weight_bytes=weight_bytes,
        weight_bytes_per_gpu=weight_per_gpu,
        kv_bytes_per_token=per_token,
        kv_bytes_per_token_per_gpu=per_token_gpu,
        kv_bytes_per_block_per_gpu=per_token_gpu * bs,
        required_kv_bytes=required,
        required_kv_bytes_per_gpu=required_gpu,
        usable_bytes_per_gpu=usable,
        kv_budget_bytes_per_gpu=budget,
        tokens_capacity=capacity,
        num_blocks=capacity // bs,
        context_tokens=context,
        max_concurrent_sequences=concurrent,
        inputs={**asdict(inputs), "shape": asdict(shape)},
    )
    report.arithmetic = _arithmetic_lines(inputs, report, kv_bytes)
    report.checks = _checks(inputs, report)
    return report


def _gib(n: float) -> str:
    """GiB for GPU-sized numbers, MiB for the small ones (the tiny CPU model), so no figure prints as 0.00."""
    if abs(n) >= GIB or n == 0:
        return f"{n / GIB:,.2f} GiB"
    return f"{n / 1024**2:,.2f} MiB"


def _arithmetic_lines(inputs: BudgetInputs, r: BudgetReport, kv_bytes: int) -> list[str]:
    s, tp = inputs.shape, inputs.tensor_parallel_size
    per = "per GPU" if inputs.gpu_memory_gib is not None else "per worker"
    if s.mla:
        per_token = (
            f"{s.num_layers} layers x ({s.mla.kv_lora_rank} kv_lora_rank + {s.mla.qk_rope_head_dim} qk_rope_head_dim)"
            f" x {kv_bytes} B ({inputs.kv_precision}) = {r.kv_bytes_per_token:,} B/token (MLA latent; every TP rank"
            " holds all of it)"
        )
    else:
        per_token = (
            f"{s.num_layers} layers x {s.num_kv_heads} KV heads x {s.head_dim} head_dim x 2 (K,V) x {kv_bytes} B "
            f"({inputs.kv_precision}) = {r.kv_bytes_per_token:,} B/token"
        )
    lines = [
        f"weights: {r.parameters:,} parameters x {dtype_bytes(inputs.weight_precision)} B ({inputs.weight_precision})"
        f" = {_gib(r.weight_bytes)}" + (f"; / TP {tp} = {_gib(r.weight_bytes_per_gpu)} per GPU" if tp > 1 else ""),
        f"KV per token: {per_token}",
    ]
    if tp > 1 and not s.mla:
        lines.append(
            f"KV per token per GPU: {kv_heads_per_rank(s, tp)} KV heads per rank (TP {tp}) -> "
            f"{r.kv_bytes_per_token_per_gpu:,} B/token"
        )
    lines.append(
        f"KV for the batch: {r.kv_bytes_per_token:,} B/token x {inputs.max_tokens:,} tokens x {inputs.batch_size} "
        f"sequences = {_gib(r.required_kv_bytes)}"
        + (f" ({_gib(r.required_kv_bytes_per_gpu)} per GPU)" if tp > 1 else "")
        + ". Linear in "
        f"batch x tokens: 2x the batch needs 2x the memory ({_gib(2 * r.required_kv_bytes)}), not 4x as the tuning "
        "guide's 'quadratic' claim would have it"
    )
    if inputs.kv_cache_memory_bytes is not None:
        lines.append(f"KV budget {per}: kv_cache_memory_bytes = {_gib(r.kv_budget_bytes_per_gpu)} (explicit)")
    else:
        reserve = f" - reserve {inputs.reserve_gib:g} GiB" if inputs.reserve_gib else ""
        lines.append(
            f"KV budget per GPU: {inputs.gpu_memory_gib:g} GiB x {inputs.gpu_memory_utilization:g} = "
            f"{_gib(r.usable_bytes_per_gpu or 0)} - weights {_gib(r.weight_bytes_per_gpu)}{reserve} = "
            f"{_gib(r.kv_budget_bytes_per_gpu)}"
            + ("" if inputs.reserve_gib else " (upper bound: vLLM also subtracts the activation peak it profiles)")
        )
    lines.append(
        f"fits: {_gib(max(r.kv_budget_bytes_per_gpu, 0))} // ({r.kv_bytes_per_token_per_gpu:,} B x {inputs.block_size}"
        f" tokens/block) = {r.num_blocks:,} blocks = {r.tokens_capacity:,} tokens"
    )
    lines.append(
        f"max concurrent sequences at {r.context_tokens:,} tokens: {r.num_blocks:,} blocks // "
        f"{math.ceil(r.context_tokens / inputs.block_size):,} blocks each = {r.max_concurrent_sequences:,}"
    )
    return lines


def _checks(inputs: BudgetInputs, r: BudgetReport) -> list[Check]:
    s, tp = inputs.shape, inputs.tensor_parallel_size
    checks = block_size_checks(inputs.block_size, inputs.max_seq_len)
    if tp > 1:
        heads_ok = s.num_attention_heads % tp == 0
        checks.append(Check(
            "TP divides attention heads", PASS if heads_ok else FAIL,
            f"{s.num_attention_heads} attention heads % TP {tp} = {s.num_attention_heads % tp}",
        ))
        if not s.mla:
            kv_ok = s.num_kv_heads % tp == 0 or tp % s.num_kv_heads == 0
            checks.append(Check(
                "TP and KV heads", PASS if kv_ok else FAIL,
                f"{s.num_kv_heads} KV heads and TP {tp}: "
                + ("one divides the other" if kv_ok else "neither divides the other; vLLM refuses this TP size"),
            ))
    if s.max_position_embeddings and inputs.max_seq_len > s.max_position_embeddings:
        checks.append(Check(
            "context within the model", WARN,
            f"max_seq_len {inputs.max_seq_len:,} > max_position_embeddings {s.max_position_embeddings:,}: needs "
            "rope scaling or a shorter max_seq_len",
        ))
    if s.quantized:
        checks.append(Check(
            "weights", WARN,
            f"config.json has a quantization_config: weights counted at {inputs.weight_precision}; pass "
            "--weight-precision for the quantized size",
        ))
    if r.kv_budget_bytes_per_gpu <= 0:
        checks.append(Check(
            "weights fit", FAIL,
            f"weights per GPU {_gib(r.weight_bytes_per_gpu)} leave no KV memory in "
            f"{_gib(r.usable_bytes_per_gpu or 0)}: raise TP, gpu_memory_utilization or use a smaller precision",
        ))
    one_sequence = math.ceil(inputs.max_seq_len / inputs.block_size) * inputs.block_size
    checks.append(Check(
        "one max_seq_len sequence fits",
        PASS if r.tokens_capacity >= one_sequence else FAIL,
        f"capacity {r.tokens_capacity:,} tokens vs max_seq_len {inputs.max_seq_len:,}"
        + ("" if r.tokens_capacity >= one_sequence else ": vLLM refuses to start; lower max_model_len or add memory"),
    ))
    if inputs.max_tokens > inputs.max_seq_len:
        checks.append(Check(
            "max_tokens within max_seq_len", FAIL,
            f"max_tokens {inputs.max_tokens:,} > max_seq_len {inputs.max_seq_len:,}: no sequence can be that long",
        ))
    wanted = inputs.max_tokens * inputs.batch_size
    fits = r.tokens_capacity >= wanted
    resident = max_concurrent_sequences(r.tokens_capacity, inputs.max_tokens, inputs.block_size)
    checks.append(Check(
        "batch fits",
        PASS if fits else (FAIL if inputs.batch_is_requirement else WARN),
        f"{inputs.batch_size} x {inputs.max_tokens:,} = {wanted:,} tokens vs capacity {r.tokens_capacity:,} "
        f"({_gib(r.required_kv_bytes_per_gpu)} needed, {_gib(max(r.kv_budget_bytes_per_gpu, 0))} available per "
        + ("GPU)" if inputs.gpu_memory_gib is not None else "worker)")
        + ("" if fits else f"; at most {resident} such sequences are resident at once, the rest wait or are preempted"),
    ))
    if inputs.max_num_seqs is not None and inputs.batch_size > inputs.max_num_seqs:
        checks.append(Check(
            "batch within max_num_seqs", WARN,
            f"batch {inputs.batch_size} > max_num_seqs {inputs.max_num_seqs}: the engine never runs more than "
            f"{inputs.max_num_seqs} at once",
        ))
    return checks


def format_report(report: BudgetReport) -> str:
    inputs = report.inputs
    head = (
        f"model: {report.model_type}, {inputs['shape']['num_layers']} layers, TP {inputs['tensor_parallel_size']}, "
        f"KV {inputs['kv_precision']}, block_size {inputs['block_size']}, max_seq_len {inputs['max_seq_len']:,}"
    )
    lines = [head, *(f"  {line}" for line in report.arithmetic), ""]
    lines += [f"{check.status}  {check.name}: {check.detail}" for check in report.checks]
    return "\n".join(lines)

