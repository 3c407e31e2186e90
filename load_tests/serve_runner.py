"""Start the app under one serve config, wait until it answers, and tear everything down afterwards.

Start: `serve run CONFIG` in its own process group (env RAY_AUTH_MODE=disabled: Ray 2.60's CLI turns token auth on).
Ready: GET {url}/v1/models answers 200 and GET {url}/v1/admin/stats shows every lane's engine answering. The Router
answers /v1/models before the engines are up (a CPU engine starts ~30 s after it), so without the second check a
measurement would begin with the lanes still starting. Stop: `serve shutdown -y`, then the process group (SIGINT,
SIGTERM, SIGKILL, each after a grace period), then `ray stop --force` so the next config starts on a clean machine.
Commands are arguments so the lifecycle can be tested with a stand-in server.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from app.router.proxy_middlewares import PROXY_ENV
from load_tests.gpu_campaign import lanes_answering

READY_POLL_INTERVAL_S = 2.0
STOP_GRACE_S = 30.0
SHUTDOWN_COMMAND_TIMEOUT_S = 120.0
LOG_TAIL_CHARS = 4000


from load_tests.overlay import APP_IMPORT_PATH, llm_lanes_application  # noqa: F401  (re-exported)


def http_host(serve_config: dict[str, Any]) -> str:
    """The address a client on the same machine uses for the config's HTTP servers (the proxy, and the Router
    replicas' own servers under direct ingress, bind there)."""
    host = (serve_config.get("http_options") or {}).get("host") or "127.0.0.1"
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host


def app_url(serve_config: dict[str, Any]) -> str:
    """Where the config's HTTP proxy listens, as a client on the same machine reaches it."""
    return f"http://{http_host(serve_config)}:{(serve_config.get('http_options') or {}).get('port', 8000)}"


def _cli(name: str) -> str:
    """The CLI next to this interpreter (the project's venv) if there is one, else from PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def default_start_command(serve_config: str) -> list[str]:
    return [_cli("serve"), "run", serve_config]


def default_stop_commands() -> list[list[str]]:
    return [[_cli("serve"), "shutdown", "-y"]]


def default_cleanup_commands() -> list[list[str]]:
    return [[_cli("ray"), "stop", "--force"]]


def checkout_env() -> dict[str, str]:
    """PYTHONPATH that imports the app from the directory this runs in (a checkout other than the venv's editable
    install), ahead of any PYTHONPATH already set."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}


def sigint_default() -> None:
    """In the child before it runs the start command: SIGINT back to its default. Started from a shell's background
    (a script, `nohup`, CI) this process has SIGINT ignored, its children inherit that, and a Python child (`serve
    run`, vLLM's server) would then ignore the SIGINT that stops it gracefully: the stop would wait out its grace
    period and escalate."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class AppStartError(RuntimeError):
    pass


class ServedApp:
    def __init__(
        self,
        url: str,
        log_path: str | Path,
        start_command: list[str],
        stop_commands: list[list[str]] | None = None,
        cleanup_commands: list[list[str]] | None = None,
        ready_timeout_s: float = 600.0,
        ready_path: str = "/v1/models",
        lanes_path: str | None = "/v1/admin/stats",
        env: dict[str, str] | None = None,
        poll_interval_s: float = READY_POLL_INTERVAL_S,
        stop_grace_s: float = STOP_GRACE_S,
        headers: dict[str, str] | None = None,
    ):
        self.url = url.rstrip("/")
        self.log_path = Path(log_path)
        self.start_command = start_command
        self.stop_commands = stop_commands or []
        self.cleanup_commands = cleanup_commands or []
        self.ready_timeout_s = ready_timeout_s
        self.ready_path = ready_path
        self.lanes_path = lanes_path
        self.poll_interval_s = poll_interval_s
        # Sent with the readiness checks: an admin key, where the app has keys.
        self.headers = headers or {}
        # How long each of SIGINT and SIGTERM gets before the next, stronger signal.
        self.stop_grace_s = stop_grace_s
        # The proxy runs the app's middlewares (app/router/proxy_middlewares.py), as app.tools.serve_run has it.
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", **PROXY_ENV, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None
        self._log = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        # Its own session: the whole tree (serve, raylet, workers it spawns) can be signalled as one group.
        self.process = subprocess.Popen(
            self.start_command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
            preexec_fn=sigint_default,
        )

    def wait_ready(self) -> float:
        """Seconds it took until the ready path answered 200; raises AppStartError on exit or timeout."""
        assert self.process is not None, "start() first"
        began = time.monotonic()
        with httpx.Client(timeout=5.0, headers=self.headers) as client:
            while True:
                if self.process.poll() is not None:
                    raise AppStartError(
                        f"{' '.join(self.start_command)} exited with {self.process.returncode} before it was ready; "
                        f"log tail:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.url + self.ready_path).status_code == 200 and self._lanes_answer(client):
                        return time.monotonic() - began
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() - began > self.ready_timeout_s:
                    raise AppStartError(
                        f"{self.url}{self.ready_path} did not answer 200 (with every lane answering "
                        f"{self.lanes_path}) within {self.ready_timeout_s} s; "
                        f"log tail:\n{self.log_tail()}"
                    )
                time.sleep(self.poll_interval_s)

    def _lanes_answer(self, client: httpx.Client) -> bool:
        if self.lanes_path is None:
            return True
        response = client.get(self.url + self.lanes_path, timeout=10.0)
        return response.status_code == 200 and lanes_answering(response.json())

    def stop(self) -> None:
        """Always safe to call; leaves no process of ours behind."""
        for command in self.stop_commands:
            self._run_quietly(command)
        if self.process is not None and self.process.poll() is None:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(self.stop_grace_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.process is not None:
            # Stragglers left in the group after the leader exited.
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for command in self.cleanup_commands:
            self._run_quietly(command)
        if self._log is not None:
            self._log.close()
            self._log = None

    def _run_quietly(self, command: list[str]) -> None:
        try:
            subprocess.run(
                command, stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT, env=self.env,
                timeout=SHUTDOWN_COMMAND_TIMEOUT_S, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            if self._log is not None:
                self._log.write(f"\n[load_tests] {command}: {error}\n".encode())

    def log_tail(self) -> str:
        if self._log is not None:
            self._log.flush()
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> "ServedApp":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def serve_and_run(document: dict[str, Any], config_name: str, out: Path, ready_timeout_s: float,
                  body: Callable[[str], Any], log: Callable[[str], None],
                  headers: dict[str, str] | None = None) -> Any:
    """Serve `document` (written to OUT/served-<config_name>), wait until it is ready, return body(url), stop it.
    Raises AppStartError when it does not start. `headers` go with the readiness checks (an admin key)."""
    config_path = out / ("served-" + config_name)
    config_path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    url = app_url(document)
    app = ServedApp(url, out / "serve.log", start_command=default_start_command(str(config_path)),
                    stop_commands=default_stop_commands(), cleanup_commands=default_cleanup_commands(),
                    ready_timeout_s=ready_timeout_s, env=checkout_env(), headers=headers)
    log(f"starting `serve run {config_path}` (log: {app.log_path})")
    try:
        app.start()
        log(f"ready after {app.wait_ready():.0f} s")
        return body(url)
    finally:
        log("shutting down")
        app.stop()
