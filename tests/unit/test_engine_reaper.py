"""Engine processes die with their lane replica: the process-table rules (pure) and the watcher with real processes
standing in for a replica and its engine (no Ray, no vLLM)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.lanes import engine_reaper as reaper
from app.lanes.engine_reaper import ProcessInfo


def table(*rows):
    return {pid: ProcessInfo(pid, parent, ticks, name) for pid, parent, ticks, name in rows}


def test_descendants_follow_the_whole_tree_and_nothing_else():
    procs = table((10, 1, 100, "replica"), (11, 10, 101, "VLLM::EngineCore"), (12, 11, 102, "VLLM::Worker"),
                  (13, 12, 103, "helper"), (20, 1, 200, "other"), (21, 20, 201, "other-child"))
    assert reaper.descendants(procs, [10]) == {11, 12, 13}
    assert reaper.descendants(procs, [11]) == {12, 13}
    assert reaper.descendants(procs, [99]) == set()


def test_a_reused_pid_is_never_killed():
    # Engine 11 ended and the kernel gave its pid to an unrelated process (other start time): not ours.
    procs = table((11, 1, 999, "unrelated"), (12, 1, 102, "VLLM::Worker"), (13, 12, 103, "child"))
    watched = {11: 101, 12: 102}
    assert reaper.still_running(procs, watched) == [12]
    assert reaper.doomed(procs, watched) == {12, 13}


def test_read_process_parses_names_with_spaces_and_parentheses(tmp_path):
    (tmp_path / "42").mkdir()
    fields = ["S", "7"] + ["0"] * 17 + ["12345"] + ["0"] * 10
    (tmp_path / "42" / "stat").write_text(f"42 (VLLM::Worker (a) b) {' '.join(fields)}\n")
    assert reaper.read_process(42, tmp_path) == ProcessInfo(42, 7, 12345, "VLLM::Worker (a) b")
    assert reaper.read_process(43, tmp_path) is None


OWNER = textwrap.dedent("""
    import subprocess, sys, time
    from app.lanes.engine_reaper import start_engine_reaper
    # Stand-ins for the engine: a child, and a grandchild under it.
    engine = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "time.sleep(600)"])
    time.sleep(1.0)  # the grandchild is up
    watcher = start_engine_reaper()
    print(engine.pid, watcher.pid, flush=True)
    time.sleep(600)
""")


def alive(pid: int) -> bool:
    info = reaper.read_process(pid)
    return info is not None and Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_a_sigkilled_owner_takes_its_engine_processes_with_it():
    env = {**os.environ, "PYTHONPATH": str(reaper.PACKAGE_ROOT)}
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        engine_pid, watcher_pid = map(int, owner.stdout.readline().split())
        engine_tree = {engine_pid} | reaper.descendants(reaper.process_table(), [engine_pid])
        assert len(engine_tree) == 2 and all(alive(pid) for pid in engine_tree)
        time.sleep(2 * reaper.POLL_INTERVAL_S)
        assert alive(watcher_pid) and all(alive(pid) for pid in engine_tree)  # the owner lives: nothing is killed

        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(pid) for pid in engine_tree | {watcher_pid}):
            time.sleep(0.1)
        assert not any(alive(pid) for pid in engine_tree), "orphaned engine processes survived their owner"
        assert not alive(watcher_pid)  # and the watcher went with them
    finally:
        owner.kill()
        for pid in reaper.descendants(reaper.process_table(), [owner.pid]):
            os.kill(pid, signal.SIGKILL)


def test_nothing_to_watch_starts_no_watcher():
    # A process without children (an engine in the replica's own process), and a pid that is gone.
    childless = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert reaper.start_engine_reaper(childless.pid) is None
    finally:
        childless.kill()
        childless.wait(10)
    assert reaper.start_engine_reaper(childless.pid) is None
