"""OS scheduling priority (niceness) for a lane's engine processes.

On a CPU host the engines compete for the same cores as Serve's HTTP proxy, the Router and the other lane. vLLM-CPU
keeps its worker threads busy between steps, so a saturated batch engine takes every cycle it can get, and a request
spends its time to first token waiting for a core in the proxy or the Router rather than in the hot engine. A
cold-lane engine at a higher niceness still gets every idle cycle, but yields the core whenever something less nice
is runnable: the lanes' separation applied to the CPU scheduler. Ray starts every worker process (proxy, replicas,
engines) at niceness 15, so only 16-19 change anything. Only ever raised: lowering it needs privileges.

Linux niceness is per thread, and threads inherit it when created. The engine's worker threads already exist when
this runs (after the engine started), so every thread of every descendant process is set.
"""

from __future__ import annotations

import logging
import os

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
