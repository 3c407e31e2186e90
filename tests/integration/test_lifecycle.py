"""The app's life cycle on the real stack, in the order a deployment lives it: a rolling update by `serve deploy`
under load fails no request; the README's serve command, started in the background, stops cleanly on SIGTERM (no
engine, Ray or zombie process left, no batch line left leased); started again, it finishes the batch that was under
way, every line recorded once.

Its own app ("lifecycle": the shared test config with room on the hot lane for the streams, started as the README's
serve command in the background), marked `disrupts_app`: the deploy leaves it on a changed config and the stop
test stops it. The tests run in this order, each on what the one before left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest
import yaml

from app.batch.sqlite_store import SqliteBatchStore
from app.lanes.engine_reaper import descendants, process_table, read_process
from tests.integration.conftest import (DASHBOARD, deployed_app, wait_until, write_serve_config,
                                        write_shared_test_config)
from tests.integration.test_batch_api import wait_for_batch
from tests.integration.test_faults import assert_each_line_recorded_once, submit

pytestmark = [pytest.mark.app("lifecycle"), pytest.mark.disrupts_app]

STREAM_TOKENS = 1800  # seconds on the hot lane: streams are in flight whenever the old replicas are told to stop
STREAMERS = 2
HOT_MAX_NUM_SEQS = 8  # the streams and the flex requests fit: nothing is refused for load
# Above the longest stream, as docs/operators.md asks of a rolling update: a stopping replica (Router or lane) keeps
# serving its open streams for this long. Serve's default (20 s) cuts a stream that is under way on the old Router.
DRAIN_S = 240
# Ray and vLLM processes that must not outlive a stopped app.
RAY_PROCESS_PREFIXES = ("VLLM::", "raylet", "gcs_server", "ray::")


@dataclass
class Outcome:
    kind: str  # "stream" | "flex"
    started: float
    ended: float = 0.0
    status: int = 0
    replica: str = ""
    router: str = ""  # the Router replica that answered (x-llm-lanes-router)
    finished: bool = False  # a stream ended with a finish_reason and [DONE]; a flex request got its completion
    error: str = ""
    cut: bool = False  # still under way when the test stopped the load and cancelled it: not an answer


@dataclass
class Load:
    """Interactive streams (back to back, STREAMERS at a time) and flex completions until `stop` is set."""

    url: str
    model: str
    flex_tokens: int = 32
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    outcomes: list[Outcome] = field(default_factory=list)

    async def stream_forever(self, client: httpx.AsyncClient, index: int) -> None:
        while not self.stop.is_set():
            outcome = Outcome("stream", time.monotonic())
            self.outcomes.append(outcome)
            body = {"model": self.model, "messages": [{"role": "user", "content": f"stream {index}"}],
                    "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
            try:
                async with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as response:
                    outcome.status, outcome.replica = response.status_code, response.headers.get(
                        "x-llm-lanes-replica", "")
                    outcome.router = response.headers.get("x-llm-lanes-router", "")
                    reason = None
                    async for line in response.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            outcome.finished = reason is not None
                            break
                        event = json.loads(line[len("data: "):])
                        if "error" in event:
                            outcome.error = json.dumps(event["error"])
                            break
                        reason = event["choices"][0].get("finish_reason") or reason
            except httpx.HTTPError as error:
                outcome.error = repr(error)
            except asyncio.CancelledError:
                outcome.cut, outcome.ended = True, time.monotonic()
                raise
            outcome.ended = time.monotonic()
            if not outcome.finished:
                await asyncio.sleep(1)  # a failure is counted once, not hammered on

    async def flex_forever(self, client: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            outcome = Outcome("flex", time.monotonic())
            self.outcomes.append(outcome)
            try:
                response = await client.post(f"{self.url}/v1/completions", json={
                    "model": self.model, "prompt": "flex", "max_tokens": self.flex_tokens, "ignore_eos": True,
                    "service_tier": "flex"})
                outcome.status, outcome.replica = response.status_code, response.headers.get(
                    "x-llm-lanes-replica", "")
                outcome.finished = response.status_code == 200 and bool(response.json()["choices"][0]["text"])
                if not outcome.finished:
                    outcome.error = response.text[:300]
            except httpx.HTTPError as error:
                outcome.error = repr(error)
            except asyncio.CancelledError:
                outcome.cut, outcome.ended = True, time.monotonic()
                raise
            outcome.ended = time.monotonic()
            await asyncio.sleep(0.5)


def updated(new_args: dict) -> bool:
    try:
        app = deployed_app()
    except (httpx.HTTPError, KeyError, ValueError):
        return False
    return (app["status"] == "RUNNING" and app["deployed_app_config"]["args"] == new_args
            and all(d["status"] == "HEALTHY" for d in app["deployments"].values()))


def write_lifecycle_config(tmp_dir, tiny_model):
    config = write_shared_test_config(tmp_dir, tiny_model)
    document = yaml.safe_load(config.read_text())
    args = document["applications"][0]["args"]
    args["hot_lane"]["engine"]["max_num_seqs"] = HOT_MAX_NUM_SEQS
    args.setdefault("router", {})["graceful_shutdown_timeout_s"] = DRAIN_S
    for lane in ("hot_lane", "cold_lane"):
        args[lane].setdefault("deployment", {})["graceful_shutdown_timeout_s"] = DRAIN_S
    return write_serve_config(config, document)


@pytest.fixture(scope="module")
def lifecycle_app(apps):
    return apps.use("lifecycle", write_lifecycle_config, readme_command=True)


async def test_serve_deploy_of_a_changed_config_under_load_fails_no_request(lifecycle_app, served_model, tmp_path):
    app_process = lifecycle_app
    document = yaml.safe_load(app_process.config.read_text())
    args = document["applications"][0]["args"]
    # An admission value and an engine argument: every deployment gets new init args, so every replica is replaced.
    args["admission"]["interactive_ttft_slo_s"] = args["admission"].get("interactive_ttft_slo_s", 2.0) + 1.0
    args["hot_lane"]["engine"]["max_num_seqs"] += 1
    new_config = write_serve_config(tmp_path / "changed.yaml", document)
    assert not updated(args)

    load = Load(app_process.url, served_model)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30)) as client:
        workers = [asyncio.create_task(load.stream_forever(client, i)) for i in range(STREAMERS)]
        workers.append(asyncio.create_task(load.flex_forever(client)))
        await asyncio.sleep(5)
        old_replicas = {o.replica for o in load.outcomes if o.replica}
        deploy_at = time.monotonic()
        deploy = await asyncio.to_thread(
            subprocess.run, [str(app_process.bin_dir / "serve"), "deploy", str(new_config), "--address", DASHBOARD],
            env=app_process.env, capture_output=True, text=True, timeout=300)
        assert deploy.returncode == 0, deploy.stderr
        # Done when Serve reports the new config running and the hot lane's new replica has served streams.
        done = False
        deadline = time.monotonic() + 360
        while not done and time.monotonic() < deadline:
            await asyncio.sleep(1)
            served_by_new = [o for o in load.outcomes if o.finished and o.replica and o.replica not in old_replicas]
            done = bool(served_by_new) and await asyncio.to_thread(updated, args)
        await asyncio.sleep(3)
        load.stop.set()
        # What is still under way runs on the new replicas (the old ones are gone): cut it rather than wait for it.
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    assert done, f"the update did not complete: {deployed_app()['status']}"

    cut = [o for o in load.outcomes if o.cut]
    assert not [o for o in cut if o.replica in old_replicas or o.started < deploy_at], cut
    failed = [o for o in load.outcomes if not o.finished and not o.cut]
    streams = [o for o in load.outcomes if o.kind == "stream"]
    # Streams that were running when the deploy went in, on the replicas it replaced.
    across = [o for o in streams if o.started < deploy_at < o.ended and o.replica in old_replicas]
    old_ends = [o.ended for o in streams if o.replica in old_replicas]
    new_starts = [o.started for o in streams if o.replica and o.replica not in old_replicas]
    print(f"rolling update: {len(load.outcomes)} requests ({len(streams)} streams, {len(across)} in flight at the "
          f"deploy), {len(failed)} failed; last stream on an old hot replica ended {max(old_ends) - deploy_at:.1f} s "
          f"after the deploy, first on a new one started {min(new_starts) - deploy_at:.1f} s after it")
    assert not failed, [(o.kind, o.status, o.error) for o in failed][:10]
    assert across, "no stream was in flight when the deploy went in: make the streams longer"


def app_processes(root_pid: int) -> dict[int, tuple[int, str]]:
    """Every process under `root_pid`: pid -> (start ticks, name)."""
    table = process_table()
    return {pid: (table[pid].start_ticks, table[pid].name) for pid in descendants(table, [root_pid])}


def survivors(processes: dict[int, tuple[int, str]]) -> list[str]:
    """The processes still there (running, or zombies nobody reaped), as 'pid name'."""
    left = []
    for pid, (ticks, name) in processes.items():
        info = read_process(pid)
        if info is not None and info.start_ticks == ticks:
            left.append(f"{pid} {name}")
    return left


def ray_processes_on_machine() -> list[str]:
    return sorted(f"{info.pid} {info.name}" for info in process_table().values()
                  if info.name.startswith(RAY_PROCESS_PREFIXES))


@dataclass
class StoppedBatch:
    """The batch that was running when the serve command was stopped: the restart test finishes it."""

    id: str = ""
    lines: int = 0


STOPPED_BATCH = StoppedBatch()


def test_the_serve_command_started_in_the_background_stops_cleanly_on_sigterm(lifecycle_app, served_model):
    """`kill PID` of the README's serve command started in the background (SIGINT ignored there): the app drains
    and exits 0, no engine, Ray or zombie process is left, and the batch under way has no line left leased. SIGINT,
    SIGHUP and the background's ignored SIGINT take the same path in app/tools/serve_run.py
    (tests/unit/test_serve_run.py)."""
    app = lifecycle_app
    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0, timeout=60)
    # More lines than the cold lane's window runs at once and its drain finishes: some are still waiting at the stop.
    STOPPED_BATCH.lines = 64
    batch = submit(client, served_model, STOPPED_BATCH.lines, max_tokens=400)
    STOPPED_BATCH.id = batch.id
    assert wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 5, timeout_s=120), \
        "the batch did not start"
    processes = app_processes(app.pid)
    assert any(name.startswith("VLLM::") for _, name in processes.values()), processes
    os.kill(app.pid, signal.SIGTERM)
    stopped_at = time.monotonic()
    try:
        exit_code = app.process.wait(timeout=180)
        took = time.monotonic() - stopped_at
        wait_until(lambda: not survivors(processes), timeout_s=15)
        left, ray_left = survivors(processes), ray_processes_on_machine()
    finally:
        app.stop()  # forces whatever is left (nothing, after a clean stop), for the next test
    print(f"SIGTERM: stopped in {took:.0f} s")
    assert exit_code == 0, app.log_path.read_text()[-3000:]
    assert not left and not ray_left, (left, ray_left)
    store = SqliteBatchStore(batch_store_path(app))
    try:
        backlog = store.backlog_stats()
        assert backlog.leased_lines == 0, backlog  # released (or recorded) by the stopping dispatcher, not expiring
        assert store.get_batch(batch.id).request_counts.completed < STOPPED_BATCH.lines, \
            "finished before the stop: make it longer"
    finally:
        store.close()


def test_a_batch_survives_a_full_application_restart(lifecycle_app):
    """The app started again on the same config after the stop above: the batch that was under way finishes, every
    line recorded exactly once."""
    assert STOPPED_BATCH.id, "the stop test did not leave a batch under way"
    app = lifecycle_app
    app.start()
    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert_each_line_recorded_once(client, wait_for_batch(client, STOPPED_BATCH.id, timeout_s=420),
                                   STOPPED_BATCH.lines)


def batch_store_path(app) -> str:
    document = yaml.safe_load(app.config.read_text())
    return document["applications"][0]["args"]["batch"]["store"]
