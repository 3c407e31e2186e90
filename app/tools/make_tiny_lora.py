"""Generate a tiny LoRA adapter for a locally generated model, in the layout vLLM and PEFT read.

    python -m app.tools.make_tiny_lora models/tiny-llama models/tiny-lora-a --seed 1
    python -m app.tools.make_tiny_lora models/tiny-llama models/tiny-lora-r16 --seed 2 --rank 16

Writes `adapter_config.json` (PEFT's LoRA fields) and `adapter_model.safetensors` (`lora_A` / `lora_B` weights of the
attention and MLP projections of every layer) for the base model whose `config.json` is in the first folder. No
download: the weights are drawn from a seeded generator, and `lora_B` is not zero (PEFT starts it at zero, which would
leave the base model's answers unchanged), so each seed's adapter answers differently from the base model and from
the others. The same seed, rank and package versions give byte-identical files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_RANK = 8
# Large enough that the adapter's delta changes greedy picks of the tiny model, small enough to stay finite.
WEIGHT_STD = 0.5
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def projection_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection of a Llama-architecture layer."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim), "v_proj": (hidden, kv * head_dim),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def adapter_config(base_model: str, rank: int) -> dict[str, Any]:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
            "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": list(TARGET_MODULES), "bias": "none",
            "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
            "inference_mode": True}


def make_tiny_lora(base_dir: Path, out_dir: Path, seed: int, rank: int = DEFAULT_RANK) -> int:
    """Write the adapter; returns its number of parameters."""
    import torch
    from safetensors.torch import save_file

    if rank < 1:
        raise ValueError(f"--rank must be at least 1, got {rank}")
    config = json.loads((base_dir / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in projection_shapes(config).items():
            where = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * WEIGHT_STD
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * WEIGHT_STD
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE))
    (out_dir / CONFIG_FILE).write_text(json.dumps(adapter_config(str(base_dir), rank), indent=2) + "\n")
    return sum(t.numel() for t in tensors.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_dir", type=Path, help="the base model's folder (its config.json)")
    parser.add_argument("out_dir", type=Path, help="folder to write the adapter into")
    parser.add_argument("--seed", type=int, required=True, help="each seed is another adapter")
    parser.add_argument("--rank", type=int, default=DEFAULT_RANK, help="LoRA rank (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        params = make_tiny_lora(args.base_dir, args.out_dir, args.seed, args.rank)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote a rank-{args.rank} LoRA adapter ({params:,} parameters) for {args.base_dir} to {args.out_dir}")


if __name__ == "__main__":
    main()
