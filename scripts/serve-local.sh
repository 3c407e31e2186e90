#!/usr/bin/env bash
# The main job: serve llm-lanes on the embedded default (CPU, tiny model, serve_configs/local.yaml).
# Stop it with Ctrl-C, or `kill PID` / `kill -INT PID` when it runs in the background: the app drains and shuts
# down, and the local Ray cluster that `serve run` started goes with it (app/tools/serve_run.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# Ray's token authentication on (an inherited RAY_AUTH_MODE=disabled is the only way to turn it off): Ray's own ports
# listen beyond loopback, and the token (~/.ray/auth_token, made at the first start) is what keeps them closed to
# others. The Ray CLI of the same user finds it there when run with RAY_AUTH_MODE=token.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
exec .venv/bin/python -m app.tools.serve_run "${1:-serve_configs/local.yaml}"
