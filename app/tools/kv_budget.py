"""KV-cache budget validator: does a model's KV cache fit the GPUs at the configured settings?

    python -m app.tools.kv_budget --model /path/to/model --precision fp16 --max-tokens 131072 --batch-size 32
    python -m app.tools.kv_budget --serve-config serve_configs/prod.yaml --lane hot --model-config /tmp/qwen/config.json
    python -m app.tools.kv_budget --serve-config serve_configs/gpu-single.yaml --shared-gpu   # every engine on one GPU

This is the tuning guide's `validate_kv_cache.py --model --precision fp16 --max_tokens 131072 --batch_size 32`, built
on the app's own config schema. It prints the arithmetic (weights, KV bytes per token, KV for tokens x batch, what
fits per GPU, concurrent sequences) and PASS / WARN / FAIL lines; the exit code is 1 when any line is FAIL.

KV memory is linear in batch x tokens: bytes = bytes_per_token x tokens_per_sequence x sequences. (The tuning guide
says it grows quadratically with batch size; it does not: doubling the batch doubles it.)

The token capacity follows vLLM's own rule (v1 KV cache manager): num_blocks = kv_bytes // bytes_per_block, and the
reported "KV cache size: N tokens" is num_blocks x block_size. `tokens_fitting` is that rule as a pure function.

`--shared-gpu` sums every engine that shares a GPU (replicas of lanes with num_gpus < 1, as gpu-single.yaml's three):
weights + KV byte budget + a measured per-engine overhead each, against the GPU, and checks vLLM's start-up rule for
each engine started last (free memory >= its gpu_memory_utilization x the GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from app.config import ALLOWED_BLOCK_SIZES, AppConfig, ConfigError, EngineSettings, load_app_config

GIB = 1024**3
# The tuning guide's validate_kv_cache.py example: a 128K context at batch 32.
GUIDE_MAX_TOKENS = 131072
GUIDE_BATCH_SIZE = 32
# Used when neither --gpu-memory-gib, NVML nor torch can tell the GPU's size (an 80 GB A100/H100).
ASSUMED_GPU_MEMORY_GIB = 80.0
# Without a serve config: the schema's engine settings.
SCHEMA_GPU_MEMORY_UTILIZATION = EngineSettings.model_fields["gpu_memory_utilization"].default
SCHEMA_BLOCK_SIZE = EngineSettings.model_fields["block_size"].default

DTYPE_BYTES = {
    "fp32": 4, "float32": 4, "float": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "float8_e4m3fn": 1, "int8": 1,
}

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


def dtype_bytes(name: str) -> int:
    key = name.lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown precision {name!r}: use one of fp32, fp16, bf16, fp8")
    return DTYPE_BYTES[key]


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds one compressed latent + the rope key per token."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None


@dataclass(frozen=True)
class MoeDims:
    num_experts: int
    expert_intermediate_size: int
    shared_intermediate_size: int  # 0 when there is no shared expert
    dense_layers: int  # the first layers that keep a dense MLP (DeepSeek's first_k_dense_replace)
    router_bias: bool


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int | None
    config_dtype: str | None
    quantized: bool
    mla: MlaDims | None = None
    moe: MoeDims | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelShape":
        """Read a Hugging Face config.json (multimodal configs: their text_config)."""
        cfg = {**config, **config.get("text_config", {})} if isinstance(config.get("text_config"), dict) else config
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        mla = None
        if cfg.get("kv_lora_rank"):
            mla = MlaDims(
                kv_lora_rank=cfg["kv_lora_rank"],
                qk_rope_head_dim=cfg["qk_rope_head_dim"],
                qk_nope_head_dim=cfg["qk_nope_head_dim"],
                v_head_dim=cfg["v_head_dim"],
                q_lora_rank=cfg.get("q_lora_rank"),
            )
        num_experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        moe = None
        if num_experts:
            expert_size = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
            shared = (cfg.get("n_shared_experts") or 0) * expert_size or cfg.get("shared_expert_intermediate_size", 0)
            moe = MoeDims(
                num_experts=num_experts,
                expert_intermediate_size=expert_size,
                shared_intermediate_size=shared,
                dense_layers=cfg.get("first_k_dense_replace", 0),
                router_bias=cfg.get("topk_method") == "noaux_tc",
            )
        dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        return cls(
            model_type=cfg.get("model_type", "unknown"),
            num_layers=cfg["num_hidden_layers"],
            hidden_size=hidden,
            vocab_size=cfg["vocab_size"],
            num_attention_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama-family configs say so in attention_bias.
            qkv_bias=bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2",
            max_position_embeddings=cfg.get("max_position_embeddings"),
            config_dtype=dtype if isinstance(dtype, str) else None,
            quantized="quantization_config" in cfg,
            mla=mla,
            moe=moe,
        )


def _attention_params(shape: ModelShape) -> int:
    h = shape.hidden_size
    if shape.mla:
        m = shape.mla
        q_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            # q_a_proj, q_a_layernorm, q_b_proj
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * shape.num_attention_heads * q_head
        else:
            q = h * shape.num_attention_heads * q_head
        kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # kv_a_proj_with_mqa + kv_a_layernorm
        kv_b = m.kv_lora_rank * shape.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)
        o = shape.num_attention_heads * m.v_head_dim * h
        return q + kv_a + kv_b + o
    q_out = shape.num_attention_heads * shape.head_dim
    kv_out = shape.num_kv_heads * shape.head_dim
    bias = (q_out + 2 * kv_out) if shape.qkv_bias else 0
    return h * q_out + 2 * h * kv_out + q_out * h + bias


def _mlp_params(shape: ModelShape, layer: int) -> int:
    h = shape.hidden_size
    moe = shape.moe
    if moe is None or layer < moe.dense_layers:
        return 3 * h * shape.intermediate_size  # gate, up, down
    experts = moe.num_experts * 3 * h * moe.expert_intermediate_size
    shared = 3 * h * moe.shared_intermediate_size
    router = moe.num_experts * h + (moe.num_experts if moe.router_bias else 0)
    return experts + shared + router


def parameter_count(shape: ModelShape) -> int:
    """Parameters of the served model: embeddings, attention, MLP (dense or MoE), norms, lm_head unless tied.

    Multi-token-prediction layers (DeepSeek-V3's num_nextn_predict_layers) are not loaded for serving: not counted.
    """
    embeddings = shape.vocab_size * shape.hidden_size
    lm_head = 0 if shape.tie_word_embeddings else embeddings
    per_layer_norms = 2 * shape.hidden_size
    layers = sum(
        _attention_params(shape) + _mlp_params(shape, layer) + per_layer_norms for layer in range(shape.num_layers)
    )
    return embeddings + layers + shape.hidden_size + lm_head  # + final norm


def kv_heads_per_rank(shape: ModelShape, tensor_parallel_size: int) -> int:
    """vLLM splits KV heads across TP ranks and replicates them when there are fewer heads than ranks."""
    return max(1, shape.num_kv_heads // tensor_parallel_size)


def kv_bytes_per_token(shape: ModelShape, kv_dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """KV-cache bytes one token takes on one GPU of a TP group (tensor_parallel_size=1: the whole model's).

    Standard attention: layers x KV heads x head_dim x 2 (K and V) x dtype size.
    MLA: layers x (kv_lora_rank + qk_rope_head_dim) x dtype size; the latent is not split across TP ranks.
    """
    if shape.mla:
        return shape.num_layers * (shape.mla.kv_lora_rank + shape.mla.qk_rope_head_dim) * kv_dtype_bytes
    heads = kv_heads_per_rank(shape, tensor_parallel_size)
    return shape.num_layers * heads * shape.head_dim * 2 * kv_dtype_bytes


def tokens_fitting(kv_cache_memory_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """Tokens a KV cache of kv_cache_memory_bytes holds, in whole blocks (vLLM: memory // bytes_per_block)."""
    num_blocks = kv_cache_memory_bytes // (bytes_per_token * block_size)
    return num_blocks * block_size


def max_concurrent_sequences(tokens_capacity: int, context_tokens: int, block_size: int) -> int:
    """Sequences of context_tokens each that are resident at once (each takes whole blocks)."""
    blocks_per_sequence = math.ceil(context_tokens / block_size)
    return (tokens_capacity // block_size) // blocks_per_sequence


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


# ---- reading configs ----------------------------------------------------------------------------------------------


def read_serve_config(path: str | Path, app_name: str | None = None) -> tuple[dict[str, Any], AppConfig]:
    """The serve config file as a dict, and its application's args validated by the app schema."""
    raw = yaml.safe_load(Path(path).read_text())
    apps = raw.get("applications") or []
    if app_name is not None:
        apps = [a for a in apps if a.get("name") == app_name]
    if not apps:
        raise ConfigError(f"{path}: no application{' named ' + app_name if app_name else ''} in applications:")
    return raw, load_app_config(apps[0].get("args") or {})


def find_model_config(source: str, search_roots: list[Path]) -> Path | None:
    for root in [Path.cwd(), *search_roots]:
        candidate = (root / source) if not Path(source).is_absolute() else Path(source)
        if (candidate / "config.json").is_file():
            return candidate / "config.json"
        if candidate.is_file() and candidate.name.endswith(".json"):
            return candidate
    return None


def gpu_memory_gib_from_device() -> float | None:
    """Total memory of GPU 0 from NVML (nvidia-ml-py) or torch; None on a machine without a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total / GIB
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML library or no GPU: fall through to torch
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GIB
    except Exception:  # noqa: BLE001
        pass
    return None


def _normalize_precision(name: str | None) -> str | None:
    if name is None or name == "auto":
        return None
    key = name.lower().removeprefix("torch.")
    return {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}.get(key, key)


def model_shape(args: argparse.Namespace, app: AppConfig | None) -> ModelShape:
    """The model's shape from --model-config, --model, or the serve config's model source (its config.json)."""
    if args.model_config:
        config_path: Path | None = Path(args.model_config)
    elif args.model:
        config_path = find_model_config(args.model, [])
    elif app is not None:
        config_path = find_model_config(app.model.source, [Path(args.serve_config).resolve().parent.parent])
    else:
        raise SystemExit("give --model PATH, --model-config config.json or --serve-config FILE")
    if config_path is None or not config_path.is_file():
        source = args.model or (app.model.source if app else "")
        raise SystemExit(
            f"no config.json for {source!r} on disk: pass --model-config PATH/TO/config.json "
            "(e.g. downloaded with `huggingface-cli download MODEL config.json`)"
        )
    return ModelShape.from_config(json.loads(config_path.read_text()))


def weight_precision_of(engine: EngineSettings | None, shape: ModelShape, override: str | None = None) -> str:
    """--weight-precision, else the engine's dtype, else the model's, else fp16."""
    engine_dtype = _normalize_precision(engine.dtype) if engine else None
    return override or engine_dtype or _normalize_precision(shape.config_dtype) or "fp16"


def build_inputs(args: argparse.Namespace) -> BudgetInputs:
    engine = None
    app: AppConfig | None = None
    if args.serve_config:
        _, app = read_serve_config(args.serve_config, args.app)
        engine = app.lane(args.lane).engine
    shape = model_shape(args, app)

    kv_from_engine = _normalize_precision(engine.extra_engine_args.get("kv_cache_dtype")) if engine else None
    weight_precision = weight_precision_of(engine, shape, args.weight_precision)
    kv_precision = args.precision or kv_from_engine or weight_precision

    max_seq_len = args.max_seq_len or (app.model.max_model_len if app else None) or args.max_tokens or GUIDE_MAX_TOKENS
    max_tokens = args.max_tokens or max_seq_len
    batch_is_requirement = args.batch_size is not None
    batch_size = args.batch_size or (engine.max_num_seqs if engine else GUIDE_BATCH_SIZE)

    on_cpu = app is not None and app.device == "cpu"
    kv_cache_memory_bytes = args.kv_cache_memory_bytes or (engine.kv_cache_memory_bytes if engine else None)
    gpu_memory_gib = None
    if not on_cpu and kv_cache_memory_bytes is None:
        gpu_memory_gib = args.gpu_memory_gib or gpu_memory_gib_from_device() or ASSUMED_GPU_MEMORY_GIB
    return BudgetInputs(
        shape=shape,
        kv_precision=kv_precision,
        weight_precision=weight_precision,
        max_tokens=max_tokens,
        batch_size=batch_size,
        batch_is_requirement=batch_is_requirement,
        max_seq_len=max_seq_len,
        block_size=args.block_size or (engine.block_size if engine else SCHEMA_BLOCK_SIZE),
        tensor_parallel_size=args.tp or (engine.tensor_parallel_size if engine else 1),
        gpu_memory_gib=gpu_memory_gib,
        gpu_memory_utilization=args.gpu_memory_utilization
        or (engine.gpu_memory_utilization if engine else SCHEMA_GPU_MEMORY_UTILIZATION),
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        reserve_gib=args.reserve_gib,
        context_tokens=args.context,
        max_num_seqs=engine.max_num_seqs if engine else None,
    )


# ---- engines sharing one GPU (--shared-gpu) ------------------------------------------------------------------------
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


def format_report(report: BudgetReport) -> str:
    inputs = report.inputs
    head = (
        f"model: {report.model_type}, {inputs['shape']['num_layers']} layers, TP {inputs['tensor_parallel_size']}, "
        f"KV {inputs['kv_precision']}, block_size {inputs['block_size']}, max_seq_len {inputs['max_seq_len']:,}"
    )
    lines = [head, *(f"  {line}" for line in report.arithmetic), ""]
    lines += [f"{check.status}  {check.name}: {check.detail}" for check in report.checks]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app.tools.kv_budget", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local model folder (with config.json) or a config.json path")
    parser.add_argument("--model-config", help="config.json to use when the model source is a hub id not on disk")
    parser.add_argument("--serve-config", help="serve config YAML; model and engine settings come from the schema")
    parser.add_argument("--app", help="application name in the serve config (default: the first)")
    parser.add_argument("--lane", choices=["hot", "cold"], default="hot")
    parser.add_argument("--precision", type=_normalize_precision, choices=["fp16", "bf16", "fp8", "fp32"],
                        help="KV-cache precision (default: the engine's kv_cache_dtype / dtype / the model's dtype)")
    parser.add_argument("--weight-precision", type=_normalize_precision, choices=["fp16", "bf16", "fp8", "fp32"])
    parser.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int,
                        help="tokens per sequence (default: max_seq_len)")
    parser.add_argument("--batch-size", "--batch_size", dest="batch_size", type=int,
                        help="sequences resident together; given: FAIL if they do not fit (default: max_num_seqs, "
                             "WARN only)")
    parser.add_argument("--max-seq-len", type=int, help="default: the serve config's max_model_len or --max-tokens")
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--tp", type=int, help="tensor-parallel size")
    parser.add_argument("--gpu-memory-gib", type=float, help="default: GPU 0 via NVML / torch, else 80")
    parser.add_argument("--gpu-memory-utilization", type=float)
    parser.add_argument("--kv-cache-memory-bytes", type=int, help="explicit KV size per worker (CPU engine)")
    parser.add_argument("--reserve-gib", type=float, default=0.0,
                        help="activation / CUDA-graph memory to subtract (vLLM measures it when it starts)")
    parser.add_argument("--context", type=int, help="context length for the concurrency figure")
    parser.add_argument("--shared-gpu", action="store_true",
                        help="with --serve-config: every engine that shares a GPU (lanes with num_gpus < 1), all "
                             "lanes and replicas together: do they fit, and does each pass vLLM's start-up check "
                             f"when it starts last (--reserve-gib: overhead per engine, default "
                             f"{ENGINE_OVERHEAD_GIB:g})")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.shared_gpu:
        try:
            return shared_gpu_main(args)
        except (ConfigError, ValueError, KeyError) as error:
            print(f"kv_budget: {error}", file=sys.stderr)
            return 2
    try:
        report = compute_budget(build_inputs(args))
    except (ConfigError, ValueError, KeyError) as error:
        print(f"kv_budget: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(report), "failed": report.failed}, indent=2))
    else:
        print(format_report(report))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
