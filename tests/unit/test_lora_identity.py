"""The identity adapter the base model's requests run under on a CPU host with LoRA on (app/lanes/engine.py): a
rank-1 LoRA adapter of the model whose delta is zero, in the layout vLLM reads."""

import json
from pathlib import Path

from safetensors.torch import load_file

from app.config import load_app_config
from app.lanes.identity_adapter import identity_adapter
from tests.fakes import TINY_MODEL, cpu_args, openai_surface


def test_the_identity_adapter_changes_nothing_and_fits_the_model():
    openai_surface(load_app_config(cpu_args()))  # generates the tiny model if needed
    folder = Path(identity_adapter(str(TINY_MODEL)))
    config = json.loads((TINY_MODEL / "config.json").read_text())
    weights = load_file(str(folder / "adapter_model.safetensors"))
    adapter = json.loads((folder / "adapter_config.json").read_text())
    assert adapter["r"] == 1 and adapter["target_modules"] == ["o_proj"] and adapter["peft_type"] == "LORA"
    a = weights["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"]
    b = weights["base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"]
    heads = config["num_attention_heads"]
    assert tuple(a.shape) == (1, heads * (config.get("head_dim") or config["hidden_size"] // heads))
    assert tuple(b.shape) == (config["hidden_size"], 1)
    assert not a.any() and not b.any()
    assert identity_adapter(str(TINY_MODEL)) == str(folder)  # written once per host and model shape
