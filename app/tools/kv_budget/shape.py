"""A model's shape (from its config.json) and the pure KV arithmetic: parameters, KV bytes per token, tokens that fit
in a KV budget (vLLM's block rule), concurrent sequences."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

GIB = 1024**3

DTYPE_BYTES = {
    "fp32": 4, "float32": 4, "float": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "float8_e4m3fn": 1, "int8": 1,
}


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

