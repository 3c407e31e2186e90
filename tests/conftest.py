"""The suite's shared fixtures, and where its time goes: every run ends with each test file's total time (setup,
call and teardown of its tests), slowest first, and, from tests/integration/conftest.py, each app start. With
scripts/test.sh's `--durations` this is what a CI log says about a slow suite."""

from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / "models" / "tiny-llama"
MODULE_SECONDS: defaultdict[str, float] = defaultdict(float)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The locally generated tiny model (made by scripts/setup.sh; made here if a test run skipped set-up)."""
    from app.tools.make_tiny_model import is_current, make_tiny_model

    if not is_current(TINY_MODEL):
        make_tiny_model(TINY_MODEL)
    return TINY_MODEL


def pytest_runtest_logreport(report):
    MODULE_SECONDS[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    if not MODULE_SECONDS:
        return
    terminalreporter.section("seconds per test file (setup + call + teardown)")
    for module, seconds in sorted(MODULE_SECONDS.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {module}")
    terminalreporter.write_line(f"{sum(MODULE_SECONDS.values()):8.1f}  in all")
