"""The identity LoRA adapter the lanes' engines run the base model's requests under on a CPU host.

On a CPU host (vLLM's PunicaWrapperCPU), a step that mixes requests with and without an adapter applies the adapter
of the engine's last LoRA slot to those without: their index, -1, picks that slot as a Python index. So with LoRA on,
the base model's requests run under an adapter that changes nothing (lora_B zero): every request has an adapter,
and each gets its own. It costs the base model's requests the LoRA path's compute, and one of max_loras' slots.
Its name and id are app/lanes/types.py's BASE_ADAPTER_NAME and BASE_ADAPTER_ID.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def identity_adapter(model_dir: str) -> str:
    """A folder holding a rank-1 LoRA adapter of `model_dir` (a Llama-family layout: self_attn.o_proj) whose delta is
    zero; written once per host into the system's temporary folder."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    folder = Path(tempfile.gettempdir()) / f"llm-lanes-identity-lora-{config['hidden_size']}-{heads * head_dim}"
    if not (folder / "adapter_model.safetensors").exists():
        # Written beside and renamed into place: the lanes' replicas on one host may start at once.
        folder.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
        prefix = "base_model.model.model.layers.0.self_attn.o_proj"
        save_file({f"{prefix}.lora_A.weight": torch.zeros(1, heads * head_dim),
                   f"{prefix}.lora_B.weight": torch.zeros(config["hidden_size"], 1)},
                  str(staging / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["o_proj"], "bias": "none",
            "base_model_name_or_path": model_dir}))
        os.replace(staging / "adapter_model.safetensors", folder / "adapter_model.safetensors")
        staging.rmdir()
    return str(folder)
