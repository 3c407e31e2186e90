"""What every block of the schema shares: the strict base model and the small parsers its checks use."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


ALLOWED_BLOCK_SIZES = (16, 32, 64, 128)
# vLLM's CPU attention backend works on blocks that are a multiple of 32 tokens (measured, see DESIGN.md).
CPU_BLOCK_MULTIPLE = 32
# The tuning guide asks for health checks that answer in under 5 s.
MAX_HEALTH_CHECK_PERIOD_S = 5.0


def parse_cpu_list(cpus: str) -> set[int]:
    """"0", "0-3", "0,2,4-5" (the kernel's and vLLM's CPU-list syntax) -> {0, ...}; ValueError on anything else."""
    found: set[int] = set()
    for part in cpus.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{cpus!r} is not a CPU list: use e.g. \"0\", \"0-3\" or \"0,2\"")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"{cpus!r}: range {part!r} runs backwards")
        found.update(range(first, last + 1))
    return found


def is_postgres_url(location: str) -> bool:
    """batch.store: a postgresql:// (or postgres://) URL names a PostgreSQL database; anything else a SQLite file."""
    return location.startswith(("postgresql://", "postgres://"))


class StrictModel(BaseModel):
    """Unknown keys are rejected: a typo in a serve config must fail loudly, not be ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


