import hashlib
import json

from app.tools.make_tiny_model import LLAMA31_8B_CONFIG, SHAPES, make_shaped_model, make_tiny_model


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_model_is_deterministic_and_about_a_million_parameters(tmp_path):
    first = make_tiny_model(tmp_path / "a")
    second = make_tiny_model(tmp_path / "b")
    assert first == second and 500_000 < first < 2_000_000
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert digest(tmp_path / "a" / name) == digest(tmp_path / "b" / name), name
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"


def test_chat_template_renders_roles(tmp_path):
    from transformers import AutoTokenizer

    make_tiny_model(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text == "<|begin_of_text|><|start|>user\nhi<|end_of_text|><|start|>assistant\n"


def test_shaped_model_has_the_real_config_and_a_tokenizer_covering_its_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    make_shaped_model(tmp_path, "llama-3.1-8b")
    config = json.loads((tmp_path / "config.json").read_text())
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size")} == {
        k: LLAMA31_8B_CONFIG[k] for k in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size")}
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == config["vocab_size"]
    # Every id decodes to visible text, so streamed chunks of a dummy-weight model are not empty.
    assert tokenizer.decode([config["vocab_size"] - 1]) == f"<|reserved_{config['vocab_size'] - 1}|>"
    assert not (tmp_path / "model.safetensors").exists()


def test_small_cpu_shape_uses_the_tiny_tokenizer_without_padding(tmp_path):
    from transformers import AutoTokenizer

    make_shaped_model(tmp_path, "llama-small-cpu")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == {**SHAPES["llama-small-cpu"], **{k: config[k] for k in ("bos_token_id", "eos_token_id",
                                                                              "pad_token_id")}}
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == config["vocab_size"] and "<|reserved_" not in tokenizer.decode(list(range(2000)))
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]


def test_a_model_from_an_older_generator_is_not_current(tmp_path):
    import json

    from app.tools.make_tiny_model import GENERATOR_VERSION, MARKER, is_current

    assert not is_current(tmp_path)  # nothing there
    (tmp_path / MARKER).write_text(json.dumps({"seed": 1234, "parameters": 1}))
    assert not is_current(tmp_path)  # made before the generator recorded its version: made again
    (tmp_path / MARKER).write_text(json.dumps({"seed": 1234, "parameters": 1, "generator": GENERATOR_VERSION}))
    assert is_current(tmp_path)
