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
import sys
from dataclasses import asdict

from app.config import ConfigError
from app.tools.kv_budget.budget import compute_budget, format_report
from app.tools.kv_budget.inputs import _normalize_precision, build_inputs
from app.tools.kv_budget.shared_gpu import ENGINE_OVERHEAD_GIB, shared_gpu_main


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

