#!/usr/bin/env bash
# The test suite: unit tests (no Ray) then integration tests (real Ray Serve + real vLLM on CPU).
# pytest's exit code 5 (no tests collected) is a failure here, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
# --durations: every run (CI's included) says which tests took the time; tests/conftest.py adds each file's total.
.venv/bin/python -m pytest "${@:-tests}" -ra --timeout=900 --durations=30
status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"
