"""What the load generator's own process got from the host while it ran: CPU time and time spent runnable but
waiting for a CPU (Linux /proc/<pid>/schedstat of the event loop's thread). A generator that waits for a CPU sends
late, and its "TTFT" then measures the host, not the app (docs/benchmarks.md, the 2-core runs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SCHEDSTAT = Path("/proc/thread-self/schedstat")
# Linux's autogroup scheduling shares the CPU between sessions first and applies nice values only inside a session:
# with it on, the app's Ray workers (niceness 15, their own session) weigh as much as the generator's session, and on
# 2 cores the generator waited for a CPU 0.64-0.91 s per s. Off (as root: `echo 0 > <this file>`), it waited 0.02.
AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


@dataclass(frozen=True)
class SchedSample:
    on_cpu_s: float
    runqueue_wait_s: float


def parse_schedstat(text: str) -> SchedSample:
    """'<ns on CPU> <ns waiting on a run queue> <timeslices>' -> seconds."""
    on_cpu_ns, wait_ns, *_ = text.split()
    return SchedSample(int(on_cpu_ns) / 1e9, int(wait_ns) / 1e9)


def sample(path: Path = SCHEDSTAT) -> SchedSample | None:
    """The calling thread's totals so far; None where the kernel does not expose them (not Linux, schedstats off)."""
    try:
        return parse_schedstat(path.read_text())
    except (OSError, ValueError):
        return None


def usage(before: SchedSample | None, after: SchedSample | None, wall_s: float) -> dict[str, float] | None:
    """CPU time and run-queue wait between two samples, in seconds and per second of wall time."""
    if before is None or after is None or wall_s <= 0:
        return None
    on_cpu = after.on_cpu_s - before.on_cpu_s
    waiting = after.runqueue_wait_s - before.runqueue_wait_s
    return {"on_cpu_s": on_cpu, "runqueue_wait_s": waiting,
            "on_cpu_per_s": on_cpu / wall_s, "runqueue_wait_per_s": waiting / wall_s}


def autogroup_enabled(path: Path = AUTOGROUP_SWITCH) -> bool | None:
    """Whether the kernel schedules by autogroup (None: no such switch, e.g. not Linux or built without it)."""
    try:
        return path.read_text().strip() == "1"
    except OSError:
        return None
