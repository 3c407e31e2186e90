"""The engine-process niceness helper, on real child processes (no engine needed)."""

import os
import subprocess
import sys
import time

import pytest

from app.lanes.cpu_priority import descendant_pids, parse_cpu_list, pin_process, renice_process_tree

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


@pytest.mark.parametrize(("cpus", "expected"), [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0,2,4-5", {0, 2, 4, 5}),
                                                 (" 1 , 3 ", {1, 3})])
def test_cpu_lists_parse_as_the_kernel_writes_them(cpus, expected):
    assert parse_cpu_list(cpus) == expected


@pytest.mark.parametrize("cpus", ["", "a", "1-", "3-1", "0;1", "-1"])
def test_bad_cpu_lists_are_refused_with_the_syntax(cpus):
    with pytest.raises(ValueError, match="CPU list|backwards"):
        parse_cpu_list(cpus)


def test_pinning_sets_every_thread_and_a_process_started_after_inherits_it(process_tree):
    child, _ = process_tree
    core = min(os.sched_getaffinity(0))
    assert pin_process(child, {core}) >= 2  # the child's main thread and its sleeping thread
    assert all(os.sched_getaffinity(int(tid)) == {core} for tid in os.listdir(f"/proc/{child}/task"))
    # What the replica relies on: a process it starts afterwards (the engine core) inherits the pinned cores.
    pinned_before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {core})
        started = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                                 capture_output=True, text=True, check=True)
    finally:
        os.sched_setaffinity(0, pinned_before)
    assert started.stdout.strip() == str([core])
