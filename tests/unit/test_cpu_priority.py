"""The engine-process niceness helper, on real child processes (no engine needed)."""

import os
import subprocess
import sys
import time

import pytest

from app.lanes.cpu_priority import descendant_pids, renice_process_tree

# A child that starts a grandchild and a second thread, then sleeps: a small process tree like an engine's.
TREE_SCRIPT = """
import subprocess, sys, threading, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print(grandchild.pid, flush=True)
time.sleep(60)
"""


def thread_niceness(pid: int) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.fixture
def process_tree():
    child = subprocess.Popen([sys.executable, "-c", TREE_SCRIPT], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    deadline = time.monotonic() + 10
    while len(os.listdir(f"/proc/{child.pid}/task")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield child.pid, grandchild
    for pid in (grandchild, child.pid):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    child.wait()


def test_descendants_include_grandchildren(process_tree):
    child, grandchild = process_tree
    assert {child, grandchild} <= set(descendant_pids(os.getpid()))
    assert descendant_pids(child) == [grandchild]


def test_renice_raises_every_thread_of_every_descendant_and_leaves_the_root(process_tree):
    child, grandchild = process_tree
    own_before = os.getpriority(os.PRIO_PROCESS, 0)
    changed = renice_process_tree(child, 12, include_root=True)
    assert changed >= 3  # the child's two threads and the grandchild's
    assert set(thread_niceness(child)) == {12}
    assert set(thread_niceness(grandchild)) == {12}
    assert os.getpriority(os.PRIO_PROCESS, 0) == own_before  # the caller itself is not touched
    # Never lowers: asking for less than a thread already has changes nothing.
    assert renice_process_tree(child, 5, include_root=True) == 0
    assert set(thread_niceness(grandchild)) == {12}


def test_renice_out_of_range_names_the_range():
    with pytest.raises(ValueError, match="0..19"):
        renice_process_tree(os.getpid(), 25)
