"""KV-budget arithmetic against hand-computed numbers (each expectation is written out in the comment above it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from app.tools.kv_budget.budget import FAIL, PASS, WARN, BudgetInputs, block_size_checks, compute_budget
from app.tools.kv_budget.cli import main
from app.tools.kv_budget.known_models import KNOWN_MODEL_CONFIGS
from app.tools.kv_budget.shape import (
    GIB, ModelShape, kv_bytes_per_token, kv_heads_per_rank, max_concurrent_sequences, parameter_count, tokens_fitting,
)
from app.tools.kv_budget.shared_gpu import SharedEngine, engine_footprint, shared_gpu_checks

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "models" / "tiny-llama" / "config.json"

LLAMA_3_1_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "attention_bias": False,
    "torch_dtype": "bfloat16",
}
QWEN2_5_32B = {
    "model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
    "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3, "topk_method": "noaux_tc",
    "num_nextn_predict_layers": 1, "max_position_embeddings": 163840, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def shape(config: dict) -> ModelShape:
    return ModelShape.from_config(config)


# ---- KV bytes per token ------------------------------------------------------------------------------------------


def test_llama_3_1_8b_kv_bytes_per_token():
    # 32 layers x 8 KV heads x 128 head_dim x 2 (K, V) x 2 B (fp16) = 131,072 B/token
    assert kv_bytes_per_token(shape(LLAMA_3_1_8B), 2) == 131_072
    # fp8: half of that
    assert kv_bytes_per_token(shape(LLAMA_3_1_8B), 1) == 65_536
    # fp32: twice
    assert kv_bytes_per_token(shape(LLAMA_3_1_8B), 4) == 262_144


def test_qwen2_5_32b_gqa_kv_bytes_and_tp_split():
    s = shape(QWEN2_5_32B)
    assert s.head_dim == 128  # 5120 hidden / 40 heads: no head_dim key in Qwen2's config
    # 64 layers x 8 KV heads x 128 x 2 x 2 B = 262,144 B/token for the whole model
    assert kv_bytes_per_token(s, 2) == 262_144
    # TP 2: 4 KV heads per rank -> 64 x 4 x 128 x 2 x 2 = 131,072 B/token on each GPU
    assert kv_heads_per_rank(s, 2) == 4
    assert kv_bytes_per_token(s, 2, tensor_parallel_size=2) == 131_072
    # TP 16 > 8 KV heads: vLLM replicates, each rank keeps 1 head -> 64 x 1 x 128 x 2 x 2 = 32,768
    assert kv_heads_per_rank(s, 16) == 1
    assert kv_bytes_per_token(s, 2, tensor_parallel_size=16) == 32_768


def test_deepseek_v3_mla_kv_bytes_per_token():
    s = shape(DEEPSEEK_V3)
    assert s.mla is not None
    # 61 layers x (512 kv_lora_rank + 64 qk_rope_head_dim) x 2 B = 70,272 B/token
    assert kv_bytes_per_token(s, 2) == 70_272
    # The latent is not split across TP ranks: every GPU of a TP 8 group holds all of it.
    assert kv_bytes_per_token(s, 2, tensor_parallel_size=8) == 70_272
    # Without MLA the same model would need 61 x 128 heads x 192 (nope+rope) ... far more; the check is the formula.


def test_tiny_model_kv_bytes_per_token():
    s = shape(json.loads(TINY_CONFIG.read_text()))
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.config_dtype) == (4, 1, 64, "float32")
    # 4 layers x 1 KV head x 64 x 2 x 4 B (float32) = 2,048 B/token
    assert kv_bytes_per_token(s, 4) == 2_048


def test_kv_bytes_agree_with_vllm_page_size():
    """vLLM's own KV spec gives the bytes of one block of one layer; ours x block_size / layers must match it."""
    torch = pytest.importorskip("torch")
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    block = 32
    for config, dtype, nbytes in ((LLAMA_3_1_8B, torch.float16, 2), (QWEN2_5_32B, torch.bfloat16, 2)):
        s = shape(config)
        spec = interface.FullAttentionSpec(
            block_size=block, num_kv_heads=s.num_kv_heads, head_size=s.head_dim, dtype=dtype
        )
        assert spec.page_size_bytes * s.num_layers == kv_bytes_per_token(s, nbytes) * block
    s = shape(DEEPSEEK_V3)
    mla = interface.MLAAttentionSpec(
        block_size=block, num_kv_heads=1, head_size=s.mla.kv_lora_rank + s.mla.qk_rope_head_dim, dtype=torch.bfloat16
    )
    assert mla.page_size_bytes * s.num_layers == kv_bytes_per_token(s, 2) * block
    tiny = shape(json.loads(TINY_CONFIG.read_text()))
    spec = interface.FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=64, dtype=torch.float32)
    assert spec.page_size_bytes * tiny.num_layers == kv_bytes_per_token(tiny, 4) * block


# ---- parameter counts (weight memory) ----------------------------------------------------------------------------


def test_llama_3_1_8b_parameter_count():
    # embeddings 128256 x 4096 = 525,336,576; lm_head the same (not tied)
    # per layer: q 4096x4096 + k,v 2 x 4096x1024 + o 4096x4096 = 41,943,040; MLP 3 x 4096 x 14336 = 176,160,768;
    #   2 norms 8,192 -> 218,112,000; x 32 = 6,979,584,000; final norm 4,096
    # total 525,336,576 x 2 + 6,979,584,000 + 4,096 = 8,030,261,248 (the published 8.03B)
    assert parameter_count(shape(LLAMA_3_1_8B)) == 8_030_261_248


def test_qwen2_5_32b_parameter_count_with_qkv_bias():
    # embeddings 152064 x 5120 = 778,567,680 (x2 with lm_head)
    # per layer: q 5120x5120 + 5120 bias, k and v 5120x1024 + 1024 bias each, o 5120x5120 = 62,921,728;
    #   MLP 3 x 5120 x 27648 = 424,673,280; norms 10,240 -> 487,605,248; x 64 = 31,206,735,872; final norm 5,120
    # total = 32,763,876,352 (the published 32.76B)
    assert parameter_count(shape(QWEN2_5_32B)) == 32_763_876_352


def test_deepseek_v3_parameter_count_mla_moe():
    # MLA per layer: q_a 7168x1536 + norm 1536 + q_b 1536x(128x192) + kv_a 7168x576 + norm 512 + kv_b 512x(128x256)
    #   + o (128x128)x7168 = 187,107,328
    # dense MLP (first 3 layers): 3 x 7168 x 18432 = 396,361,728
    # MoE layer: 256 x 3 x 7168 x 2048 + shared 3 x 7168 x 2048 + router 256 x 7168 + bias 256 = 11,320,164,608
    # 3 x (187,107,328 + 396,361,728 + 14,336) + 58 x (187,107,328 + 11,320,164,608 + 14,336)
    #   + embeddings and lm_head 2 x 129280 x 7168 + final norm 7168 = 671,026,419,200 (the published 671B)
    assert parameter_count(shape(DEEPSEEK_V3)) == 671_026_419_200


def test_tied_embeddings_drop_lm_head():
    tied = {**LLAMA_3_1_8B, "tie_word_embeddings": True}
    assert parameter_count(shape(LLAMA_3_1_8B)) - parameter_count(shape(tied)) == 128256 * 4096


def test_tiny_model_parameter_count():
    # embeddings 2048 x 128 x 2 = 524,288; per layer q 128x128, k,v 128x64, o 128x128 = 49,152 + MLP 3x128x384 =
    # 147,456 + norms 256 -> 196,864 x 4 = 787,456; + final norm 128 = 1,311,872
    assert parameter_count(shape(json.loads(TINY_CONFIG.read_text()))) == 1_311_872


def test_text_config_of_multimodal_model_is_read():
    wrapped = {"model_type": "llava", "text_config": LLAMA_3_1_8B}
    assert kv_bytes_per_token(shape(wrapped), 2) == 131_072


# ---- capacity ----------------------------------------------------------------------------------------------------


def test_tokens_fitting_rounds_down_to_whole_blocks():
    # 1000 B / (10 B/token x 16 tokens) = 6.25 blocks -> 6 blocks = 96 tokens
    assert tokens_fitting(1000, 10, 16) == 96
    # tiny model, 256 MiB: 268,435,456 / (2,048 x 32) = 4,096 blocks = 131,072 tokens
    assert tokens_fitting(256 * 1024**2, 2048, 32) == 131_072
    # one byte short of a block loses the whole block
    assert tokens_fitting(2048 * 32 * 10 - 1, 2048, 32) == 9 * 32


def test_max_concurrent_sequences_counts_whole_blocks():
    # 4,096 blocks of 32; a 2,048-token sequence takes 64 blocks -> 64 sequences
    assert max_concurrent_sequences(131_072, 2048, 32) == 64
    # 2,049 tokens take 65 blocks -> 4096 // 65 = 63
    assert max_concurrent_sequences(131_072, 2049, 32) == 63


def llama_inputs(**overrides) -> BudgetInputs:
    values = dict(
        shape=shape(LLAMA_3_1_8B), kv_precision="fp16", weight_precision="bf16", max_tokens=131072, batch_size=32,
        batch_is_requirement=True, max_seq_len=131072, block_size=32, tensor_parallel_size=1, gpu_memory_gib=80,
        gpu_memory_utilization=0.9,
    )
    return BudgetInputs(**{**values, **overrides})


def test_llama_8b_budget_on_80_gib():
    report = compute_budget(llama_inputs())
    # weights 8,030,261,248 x 2 B = 16,060,522,496
    assert report.weight_bytes == 16_060_522_496
    # usable int(80 GiB x 0.9) = 77,309,411,328; KV budget = 77,309,411,328 - 16,060,522,496 = 61,248,888,832
    assert report.usable_bytes_per_gpu == 77_309_411_328
    assert report.kv_budget_bytes_per_gpu == 61_248_888_832
    # blocks = 61,248,888,832 // (131,072 x 32) = 14,602 -> 467,264 tokens; 128K sequences: 14,602 // 4,096 = 3
    assert report.num_blocks == 14_602
    assert report.tokens_capacity == 467_264
    assert report.max_concurrent_sequences == 3
    # the tuning guide's 128K x 32: 131,072 B x 131,072 x 32 = 512 GiB exactly: does not fit, and it is a requirement
    assert report.required_kv_bytes == 512 * GIB
    statuses = {check.name: check.status for check in report.checks}
    assert statuses["batch fits"] == FAIL
    assert statuses["one max_seq_len sequence fits"] == PASS
    assert report.failed


def test_kv_memory_is_linear_in_batch_times_tokens():
    base = compute_budget(llama_inputs(batch_size=8, max_tokens=8192)).required_kv_bytes
    assert compute_budget(llama_inputs(batch_size=16, max_tokens=8192)).required_kv_bytes == 2 * base
    assert compute_budget(llama_inputs(batch_size=8, max_tokens=16384)).required_kv_bytes == 2 * base
    assert base == 131_072 * 8192 * 8
    report = compute_budget(llama_inputs(batch_size=8, max_tokens=8192))
    assert any("Linear in batch x tokens" in line and "not 4x" in line for line in report.arithmetic)


def test_derived_batch_only_warns():
    report = compute_budget(llama_inputs(batch_is_requirement=False))
    assert {c.name: c.status for c in report.checks}["batch fits"] == WARN
    assert not report.failed


def test_weights_that_do_not_fit_fail():
    # DeepSeek-V3 in bf16 on one 80 GiB GPU: 1.34 TB of weights, no KV memory left
    report = compute_budget(BudgetInputs(
        shape=shape(DEEPSEEK_V3), kv_precision="bf16", weight_precision="bf16", max_tokens=4096, batch_size=1,
        batch_is_requirement=True, max_seq_len=4096, tensor_parallel_size=1, gpu_memory_gib=80,
    ))
    names = {c.name: c.status for c in report.checks}
    assert names["weights fit"] == FAIL
    assert report.tokens_capacity == 0


def test_explicit_kv_cache_memory_bytes_is_the_budget():
    # the CPU engine of serve_configs/local.yaml: 256 MiB of KV for the tiny model -> 131,072 tokens
    report = compute_budget(BudgetInputs(
        shape=shape(json.loads(TINY_CONFIG.read_text())), kv_precision="fp32", weight_precision="fp32",
        max_tokens=2048, batch_size=64, batch_is_requirement=False, max_seq_len=2048, gpu_memory_gib=None,
        kv_cache_memory_bytes=268_435_456,
    ))
    assert report.tokens_capacity == 131_072
    assert report.max_concurrent_sequences == 64
    assert not report.failed


def test_tp_checks_for_heads():
    bad = compute_budget(llama_inputs(tensor_parallel_size=3, batch_size=1))
    statuses = {c.name: c.status for c in bad.checks}
    assert statuses["TP divides attention heads"] == FAIL  # 32 % 3
    assert statuses["TP and KV heads"] == FAIL  # 8 and 3
    good = compute_budget(llama_inputs(tensor_parallel_size=2, batch_size=1))
    assert good.kv_bytes_per_token_per_gpu == 65_536
    assert not good.failed


# ---- block rules -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_power_of_two_block_sizes_pass(block_size):
    assert [c.status for c in block_size_checks(block_size, 131072)] == [PASS, PASS]


@pytest.mark.parametrize("block_size", [8, 24, 48, 256])
def test_other_block_sizes_fail(block_size):
    assert block_size_checks(block_size, 131072 * 3)[0].status == FAIL


def test_max_seq_len_must_be_divisible_by_block_size():
    checks = block_size_checks(32, 1000)
    assert checks[1].status == FAIL
    assert "1000 % 32 = 8" in checks[1].detail


# ---- command line ------------------------------------------------------------------------------------------------


def write_config(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_cli_tuning_guide_invocation_fails_on_80_gib(tmp_path, capsys):
    folder = write_config(tmp_path, LLAMA_3_1_8B)
    code = main([
        "--model", str(folder), "--precision", "fp16", "--max_tokens", "131072", "--batch_size", "32",
        "--gpu-memory-gib", "80",
    ])
    out = capsys.readouterr().out
    assert code == 1
    assert "131,072 B/token" in out
    assert "FAIL  batch fits" in out


def test_cli_json_and_passing_exit(tmp_path, capsys):
    folder = write_config(tmp_path, LLAMA_3_1_8B)
    code = main([
        "--model", str(folder), "--precision", "fp16", "--max-tokens", "8192", "--batch-size", "4",
        "--gpu-memory-gib", "80", "--json",
    ])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["kv_bytes_per_token"] == 131_072
    assert data["failed"] is False
    assert {c["status"] for c in data["checks"]} == {PASS}


def test_cli_serve_config_local_reads_schema(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    code = main(["--serve-config", "serve_configs/local.yaml", "--lane", "hot", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["inputs"]["kv_cache_memory_bytes"] == 268_435_456
    assert data["inputs"]["kv_precision"] == "fp32"  # engine dtype float32
    assert data["tokens_capacity"] == 131_072


def test_cli_serve_config_hub_model_needs_model_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    unknown = tmp_path / "unknown.yaml"
    raw = yaml.safe_load((REPO / "serve_configs/prod.yaml").read_text())
    raw["applications"][0]["args"]["model"]["source"] = "example-org/not-a-shipped-model"
    unknown.write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit, match="--model-config"):
        main(["--serve-config", str(unknown)])
    config = write_config(tmp_path, QWEN2_5_32B) / "config.json"
    code = main([
        "--serve-config", str(REPO / "serve_configs/prod.yaml"), "--lane", "hot", "--model-config", str(config),
        "--gpu-memory-gib", "80", "--json",
    ])
    data = json.loads(capsys.readouterr().out)
    assert code == 0  # max_num_seqs x max_model_len not fitting is a WARN when --batch-size is not given
    assert data["inputs"]["tensor_parallel_size"] == 2
    assert data["kv_bytes_per_token_per_gpu"] == 131_072
    assert data["inputs"]["gpu_memory_utilization"] == 0.85


def test_cluster_readme_example_runs_as_written_with_the_shipped_numbers(tmp_path, monkeypatch, capsys):
    """cluster/README.md's command, with no config.json anywhere: prod.yaml's model has its numbers shipped."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    readme = " ".join((REPO / "cluster" / "README.md").read_text().split())  # prose wraps across lines
    command = "python -m app.tools.kv_budget --serve-config serve_configs/prod.yaml --lane hot --gpu-memory-gib 80"
    assert command in readme
    code = main(command.split()[3:])
    out, err = capsys.readouterr()
    assert code == 0
    assert "shipped for Qwen/Qwen2.5-32B-Instruct" in err
    assert "30.51 GiB per GPU" in out and "= 307,072 tokens" in out  # the README's figures
    assert "37 GiB" in readme and "307K tokens" in readme and "9 full 32K-token sequences" in readme
    # the shipped numbers are Qwen2.5-32B's config.json
    assert shape(KNOWN_MODEL_CONFIGS["Qwen/Qwen2.5-32B-Instruct"]) == shape(QWEN2_5_32B)


def test_a_config_json_in_the_hugging_face_cache_is_used(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "hub"
    snapshot = cache / "models--Qwen--Qwen2.5-32B-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({**QWEN2_5_32B, "num_hidden_layers": 32}))
    (cache / "models--Qwen--Qwen2.5-32B-Instruct" / "refs").mkdir()
    (cache / "models--Qwen--Qwen2.5-32B-Instruct" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(REPO)
    code = main(["--serve-config", "serve_configs/prod.yaml", "--lane", "hot", "--gpu-memory-gib", "80", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["inputs"]["shape"]["num_layers"] == 32  # the cached file, not the shipped numbers


# ---- engines sharing one GPU (--shared-gpu) ----------------------------------------------------------------------
H200_GIB = 140.40  # NVML's total for the H200 (143,771 MiB)


def test_gpu_single_fits_the_h200_as_measured(tmp_path, monkeypatch, capsys):
    # Round 10: three engines (two hot of 3 GiB KV, one cold of 74 GiB) peaked at 134,023 MiB. The sum is
    # 3 x 14.96 GiB of bf16 weights (8,030,261,248 parameters x 2 B) + 3 + 3 + 74 GiB of KV + 3 x 2 GiB = 130.87 GiB
    # = 134,011 MiB.
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_3_1_8B))
    monkeypatch.chdir(REPO)
    code = main(["--serve-config", "serve_configs/gpu-single.yaml", "--shared-gpu", "--model-config",
                           str(config), "--gpu-memory-gib", str(H200_GIB)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "3 engines on one GPU" in out and "together: 130.87 GiB of 140.40 GiB" in out
    assert "FAIL" not in out and out.count("starts last") == 3


def shared(name, kv_gib, utilization, num_gpus=0.25):
    weights = 8_030_261_248 * 2
    return SharedEngine(name, name.split()[0], weights, None if kv_gib is None else int(kv_gib * GIB),
                                  utilization, num_gpus)


def test_shared_gpu_start_up_check_names_the_engine_and_the_utilization_that_would_pass():
    engines = [shared("hot_lane replica 1", 3, 0.25), shared("hot_lane replica 2", 3, 0.15),
               shared("cold_lane replica 1", 74, 0.66, 0.5)]
    _, checks = shared_gpu_checks(engines, int(H200_GIB * GIB), 2 * GIB)
    by_name = {c.name: c for c in checks}
    # Started last, hot replica 1 finds 140.40 - 19.96 - 90.96 = 29.48 GiB free and wants 0.25 x 140.40 = 35.10.
    first = by_name["hot_lane replica 1 starts last"]
    assert first.status == FAIL and "hot_lane.engine.gpu_memory_utilization <= 0.2" in first.detail
    assert by_name["hot_lane replica 2 starts last"].status == PASS
    assert by_name["engines fit on the GPU"].status == PASS


def test_shared_gpu_that_does_not_fit_or_over_asks_for_gpus_fails():
    engines = [shared("hot_lane replica 1", 10, 0.15), shared("hot_lane replica 2", 10, 0.15),
               shared("cold_lane replica 1", 100, 0.66, 0.75)]
    _, checks = shared_gpu_checks(engines, int(H200_GIB * GIB), 2 * GIB)
    by_name = {c.name: c for c in checks}
    assert by_name["engines fit on the GPU"].status == FAIL and "short" in by_name["engines fit on the GPU"].detail
    assert by_name["one GPU's worth of num_gpus"].status == FAIL  # 0.25 + 0.25 + 0.75


def test_an_engine_without_a_byte_budget_holds_its_utilization_share():
    sized_by_share = shared("cold_lane replica 1", None, 0.5)
    assert engine_footprint(sized_by_share, 100 * GIB, 2 * GIB) == 50 * GIB
