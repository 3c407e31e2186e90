"""The tiny LoRA adapter generator: PEFT's layout and fields, every projection of every layer, seeded."""

import json

import pytest

from app.tools.make_tiny_lora import CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE, make_tiny_lora, projection_shapes
from app.tools.make_tiny_model import MODEL_SHAPE


@pytest.fixture
def base(tmp_path):
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**MODEL_SHAPE, "vocab_size": 2048}))
    return folder


def test_an_adapter_has_peft_fields_and_a_and_b_for_every_projection_of_every_layer(base, tmp_path):
    from safetensors.torch import load_file

    params = make_tiny_lora(base, tmp_path / "a", seed=1, rank=4)
    config = json.loads((tmp_path / "a" / CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["target_modules"] == list(TARGET_MODULES)
    tensors = load_file(str(tmp_path / "a" / WEIGHTS_FILE))
    shapes = projection_shapes(MODEL_SHAPE)
    assert len(tensors) == 2 * len(TARGET_MODULES) * MODEL_SHAPE["num_hidden_layers"]
    q_a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    down_b = tensors["base_model.model.model.layers.3.mlp.down_proj.lora_B.weight"]
    assert tuple(q_a.shape) == (4, shapes["q_proj"][0]) and tuple(down_b.shape) == (shapes["down_proj"][1], 4)
    assert down_b.abs().sum() > 0  # not PEFT's zero start: the adapter changes the answers
    assert params == sum(t.numel() for t in tensors.values())


def test_the_same_seed_gives_the_same_adapter_and_another_seed_another(base, tmp_path):
    for name, seed in (("a", 1), ("a2", 1), ("b", 2)):
        make_tiny_lora(base, tmp_path / name, seed=seed)
    weights = {name: (tmp_path / name / WEIGHTS_FILE).read_bytes() for name in ("a", "a2", "b")}
    assert weights["a"] == weights["a2"] and weights["a"] != weights["b"]


def test_kv_projections_follow_grouped_query_attention_and_a_rank_below_one_is_refused(base, tmp_path):
    shapes = projection_shapes(MODEL_SHAPE)
    head_dim = MODEL_SHAPE["hidden_size"] // MODEL_SHAPE["num_attention_heads"]
    assert shapes["k_proj"] == (MODEL_SHAPE["hidden_size"], MODEL_SHAPE["num_key_value_heads"] * head_dim)
    with pytest.raises(ValueError, match="--rank"):
        make_tiny_lora(base, tmp_path / "x", seed=1, rank=0)
