#!/usr/bin/env bash
# The main job: serve llm-lanes on the embedded default (CPU, tiny model, serve_configs/local.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
exec .venv/bin/serve run "${1:-serve_configs/local.yaml}"
