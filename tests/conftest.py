from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / "models" / "tiny-llama"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The locally generated tiny model (made by scripts/setup.sh; made here if a test run skipped set-up)."""
    from app.tools.make_tiny_model import is_current, make_tiny_model

    if not is_current(TINY_MODEL):
        make_tiny_model(TINY_MODEL)
    return TINY_MODEL
