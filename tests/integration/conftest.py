"""The real app under test: `serve run` on a copy of serve_configs/local.yaml (real Ray Serve, real vLLM on CPU).

It is the README's serve command path; only the ports differ so a developer's own app on :8000 is left alone.

One app runs at a time (one Ray cluster, the same ports). Each module asks for the app it needs by name through a
module-scoped fixture: `app_process` for the shared test app ("local-test"), or `apps.use(name, write_config)` for
its own. The session's AppManager keeps the running app while the next module asks for the same one and restarts
only when the name changes (or a module marked `disrupts_app` ran on it), so any file order works;
pytest_collection_modifyitems only groups modules by app (named by `pytest.mark.app(name)`) so each app starts once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from app.lanes.engine_reaper import descendants, kill_all, process_table
from app.proto import convert
from app.router import proxy_middlewares

ROOT = Path(__file__).resolve().parents[2]
HTTP_PORT = 18000
GRPC_PORT = 19000
# Ray's dashboard of the app's local cluster (`serve run` starts it there): Serve's replica states, read over HTTP.
DASHBOARD = "http://127.0.0.1:8265"
START_TIMEOUT_S = 420
TEST_MAX_NUM_SEQS = 8  # the cold lane's engine
# Two running sequences on the hot engine: a few requests are enough to make some wait inside it.
TEST_HOT_MAX_NUM_SEQS = 2
TEST_INTERACTIVE_QUEUE_BOUND = 24
TEST_MAX_FILE_BYTES = 1024 * 1024
# Every process of the test app appends its spans here (the file exporter), so a test can read whole traces.
SPAN_FILE = Path(tempfile.gettempdir()) / "llm-lanes-test-spans.jsonl"


SHARED_APP = "local-test"
# (app name, seconds from `serve run` to every lane answering), in the order started: the suite's summary lists them.
APP_STARTS: list[tuple[str, float]] = []


def pytest_configure(config):
    config.addinivalue_line("markers", "app(name): the integration app a module runs on (default: the shared one)")
    config.addinivalue_line("markers", "disrupts_app: the module leaves its app changed (killed replicas, restarts): "
                                       "the next module on that app gets a fresh one")


def pytest_terminal_summary(terminalreporter):
    if APP_STARTS:
        terminalreporter.section("integration app starts (seconds until every lane answers)")
        for name, seconds in APP_STARTS:
            terminalreporter.write_line(f"{seconds:8.1f}  {name}")
        terminalreporter.write_line(f"{sum(seconds for _, seconds in APP_STARTS):8.1f}  in all")


def app_name_of(item) -> str:
    marker = item.get_closest_marker("app")
    return marker.args[0] if marker else SHARED_APP


def pytest_collection_modifyitems(items):
    """Integration items grouped by app (the shared app first), each app's disruptive modules last; the order within
    a group is the collected one. For speed only: every module gets its own app whatever the order."""
    integration = [item for item in items if "tests/integration" in str(item.fspath)]
    for item in integration:
        item.add_marker(pytest.mark.integration)
    if not integration:
        return
    apps_in_order = [SHARED_APP] + list(dict.fromkeys(app_name_of(item) for item in integration))
    rank = {name: index for index, name in enumerate(dict.fromkeys(apps_in_order))}
    first = items.index(integration[0])
    chosen = set(integration)
    others = [item for item in items if item not in chosen]
    integration.sort(key=lambda item: (rank[app_name_of(item)], item.get_closest_marker("disrupts_app") is not None))
    items[:] = others[:first] + integration + others[first:]


def local_test_document(tiny_model: Path) -> tuple[dict, dict]:
    """serve_configs/local.yaml on the test ports and the generated tiny model: (the document, its app's args)."""
    document = yaml.safe_load((ROOT / "serve_configs" / "local.yaml").read_text())
    document["http_options"]["port"] = HTTP_PORT
    # local.yaml has no gRPC proxy (it would listen beyond loopback without keys); the tests turn it on.
    document["grpc_options"] = {"port": GRPC_PORT, "grpc_servicer_functions": [
        convert.LLM_LANES_SERVICER_FUNCTION, convert.HEALTH_SERVICER_FUNCTION]}
    args = document["applications"][0]["args"]
    args["model"]["source"] = str(tiny_model)
    return document, args


def write_serve_config(path: Path, document: dict) -> Path:
    """A test's serve config (a changed local_test_document) as the YAML file `serve run` takes."""
    path.write_text(yaml.safe_dump(document))
    return path


@dataclass(frozen=True)
class KilledReplica:
    name: str  # the actor's name, SERVE_REPLICA::<app>#<deployment>#<replica id>
    sent_at: float  # time.monotonic() just before ray.kill
    killed_at: float  # and when it returned


class ReplicaKiller:
    """A process connected to the cluster (tests/integration/replica_kill.py) that kills one replica of `deployment`
    when `kill()` is called: its only one (`only`), else the one named or the first by name of two or more.
    Connecting takes seconds to minutes on a busy host; the kill, once connected, milliseconds."""

    def __init__(self, deployment: str, *, only: bool):
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.replica_kill", deployment,
             "--only" if only else "--one-of-several"],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._next_json()
        if ready is None:
            self._process.wait(timeout=60)
            raise AssertionError(f"the replica killer for {deployment} exited ({self._process.returncode})")
        self.replicas: list[str] = ready["ready"]

    def _next_json(self) -> dict | None:
        """The killer's next JSON line (past anything else a library printed); None once it exited."""
        for line in self._process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        return None

    def kill(self, name: str = "") -> KilledReplica:
        assert not name or name in self.replicas, (name, self.replicas)
        self._process.stdin.write(f"{name}\n")
        self._process.stdin.flush()
        killed = self._next_json()
        assert killed, f"the replica killer exited ({self._process.wait()}) without killing {name or self.replicas[0]}"
        self._process.wait(timeout=60)
        return KilledReplica(**killed)

    def close(self) -> None:
        """Let the killer go without a kill (a test that failed before it): with its stdin closed it leaves the
        replicas alone and exits. Nothing to do after kill()."""
        if self._process.poll() is None:
            self._process.stdin.close()
            self._process.wait(timeout=60)


def kill_replica(deployment: str, *, only: bool) -> KilledReplica:
    """Kill one replica of `deployment` now (ReplicaKiller)."""
    return ReplicaKiller(deployment, only=only).kill()


def write_shared_test_config(tmp_dir: Path, tiny_model: Path) -> Path:
    document, args = local_test_document(tiny_model)
    # Small engines and short limits so contention, queues, deadlines and breakers show within seconds on 2 cores.
    args["hot_lane"]["engine"]["max_num_seqs"] = TEST_HOT_MAX_NUM_SEQS
    args["cold_lane"]["engine"]["max_num_seqs"] = TEST_MAX_NUM_SEQS
    args["admission"].update(interactive_queue_bound=TEST_INTERACTIVE_QUEUE_BOUND,
                             breaker={"failure_threshold": 3, "cooldown_s": 15})
    SPAN_FILE.unlink(missing_ok=True)
    args["observability"] = {"tracing": {"exporter": "file", "file_path": str(SPAN_FILE)}}
    args["batch"] = {"store": str(tmp_dir / "batches.sqlite3"), "lease_s": 5,
                     "max_file_bytes": TEST_MAX_FILE_BYTES}
    return write_serve_config(tmp_dir / "local-test.yaml", document)


def orphaned_engine_processes() -> set[int]:
    """vLLM engine processes (`VLLM::EngineCore`, `VLLM::Worker`...) left without their lane replica (parent pid 1),
    and everything under them. A running app's engines have their replica as parent."""
    procs = process_table()
    orphans = [info.pid for info in procs.values() if info.name.startswith("VLLM::") and info.parent == 1]
    return set(orphans) | descendants(procs, orphans)


def kill_orphaned_engine_processes(grace_s: float = 10) -> list[int]:
    """After `ray stop --force` (which SIGKILLs the replicas): give each replica's engine reaper
    (app/lanes/engine_reaper.py) `grace_s` to kill its engine, then SIGKILL whatever is left, with a warning. Before
    the reaper, every app stop left both lanes' engines running (~1.4 GB per engine on this CPU, measured
    2026-12-04: a second test run on one machine then ran out of memory); this stays as the suite's safety net."""
    wait_until(lambda: not orphaned_engine_processes(), timeout_s=grace_s)
    left = sorted(orphaned_engine_processes())
    if left:
        warnings.warn(f"{len(left)} vLLM engine processes outlived their replicas by {grace_s} s: killed {left}")
        kill_all(left)
    return left


def serve_local_command(config: Path) -> list[str]:
    """The README's serve command. Run from another environment than the repository's own .venv (a worktree), its
    set-up step would build that .venv, so the script's last line is run directly instead."""
    if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():
        return [str(ROOT / "scripts" / "serve-local.sh"), str(config)]
    return [sys.executable, "-m", "app.tools.serve_run", str(config)]


class AppProcess:
    """`serve run CONFIG` as a child process group: start, wait until every lane answers, stop, restart.

    With `readme_command` the app is the README's serve command (scripts/serve-local.sh CONFIG) started in the
    background of a non-interactive shell, as a script or an unattended job starts it (SIGINT ignored): `pid` is that
    command's process, for a test that stops it as `kill PID` does.

    The app runs in the test's own session (a process group of its own, not a session of its own): with the kernel's
    autogroup scheduling on, as on the CI host, each session gets an equal share of the CPU before nice values count,
    so an app in a session of its own, its Ray workers busy at niceness 15, left the test process and the commands
    it runs waiting for a CPU (`serve deploy` under load: 90-120 s, 1.3 s in one session). In one session the test's
    clients at niceness 0 come first, as a user's clients on another machine would.

    One app at a time (one Ray cluster, one app name, the same ports): starting one stops any other."""

    running: set["AppProcess"] = set()

    def __init__(self, config: Path, log_path: Path, headers: dict[str, str] | None = None,
                 readme_command: bool = False):
        """`headers`: sent with the readiness poll of /v1/admin/stats (an admin key where the app has keys)."""
        self.config = config
        self.log_path = log_path
        self.headers = headers or {}
        self.readme_command = readme_command
        self.bin_dir = Path(sys.executable).parent
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1",
                    **proxy_middlewares.PROXY_ENV}
        self.url = f"http://127.0.0.1:{HTTP_PORT}"
        self.process: subprocess.Popen | None = None
        self.pid = 0

    def start(self) -> None:
        for other in list(AppProcess.running - {self}):
            other.stop()
        AppProcess.running.add(self)
        if self.readme_command:
            command = " ".join(map(str, serve_local_command(self.config)))
            # `&` in a non-interactive shell: the command starts with SIGINT ignored.
            self.process = subprocess.Popen(["bash", "-c", f"{command} >>{self.log_path} 2>&1 & echo $!; wait $!"],
                                            cwd=ROOT, env=self.env, stdout=subprocess.PIPE, text=True,
                                            process_group=0)
            self.pid = int(self.process.stdout.readline())
        else:
            log = self.log_path.open("a")
            self.process = subprocess.Popen([str(self.bin_dir / "serve"), "run", str(self.config)], cwd=ROOT,
                                            env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            process_group=0)
            log.close()
            self.pid = self.process.pid
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the serve command exited with {self.process.returncode}; log: {self.log_path}\n"
                                   + self.log_path.read_text()[-4000:])
            try:
                # The Router answers before the engines are up: wait until every lane reports engine stats.
                stats = httpx.get(f"{self.url}/v1/admin/stats", headers=self.headers, timeout=10)
                if stats.status_code == 200 and all("running" in replicas[0]
                                                    for replicas in stats.json()["lanes"].values()):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"app did not answer within {START_TIMEOUT_S} s; log: {self.log_path}\n"
                                   + self.log_path.read_text()[-4000:])
            time.sleep(1)

    def stop(self) -> None:
        """Stop the app at once and make sure no Ray or engine process is left: SIGKILL to the serve command's
        process group, `ray stop --force` for Ray's workers, then each lane replica's engine reaper
        (app/lanes/engine_reaper.py) must end its engine (kill_orphaned_engine_processes says when one did not).
        The graceful stop (drain, exit 0) has its own test in test_lifecycle.py; here it would only cost every app
        change ~15 s."""
        AppProcess.running.discard(self)
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        subprocess.run([str(self.bin_dir / "ray"), "stop", "--force"], env=self.env, capture_output=True,
                       timeout=120)
        kill_orphaned_engine_processes()

    def restart(self) -> None:
        self.stop()
        self.start()


class AppManager:
    """The session's one running app, known by name. `use` hands back the running app when it has the name asked
    for, else stops it and starts the asked one from `write_config(tmp_dir, tiny_model)`."""

    def __init__(self, tmp_path_factory, tiny_model: Path):
        self._tmp_path_factory = tmp_path_factory
        self._tiny_model = tiny_model
        self.name: str | None = None
        self.app: AppProcess | None = None
        self.dirty = False

    def use(self, name: str, write_config: Callable[[Path, Path], Path],
            ready: Callable[[AppProcess], bool] | None = None,
            headers: dict[str, str] | None = None, readme_command: bool = False) -> AppProcess:
        """The app `name`, running; `ready` (if given) must hold before it is handed over (e.g. replica counts);
        `headers` go with the readiness poll (an admin key where the app has keys); `readme_command`: started as
        the README's serve command in the background (AppProcess)."""
        if self.app is not None and self.name == name and not self.dirty:
            return self.app
        self.stop()
        tmp_dir = self._tmp_path_factory.mktemp(name)
        app = AppProcess(write_config(tmp_dir, self._tiny_model), tmp_dir / "serve.log", headers, readme_command)
        self.name, self.app, self.dirty = name, app, False
        started = time.monotonic()
        app.start()
        if ready is not None:
            assert wait_until(lambda: ready(app), timeout_s=60), f"app {name} did not get ready; log: {app.log_path}"
        APP_STARTS.append((name, time.monotonic() - started))
        return app

    def mark_dirty(self) -> None:
        self.dirty = True

    def stop(self) -> None:
        if self.app is not None:
            self.app.stop()
        self.name, self.app, self.dirty = None, None, False


@pytest.fixture(scope="session")
def apps(tmp_path_factory, tiny_model) -> Iterator[AppManager]:
    manager = AppManager(tmp_path_factory, tiny_model)
    try:
        yield manager
    finally:
        manager.stop()


@pytest.fixture(scope="module")
def app_process(request, apps) -> Iterator[AppProcess]:
    """The shared test app (write_shared_test_config). A module marked `disrupts_app` leaves it to be restarted."""
    app = apps.use(SHARED_APP, write_shared_test_config)
    yield app
    if request.node.get_closest_marker("disrupts_app") is not None:
        apps.mark_dirty()


@pytest.fixture(scope="module")
def app_url(app_process) -> str:
    return app_process.url


@pytest.fixture(scope="session")
def served_model() -> str:
    document = yaml.safe_load((ROOT / "serve_configs" / "local.yaml").read_text())
    return document["applications"][0]["args"]["model"]["served_name"]


@pytest.fixture(scope="module")
def openai_client(app_url):
    import openai

    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=120)


def deployed_app(app_name: str = "llm-lanes") -> dict:
    """The application as the dashboard's Serve API reports it (an HTTP request: a poll of `serve status` would start
    a Ray client process each time, taking the CPU from the replicas being waited for)."""
    return httpx.get(f"{DASHBOARD}/api/serve/applications/", timeout=10).json()["applications"][app_name]


def deployment_replicas(deployment: str) -> dict[str, str]:
    """replica id -> state (STARTING, RUNNING...) of one of the app's deployments (deployed_app); {} while the
    dashboard answers nothing."""
    try:
        return {replica["replica_id"]: replica["state"]
                for replica in deployed_app()["deployments"][deployment]["replicas"]}
    except (httpx.HTTPError, KeyError, ValueError, TypeError):
        return {}


def running_replicas(deployment: str) -> int:
    return list(deployment_replicas(deployment).values()).count("RUNNING")


def lane_stats(app_url: str) -> dict[str, dict]:
    """lane -> stats of its (single, in local.yaml) replica, from GET /v1/admin/stats."""
    body = httpx.get(f"{app_url}/v1/admin/stats", timeout=10).json()
    return {lane: replicas[0] for lane, replicas in body["lanes"].items()}


def router_stats(app_url: str) -> dict:
    return httpx.get(f"{app_url}/v1/admin/stats", timeout=10).json()["router"]


def wait_until(predicate, timeout_s: float = 30, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


async def wait_until_async(predicate, timeout_s: float = 30, interval_s: float = 0.1):
    """wait_until for async tests: the predicate runs in a thread so the test's own requests keep flowing."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while True:
        value = await asyncio.to_thread(predicate)
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(interval_s)
