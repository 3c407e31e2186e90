"""Losing a Ray node under load: a two-node Ray cluster on this machine (Ray's own `ray.cluster_utils.Cluster`: a
head node and a worker node, each a raylet of its own), the lanes on the worker node, the worker node removed (its
raylet and the rest of its Ray processes SIGKILLed, as when a host dies) while a batch and interactive requests run.
Serve starts the lost replicas again on the head node, the only node left with room for them; the batch finishes
with every line recorded exactly once. The recovery times are printed.

Placement: each lane asks for one unit of the custom resource `lane_host` (the lanes' `deployment.resources`); both
nodes have room for one lane set (2 units). While the app starts, a reservation actor holds the head node's units,
so the lanes go to the worker node; it is released before the node is removed, so the head node has room then, as a
spare node would. The Router and the PrefixCache ask for no custom resource and land on either node (when the Router
was on the lost node too, requests waited for its replacement as well).

Its own Ray cluster, not the shared app's `serve run`: the module stops the running app first (two clusters on one
machine would clash on ports) and, at the end, everything it started (the app, both nodes, their workers and the
engine processes under them), by the pids it started, never `ray stop`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

import httpx
import openai
import pytest
import yaml

from app.lanes.engine_reaper import descendants, doomed, kill_all, process_table, still_running
from tests.integration.conftest import (HTTP_PORT, kill_orphaned_engine_processes, wait_until, write_serve_config,
                                        write_shared_test_config)
from tests.integration.test_faults import assert_each_line_recorded_once, submit
from tests.integration.test_batch_api import wait_for_batch

pytestmark = pytest.mark.app("node-loss")

DASHBOARD_PORT = 8265
DASHBOARD = f"http://127.0.0.1:{DASHBOARD_PORT}"
URL = f"http://127.0.0.1:{HTTP_PORT}"
LANE_RESOURCE = "lane_host"
LANES = ("HotLane", "ColdLane")
BATCH_LINES = 120
START_TIMEOUT_S = 420
RECOVERY_TIMEOUT_S = 300
OUTLIVE_GRACE_S = 5


def write_node_loss_config(tmp_dir, tiny_model):
    config = write_shared_test_config(tmp_dir, tiny_model)
    document = yaml.safe_load(config.read_text())
    args = document["applications"][0]["args"]
    for lane in ("hot_lane", "cold_lane"):
        args[lane]["deployment"]["resources"] = {LANE_RESOURCE: 1}
    return write_serve_config(config, document)


def serve_replicas() -> dict[str, list[dict]]:
    """deployment -> its replicas (state, node_id, replica_id) from the dashboard's Serve API; {} while it answers
    nothing."""
    try:
        app = httpx.get(f"{DASHBOARD}/api/serve/applications/", timeout=10).json()["applications"]["llm-lanes"]
        return {name: deployment["replicas"] for name, deployment in app["deployments"].items()}
    except (httpx.HTTPError, KeyError, ValueError, TypeError):
        return {}


def lanes_running_on(node_id: str) -> bool:
    replicas = serve_replicas()
    return all(any(r["state"] == "RUNNING" and r["node_id"] == node_id for r in replicas.get(lane, []))
               for lane in LANES)


def engines_answer() -> bool:
    try:
        stats = httpx.get(f"{URL}/v1/admin/stats", timeout=10)
        return stats.status_code == 200 and all("running" in replicas[0]
                                                for replicas in stats.json()["lanes"].values())
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return False


def node_of_replica(full_id: str) -> str | None:
    """The node of a lane replica named by the app's `x-llm-lanes-replica` header (`app#Deployment#id`)."""
    _app, deployment, replica_id = full_id.split("#")
    for replica in serve_replicas().get(deployment, []):
        if replica["replica_id"] == replica_id:
            return replica["node_id"]
    return None


@dataclass
class Answer:
    sent: float
    answered: float
    status: int
    lane: str
    replica: str
    error: str = ""


@dataclass
class Probes:
    """An interactive and a flex completion every `interval_s`, each answer kept, until stopped."""

    model: str
    interval_s: float = 0.5
    answers: dict[str, list[Answer]] = field(default_factory=lambda: {"interactive": [], "flex": []})
    stopping: threading.Event = field(default_factory=threading.Event)

    def _loop(self, kind: str) -> None:
        body = {"model": self.model, "prompt": "still there?", "max_tokens": 4}
        if kind == "flex":
            body["service_tier"] = "flex"
        with httpx.Client(timeout=httpx.Timeout(120, connect=10)) as client:
            while not self.stopping.is_set():
                sent = time.monotonic()
                try:
                    response = client.post(f"{URL}/v1/completions", json=body)
                    answer = Answer(sent, time.monotonic(), response.status_code,
                                    response.headers.get("x-llm-lanes-lane", ""),
                                    response.headers.get("x-llm-lanes-replica", ""),
                                    "" if response.status_code == 200 else response.text[:200])
                except httpx.HTTPError as error:
                    answer = Answer(sent, time.monotonic(), 0, "", "", repr(error))
                self.answers[kind].append(answer)
                time.sleep(self.interval_s)

    def __enter__(self) -> "Probes":
        self.threads = [threading.Thread(target=self._loop, args=(kind,), daemon=True) for kind in self.answers]
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=130)


def first_success_after(answers: list[Answer], moment: float) -> Answer | None:
    return next((a for a in answers if a.sent >= moment and a.status == 200), None)


@pytest.fixture(scope="module")
def cluster(apps, tmp_path_factory, tiny_model):
    """Head node (2 CPUs) and worker node (1 CPU), each with 2 units of `lane_host`; the app deployed with its
    lanes on the worker node. Yields (cluster, worker node); stops all of it afterwards."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    apps.stop()  # the shared app's Ray cluster holds the same ports
    tmp_dir = tmp_path_factory.mktemp("node-loss")
    config = write_node_loss_config(tmp_dir, tiny_model)
    ours = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {LANE_RESOURCE: 2}, "include_dashboard": True,
        "dashboard_host": "127.0.0.1", "dashboard_port": DASHBOARD_PORT})
    try:
        worker = ours.add_node(num_cpus=1, resources={LANE_RESOURCE: 2})
        ray.init(address=ours.address, logging_level="ERROR")

        @ray.remote(num_cpus=0, resources={LANE_RESOURCE: 2})
        class Reservation:
            def ready(self) -> bool:
                return True

        reservation = Reservation.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            ours.head_node.node_id, soft=False)).remote()
        ray.get(reservation.ready.remote(), timeout=60)
        deployed = subprocess.run([os.path.join(os.path.dirname(sys.executable), "serve"), "deploy", str(config),
                                   "--address", DASHBOARD], capture_output=True, text=True, timeout=120)
        assert deployed.returncode == 0, deployed.stderr[-3000:]
        assert wait_until(lambda: lanes_running_on(worker.node_id) and engines_answer(),
                          timeout_s=START_TIMEOUT_S, interval_s=2), serve_replicas()
        remember_ours()
        ray.kill(reservation)  # the head node has room for the lanes again
        yield ours, worker
    finally:
        stop_everything(ours)


# Every process this module started, (pid -> start ticks), seen while it was still under this one: a worker node's
# processes leave the tree (to pid 1) when their raylet is killed.
OURS: dict[int, int] = {}


def remember_ours() -> None:
    table = process_table()
    OURS.update({pid: table[pid].start_ticks for pid in descendants(table, [os.getpid()])})


def stop_everything(ours) -> None:
    """The app (its replicas shut their engines down), the driver, both nodes; then whatever of ours outlived them
    (SIGKILL by pid and start time, so no one else's process)."""
    import ray
    from ray import serve

    remember_ours()
    try:
        if ray.is_initialized():
            serve.shutdown()
    finally:
        ray.shutdown()
        ours.shutdown()
    # Ray's workers exit once their raylet is gone; the engine reapers take the engines with them. What the removed
    # node left without its raylet may wait for nothing: a few seconds, then SIGKILL.
    if not wait_until(lambda: not still_running(process_table(), OURS), timeout_s=OUTLIVE_GRACE_S, interval_s=0.5):
        table = process_table()
        left = doomed(table, OURS)
        names = sorted(f"{pid} {table[pid].name}" for pid in left if pid in table)
        warnings.warn(f"processes of the node-loss cluster outlived it by {OUTLIVE_GRACE_S} s: killed {names}")
        kill_all(left)
    kill_orphaned_engine_processes()


def test_losing_the_lanes_node_under_load_recovers_on_the_head_node_and_loses_no_batch_line(cluster, served_model):
    ours, worker = cluster
    head = ours.head_node.node_id
    client = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=120)
    where = {name: sorted({r["node_id"][:8] for r in replicas}) for name, replicas in serve_replicas().items()}
    batch = submit(client, served_model, BATCH_LINES, max_tokens=200)
    assert wait_until(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 10, timeout_s=120)
    with Probes(served_model) as probes:
        time.sleep(3)
        before = client.batches.retrieve(batch.id).request_counts.completed
        assert before < BATCH_LINES, "the batch finished before the node was lost: make its lines longer"
        remember_ours()
        removed_at = time.monotonic()
        ours.remove_node(worker, allow_graceful=False)  # SIGKILL: the host is gone
        removed_s = time.monotonic() - removed_at
        assert wait_until(lambda: lanes_running_on(head), timeout_s=RECOVERY_TIMEOUT_S, interval_s=1), \
            serve_replicas()
        lanes_back_s = time.monotonic() - removed_at
        assert wait_until(lambda: first_success_after(probes.answers["interactive"], lanes_back_s + removed_at)
                          and first_success_after(probes.answers["flex"], lanes_back_s + removed_at),
                          timeout_s=120)
        done = wait_for_batch(client, batch.id, timeout_s=420)
        batch_done_s = time.monotonic() - removed_at
    # Recovery: the first 200 answered by a lane replica on the surviving node. (The lost node's replicas can answer
    # for a moment after their raylet is killed, until they notice; those answers do not count.)
    first_on_head = {kind: first_success_after(
        [a for a in probes.answers[kind] if a.replica and node_of_replica(a.replica) == head], removed_at)
        for kind in ("interactive", "flex")}
    assert all(first_on_head.values()), first_on_head
    failed = {kind: [(round(a.sent - removed_at, 1), a.status, a.error[:80]) for a in answers
                     if a.sent >= removed_at and a.status != 200] for kind, answers in probes.answers.items()}
    recovery = {kind: f"{a.answered - removed_at:.1f} s (lane {a.lane})" for kind, a in first_on_head.items()}
    print(f"\nnode loss: replicas by node before {where}; worker node removed (SIGKILL) in {removed_s:.1f} s with "
          f"{before}/{BATCH_LINES} batch lines done; lanes RUNNING on the head node after {lanes_back_s:.0f} s; "
          f"recovery (node removed -> first 200 from a replica on the head node): {recovery}; batch completed "
          f"{batch_done_s:.0f} s after the loss; non-200 after the loss: interactive {len(failed['interactive'])}, "
          f"flex {len(failed['flex'])} (first {failed['interactive'][:3]} {failed['flex'][:3]})")
    assert_each_line_recorded_once(client, done, BATCH_LINES)
    assert {lane: [r["node_id"] for r in serve_replicas()[lane] if r["state"] == "RUNNING"] for lane in LANES} == \
        {lane: [head] for lane in LANES}
