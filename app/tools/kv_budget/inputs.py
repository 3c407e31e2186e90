"""Reading the budget's inputs: the serve config (through the app schema), the model's config.json, the GPU's size,
and the command line's overrides."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from app.config import AppConfig, ConfigError, EngineSettings, load_app_config
from app.tools.kv_budget.budget import (
    ASSUMED_GPU_MEMORY_GIB, SCHEMA_BLOCK_SIZE, SCHEMA_GPU_MEMORY_UTILIZATION, BudgetInputs,
)
from app.tools.kv_budget.known_models import KNOWN_MODEL_CONFIGS
from app.tools.kv_budget.shape import GIB, ModelShape

# The tuning guide's validate_kv_cache.py example: a 128K context at batch 32.
GUIDE_MAX_TOKENS = 131072
GUIDE_BATCH_SIZE = 32


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


def hub_cache_config(repo_id: str) -> Path | None:
    """The model's config.json in the local Hugging Face cache (HF_HOME / HF_HUB_CACHE), without going online."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id: nothing cached under it
        return None
    return Path(found) if isinstance(found, str) else None


def model_config(source: str, search_roots: list[Path]) -> tuple[dict[str, Any], str] | None:
    """(config.json contents, where they came from): a local folder or file, else the Hugging Face cache, else the
    architecture numbers shipped for the models the serve configs name."""
    path = find_model_config(source, search_roots) or hub_cache_config(source)
    if path is not None:
        return json.loads(path.read_text()), str(path)
    if source in KNOWN_MODEL_CONFIGS:
        return KNOWN_MODEL_CONFIGS[source], f"the architecture numbers shipped for {source} (known_models.py)"
    return None


def model_shape(args: argparse.Namespace, app: AppConfig | None) -> ModelShape:
    """The model's shape from --model-config, --model, or the serve config's model source (its config.json)."""
    if args.model_config:
        found = model_config(args.model_config, []) if Path(args.model_config).is_file() else None
    elif args.model:
        found = model_config(args.model, [])
    elif app is not None:
        found = model_config(app.model.source, [Path(args.serve_config).resolve().parent.parent])
    else:
        raise SystemExit("give --model PATH, --model-config config.json or --serve-config FILE")
    if found is None:
        source = args.model_config or args.model or (app.model.source if app else "")
        raise SystemExit(
            f"no config.json for {source!r} on disk or in the Hugging Face cache: pass --model-config "
            "PATH/TO/config.json (e.g. downloaded with `huggingface-cli download MODEL config.json`)"
        )
    config, origin = found
    print(f"kv_budget: model config from {origin}", file=sys.stderr)
    return ModelShape.from_config(config)


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

