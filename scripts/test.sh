#!/usr/bin/env bash
# The test suite: unit tests (no Ray) then integration tests (real Ray Serve + real vLLM on CPU).
# pytest's exit code 5 (no tests collected) is a failure here, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

run() {  # run PYTEST_ARGS...: pytest, its "no tests collected" a failure
  .venv/bin/python -m pytest "$@"
  local status=$?
  if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests ($*): failing" >&2
    return 1
  fi
  return "$status"
}

# --durations: every run (CI's included) says which tests took the time; tests/conftest.py adds each file's total.
if [ "$#" -gt 0 ]; then
  run "$@" -ra --timeout=900 --durations=30
  exit $?
fi
# The unit tests hold no Ray cluster and no fixed port: on every core, each file's tests in one worker. The
# integration tests' apps take the whole machine, one at a time, so they run after them in one process.
run tests/unit -n auto --dist loadfile -ra --timeout=900 --durations=15
unit=$?
run tests/integration -ra --timeout=900 --durations=30
integration=$?
[ "$unit" -eq 0 ] && [ "$integration" -eq 0 ]
