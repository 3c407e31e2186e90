"""Engine processes die with their lane replica.

A lane replica's vLLM engine runs in child processes (`VLLM::EngineCore`, `VLLM::Worker`...). When the replica exits
normally it shuts them down (`LaneReplica.__del__` -> `engine.shutdown()`), but when it is SIGKILLed -- `ray stop
--force`, the OOM killer, a node agent -- nothing tells them: they live on as orphans holding their memory (~1.4 GB
each on CPU, the whole KV cache on a GPU, so the replica Serve starts in its place may not fit). Without it, every
integration-test app stop leaves both lanes' engines running.

So each replica starts one small watcher process (`python -m app.lanes.engine_reaper`) in its own session, so that
signals meant for the replica's process group miss it. It waits for the replica's pid to end, then SIGKILLs the
engine processes it was given and everything under them, and exits; it also exits once those processes are gone on
their own. Processes are named by (pid, start time), so a pid the kernel has reused is never killed.

The process-table logic is plain functions over a snapshot (`ProcessInfo` by pid), tested without processes.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

# The folder holding the `app` package.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# How often the watcher looks at the replica's pid and the engines' pids (a few stat reads each time).
POLL_INTERVAL_S = 0.5


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    parent: int
    start_ticks: int  # /proc/<pid>/stat field 22: with the pid, names one process for its whole life
    name: str


def read_process(pid: int, proc: Path = Path("/proc")) -> ProcessInfo | None:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # The name is in parentheses and may itself contain spaces or parentheses: split around the last ")".
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return ProcessInfo(pid, int(fields[1]), int(fields[19]), name)


def process_table(proc: Path = Path("/proc")) -> dict[int, ProcessInfo]:
    table = {}
    for entry in os.listdir(proc):
        if entry.isdigit() and (info := read_process(int(entry), proc)) is not None:
            table[info.pid] = info
    return table


def descendants(table: Mapping[int, ProcessInfo], roots: Iterable[int]) -> set[int]:
    """Every process under `roots` (not the roots themselves)."""
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.parent, []).append(info.pid)
    found: set[int] = set()
    frontier = list(roots)
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def still_running(table: Mapping[int, ProcessInfo], watched: Mapping[int, int]) -> list[int]:
    """The watched pids (pid -> start ticks when first seen) that are still the same processes."""
    return [pid for pid, ticks in watched.items() if pid in table and table[pid].start_ticks == ticks]


def doomed(table: Mapping[int, ProcessInfo], watched: Mapping[int, int]) -> set[int]:
    """What to kill once the owner is gone: the watched processes still alive, and every process under them."""
    alive = still_running(table, watched)
    return set(alive) | descendants(table, alive)


def kill_all(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def snapshot(pids: Iterable[int]) -> dict[int, ProcessInfo]:
    """The table restricted to `pids` (a few stat reads instead of a walk of /proc)."""
    return {pid: info for pid in pids if (info := read_process(pid)) is not None}


def wait_for_exit(pid: int, start_ticks: int, engines: Mapping[int, int]) -> bool:
    """Block until process (pid, start_ticks) ends: True. False when the engines ended first (nothing to guard)."""
    while True:
        owner = read_process(pid)
        if owner is None or owner.start_ticks != start_ticks:
            return True
        if not still_running(snapshot(engines), engines):
            return False
        time.sleep(POLL_INTERVAL_S)


def start_engine_reaper(owner_pid: int | None = None) -> subprocess.Popen | None:
    """From a lane replica whose engine has started: watch this process and kill its engine processes (every
    process under it now) if it dies without stopping them. None when there is nothing to watch (an in-process
    engine) or no /proc (not Linux)."""
    owner_pid = owner_pid or os.getpid()
    try:
        table = process_table()
    except OSError:
        return None
    owner = table.get(owner_pid)
    engine_pids = sorted(descendants(table, [owner_pid]))
    if owner is None or not engine_pids:
        return None
    args = [sys.executable, "-m", "app.lanes.engine_reaper", "--owner", f"{owner_pid}:{owner.start_ticks}"]
    args += [f"{pid}:{table[pid].start_ticks}" for pid in engine_pids]
    # `app` importable however the replica found it (an installed package, PYTHONPATH or a Ray working_dir).
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    # Its own session: a signal to the replica's process group does not reach it, and it does not hold the
    # replica's terminal or pipes.
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True, env=env)


def _pid_and_ticks(text: str) -> tuple[int, int]:
    pid, ticks = text.split(":")
    return int(pid), int(ticks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Kill a lane replica's engine processes when the replica dies.")
    parser.add_argument("--owner", required=True, type=_pid_and_ticks, help="PID:START_TICKS of the replica")
    parser.add_argument("engines", nargs="+", type=_pid_and_ticks, help="PID:START_TICKS of each engine process")
    args = parser.parse_args(argv)
    engines = dict(args.engines)
    if wait_for_exit(*args.owner, engines):
        kill_all(doomed(process_table(), engines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
