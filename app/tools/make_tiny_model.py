"""Generate the tiny Llama-architecture model that the CPU default and the tests serve.

    python -m app.tools.make_tiny_model models/tiny-llama
    python -m app.tools.make_tiny_model --shape llama-3.1-8b models/llama-8b-dummy   # GPU benchmarks
    python -m app.tools.make_tiny_model --shape llama-small-cpu models/llama-small-cpu   # CPU batch benchmark

The second form writes only a real model's config.json (Llama-3.1-8B's architecture values) plus the tiny tokenizer
padded with reserved tokens to that model's vocabulary size, for `load_format: dummy` (random weights, the real
kernels and memory footprint, no download).

No download of any kind: the byte-level BPE tokenizer is trained with `tokenizers` on text that ships with Python
itself (standard-library docstrings), and the weights are drawn from a seeded generator. The outputs are gibberish,
but every serving code path (tokenize, chat template, prefill, decode, prefix cache, priority, KV events) is real.
The same Python and package versions give byte-identical files.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
BOS, EOS, PAD = SPECIAL_TOKENS
# The markers of a Hermes-style tool call: vLLM's `hermes` tool-call parser finds calls between them (it needs both
# in the vocabulary, and turns skip_special_tokens off for requests with tools, so they reach it as text).
TOOL_CALL_TOKENS = ["<tool_call>", "</tool_call>"]
# Llama-3-style chat template, reduced to what a tiny model needs: role headers and an end-of-turn token; with
# `tools`, a Hermes-style system turn lists them, assistant tool calls are written as <tool_call> JSON and tool
# results as <tool_response>, so tool requests take every path on CPU. Without tools the prompt is the same as
# before tools were supported.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|start|>system\nYou may call these tools. <tools>"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools> "
    "Answer a call as <tool_call>{\"name\": <name>, \"arguments\": <object>}</tool_call>{{ eos_token }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}<|start|>assistant\n"
    "{% for call in message['tool_calls'] %}<tool_call>{\"name\": {{ call['function']['name'] | tojson }}, "
    "\"arguments\": {% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}</tool_call>{% endfor %}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}<|start|>tool\n<tool_response>{{ message['content'] }}</tool_response>"
    "{{ eos_token }}"
    "{% else %}<|start|>{{ message['role'] }}\n{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
# Python's own text: present on every machine with this interpreter, so training needs no download.
CORPUS_MODULES = [
    "asyncio", "collections", "json", "itertools", "functools", "pathlib", "dataclasses", "argparse",
    "logging", "subprocess", "threading", "socket", "http.client", "email", "unittest", "re", "string", "random",
    "statistics", "decimal", "fractions", "datetime", "calendar", "textwrap", "difflib", "heapq", "bisect",
]
# ~1M parameters: embeddings dominate; head_dim 64 is a size vLLM's CPU attention supports.
MODEL_SHAPE = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=16384,
)


# meta-llama/Llama-3.1-8B's architecture (the same values as ../shared/gpu/bench_engine.py).
LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
# ~26M parameters on the tiny tokenizer's 2,048 ids: a model whose decode step costs tens of milliseconds on one CPU
# core, so a CPU benchmark can weigh the serving path against an engine that does real work per step (with the
# ~1M-parameter tiny model a step is about a millisecond and the path's per-request cost is all there is to see).
LLAMA_SMALL_CPU_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 512, "initializer_range": 0.02,
    "intermediate_size": 1536, "max_position_embeddings": 16384, "mlp_bias": False, "num_attention_heads": 8,
    "num_hidden_layers": 8, "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
    "vocab_size": VOCAB_SIZE,
}
SHAPES = {"llama-3.1-8b": LLAMA31_8B_CONFIG, "llama-small-cpu": LLAMA_SMALL_CPU_CONFIG}


def corpus_lines() -> list[str]:
    lines: list[str] = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        for obj in [module, *(getattr(module, attr) for attr in sorted(dir(module)))]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str):
                lines.extend(line.strip() for line in doc.splitlines() if line.strip())
    return lines


def build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS + ["<|start|>"] + TOOL_CALL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE
    )
    fast.model_max_length = MODEL_SHAPE["max_position_embeddings"]
    fast.save_pretrained(out_dir)


def build_model(out_dir: Path) -> int:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **MODEL_SHAPE,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def make_shaped_model(out_dir: Path, shape: str) -> None:
    """config.json of a real architecture + the tiny tokenizer padded to its vocabulary.

    The padding goes into the BPE model's own vocabulary as plain tokens `<|reserved_N|>` (printable ASCII, which
    byte-level BPE maps to itself), so every id that random weights produce decodes to visible text. Padding with
    126k *added* tokens instead makes the tokenizer take minutes to load (measured on the H200 host).
    """
    from transformers import AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    config = dict(SHAPES[shape])
    tokenizer_file = out_dir / "tokenizer.json"
    document = json.loads(tokenizer_file.read_text())
    vocab = document["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in document.get("added_tokens", [])}
    for token_id in range(config["vocab_size"]):
        if token_id not in taken:
            vocab[f"<|reserved_{token_id}|>"] = token_id
    tokenizer_file.write_text(json.dumps(document, ensure_ascii=False))
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if len(tokenizer) != config["vocab_size"]:
        raise RuntimeError(f"padded tokenizer has {len(tokenizer)} ids, expected {config['vocab_size']}")
    config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "llm_lanes_tiny.json").write_text(json.dumps({"shape": shape, "load_format": "dummy"}) + "\n")


# What this generator makes, as its marker file records it: raised whenever the files it writes change (the chat
# template's tool calls, the tool-call tokens), so an older model in a checkout is made again instead of kept.
GENERATOR_VERSION = 2
MARKER = "llm_lanes_tiny.json"


def is_current(out_dir: Path) -> bool:
    """The folder holds a tiny model made by this version of the generator."""
    try:
        return json.loads((out_dir / MARKER).read_text()).get("generator") == GENERATOR_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def make_tiny_model(out_dir: Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    params = build_model(out_dir)
    (out_dir / MARKER).write_text(json.dumps({"seed": SEED, "parameters": params,
                                             "generator": GENERATOR_VERSION}) + "\n")
    return params


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to write the model into")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder already holds the model")
    parser.add_argument("--shape", choices=["tiny", *SHAPES], default="tiny",
                        help="tiny: ~1M-parameter model with weights; others: config.json only, for load_format dummy")
    args = parser.parse_args(argv)
    if args.shape == "tiny" and is_current(args.out_dir) and not args.force:
        print(f"model already at {args.out_dir} (use --force to rebuild)")
        return
    if args.shape != "tiny" and (args.out_dir / MARKER).exists() and not args.force:
        print(f"model already at {args.out_dir} (use --force to rebuild)")
        return
    if args.shape != "tiny":
        make_shaped_model(args.out_dir, args.shape)
        print(f"wrote {args.shape}-shaped config + padded tokenizer to {args.out_dir} (use load_format: dummy)")
        return
    params = make_tiny_model(args.out_dir)
    print(f"wrote tiny Llama model ({params:,} parameters) to {args.out_dir}")


if __name__ == "__main__":
    main()
