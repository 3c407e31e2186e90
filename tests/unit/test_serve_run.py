"""app.tools.serve_run's supervisor with a stand-in for `serve run` (a Python child that shuts down on
KeyboardInterrupt the way `serve run` does): every stop signal becomes one SIGINT for the child, also when the
supervisor started with SIGINT ignored (the background of a non-interactive shell), and a child that does not stop
is forced."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Like `serve run`: blocks; KeyboardInterrupt -> a graceful shutdown that takes a moment -> exit 0.
GRACEFUL_CHILD = """
import sys, time
try:
    print("ready", flush=True)  # inside the try: a signal right after it is already the graceful path
    while True:
        time.sleep(0.1)
except KeyboardInterrupt:
    print("graceful", flush=True)
    time.sleep(0.3)
    try:
        time.sleep(0.3)  # a second SIGINT here would cut the shutdown short
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(3)
    sys.exit(0)
"""

# A child that ignores SIGINT entirely: only the escalation stops it.
STUBBORN_CHILD = """
import signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""

SUPERVISE = ("import sys; from app.tools.serve_run import Supervisor; "
             "sys.exit(Supervisor([sys.executable, '-c', sys.argv[1]], float(sys.argv[2])).run())")


def supervise(child: str, stop_timeout_s: float = 10, ignore_sigint: bool = False) -> subprocess.Popen:
    def start_like_a_background_job():
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    process = subprocess.Popen([sys.executable, "-c", SUPERVISE, child, str(stop_timeout_s)], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True,
                               preexec_fn=start_like_a_background_job)
    assert process.stdout.readline().strip() == "ready"
    return process


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("ignore_sigint", [False, True], ids=["foreground", "background"])
def test_a_stop_signal_is_one_graceful_sigint_for_the_child(stop_signal, ignore_sigint):
    process = supervise(GRACEFUL_CHILD, ignore_sigint=ignore_sigint)
    process.send_signal(stop_signal)
    assert process.wait(timeout=60) == 0
    assert process.stdout.read().split() == ["graceful"]


def test_a_second_signal_forces_the_stop():
    process = supervise(STUBBORN_CHILD, stop_timeout_s=60)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    process.send_signal(signal.SIGTERM)  # forwarded as SIGTERM: the child's default action ends it
    assert process.wait(timeout=60) == 128 + signal.SIGTERM


def test_a_shutdown_past_its_timeout_is_forced():
    process = supervise(STUBBORN_CHILD, stop_timeout_s=0.5)
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)
    assert process.returncode != 0 and time.monotonic() - started < 5
