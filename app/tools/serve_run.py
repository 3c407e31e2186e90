"""`serve run CONFIG` that stops cleanly on Ctrl-C, SIGINT and SIGTERM, in the foreground or in the background.

    python -m app.tools.serve_run serve_configs/local.yaml     # what scripts/serve-local.sh ends in

`serve run` alone shuts the app down gracefully (serve.shutdown(): every replica drains, the lanes stop their
engines, the Router's batch dispatcher gives its leases back) only on KeyboardInterrupt. Two ways of stopping it
miss that path:
- started in the background of a non-interactive shell (`scripts/serve-local.sh &` in a script, nohup), it inherits
  SIGINT as ignored (POSIX), Python then installs no KeyboardInterrupt handler, and `kill -INT` does nothing;
- SIGTERM (`kill PID`, systemd, a container runtime) reaches Ray's own handler, which exits at once: the local
  Ray cluster goes down with every replica SIGKILLed, so no replica drains and batch leases wait out lease_s.

So this process supervises `serve run` as a child in its own process group and turns the first SIGINT, SIGTERM or
SIGHUP it gets into one SIGINT for the child: the graceful path. A terminal's Ctrl-C reaches this process only (the
child is outside the terminal's foreground group), so the child never sees a second SIGINT that would cut its
shutdown short. A second signal, or a shutdown that overruns `--stop-timeout`, escalates: SIGTERM (Ray's handler
still takes the local cluster down), then SIGKILL of the child's process group (the lanes' engine reapers,
app/lanes/engine_reaper.py, then kill the engines).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from app.router.proxy_middlewares import PROXY_ENV

# Time for serve.shutdown() plus Ray's own stop after the first signal: replicas drain for up to their
# graceful_shutdown_timeout_s (default 20 s), the lanes then stop their engines.
DEFAULT_STOP_TIMEOUT_S = 120.0
# After SIGTERM, Ray's handler stops the local cluster within seconds (measured ~4 s with both lanes up).
TERM_TIMEOUT_S = 30.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Supervisor:
    """One `serve run` child and the escalation ladder SIGINT -> SIGTERM -> SIGKILL."""

    def __init__(self, argv: list[str], stop_timeout_s: float):
        self.argv = argv
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen | None = None
        self.signals_received = 0
        self._stopping = threading.Event()

    def on_signal(self, signum: int, _frame) -> None:
        self.signals_received += 1
        if self.process is None or self.process.poll() is not None:
            return
        if self.signals_received == 1:
            print(f"serve_run: {signal.Signals(signum).name}: shutting the app down gracefully "
                  f"(again to force)", file=sys.stderr, flush=True)
            self._send(signal.SIGINT)
            self._stopping.set()
        else:
            print("serve_run: forcing the stop", file=sys.stderr, flush=True)
            self._send(signal.SIGTERM)

    def _send(self, signum: int) -> None:
        try:
            os.kill(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def _kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def run(self) -> int:
        """Run the child to its end; its exit status, or 128 + N when signal N ended it (the shell's convention)."""
        code = self._run()
        return 128 - code if code < 0 else code

    def _run(self) -> int:
        # Handlers first: a caught signal is reset to its default in the child at exec, so `serve run` gets a
        # working SIGINT even when this process started with SIGINT ignored.
        for signum in STOP_SIGNALS:
            signal.signal(signum, self.on_signal)
        self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, process_group=0)
        while True:
            try:
                if self._stopping.is_set():
                    return self._wait_stopping()
                return self.process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                continue

    def _wait_stopping(self) -> int:
        try:
            return self.process.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            print(f"serve_run: not stopped after {self.stop_timeout_s:.0f} s: SIGTERM", file=sys.stderr, flush=True)
        self._send(signal.SIGTERM)
        try:
            return self.process.wait(timeout=TERM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print("serve_run: SIGKILL", file=sys.stderr, flush=True)
        self._kill_group()
        return self.process.wait()


def serve_command(config: str) -> list[str]:
    """`serve run CONFIG` with the `serve` entry point of this interpreter's environment."""
    serve = Path(sys.executable).with_name("serve")
    return [str(serve), "run", config]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="serve run CONFIG, stopped cleanly on SIGINT/SIGTERM/SIGHUP.")
    parser.add_argument("config", help="a Serve config file (serve_configs/*.yaml)")
    parser.add_argument("--stop-timeout", type=float, default=DEFAULT_STOP_TIMEOUT_S,
                        help="seconds the graceful shutdown may take before it is forced (default %(default)s)")
    args = parser.parse_args(argv)
    # Serve's HTTP proxy runs the app's middlewares: the arrival stamp (the Router's TTFT budget then counts the
    # proxy's wait too) and the replay of refusals to retries sent before their Retry-After.
    for name, value in PROXY_ENV.items():
        os.environ.setdefault(name, value)
    return Supervisor(serve_command(args.config), args.stop_timeout).run()


if __name__ == "__main__":
    sys.exit(main())
