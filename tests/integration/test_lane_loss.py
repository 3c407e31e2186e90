"""Losing a replica under load, on an app with two cold-lane replicas and two Router replicas: the app of
tests/integration/test_security.py (API keys; this module's requests are tenant B's), after that module's tests.
Marked `disrupts_app`: it kills replicas.

- One of two cold replicas killed (its engine with it) while flex requests and interactive streams run: no request
  fails. A flex request that was running on it had sent nothing yet (a non-streamed answer is one chunk), so the
  Router starts it again on the other replica; while the cold lane's breaker refuses, flex waits for it.
- One of two Router replicas killed while streams run through the proxy: only streams that were on it (its id in
  their `x-llm-lanes-router` header) can end early; every request sent after the kill is answered.
- The only hot replica killed: the streams under way resume on the cold lane; interactive requests sent after the
  kill run on the cold lane (the module's last test: the replacement is not waited for).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.integration.conftest import (KilledReplica, ReplicaKiller, deployment_replicas, orphaned_engine_processes,
                                        running_replicas, wait_until, wait_until_async)
from tests.integration.test_lifecycle import Load, Outcome
from tests.integration.test_security import APP, COLD_REPLICAS, KEY_B, ROUTERS, bearer, replicas_running, use_app

pytestmark = [pytest.mark.app(APP), pytest.mark.disrupts_app]


AFTER_KILL_TIMEOUT_S = 240
# Interactive probes long enough that one is under way at a kill (a few seconds on the CPU engine).
PROBE_TOKENS = 200
# Probes sent after the hot replica's kill, and answered, before the test looks at where they ran.
DEGRADED_PROBES = 6


@pytest.fixture(scope="module")
def lane_loss_app(apps):
    return use_app(apps)


def tenant_b(timeout: httpx.Timeout) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=timeout, headers=bearer(KEY_B))


def in_flight(load: Load, kind: str, since: float = 0.0, for_s: float = 1.0) -> bool:
    """A request of `kind` sent at `since` or later has been in flight for `for_s` or more."""
    now = time.monotonic()
    return any(o.kind == kind and not o.ended and o.started >= since and now - o.started >= for_s
               for o in load.outcomes)


def last_answered(load: Load, kind: str) -> Outcome | None:
    """The latest finished request of `kind` that names its replica (x-llm-lanes-replica)."""
    answered = [o for o in load.outcomes if o.kind == kind and o.finished and o.replica]
    return max(answered, key=lambda o: o.ended) if answered else None


async def run_load_around(load: Load, workers: list, killer: ReplicaKiller, kind: str, settle_s: float,
                          after_s: float, by_last_answer: bool = False) -> KilledReplica:
    """Run the load for `settle_s`, then kill once a request of `kind` is in flight (with `by_last_answer`: the
    replica that answered the latest one, once a request sent after that answer is in flight; else the killer's
    first), keep the load running `after_s` and until a request of `kind` sent a second after the kill has ended,
    stop it; the kill."""
    await asyncio.sleep(settle_s)
    deadline = time.monotonic() + 120
    while True:
        last = last_answered(load, kind) if by_last_answer else None
        if (last is not None or not by_last_answer) and in_flight(load, kind, since=last.ended if last else 0.0):
            break
        assert time.monotonic() < deadline, f"no {kind} request in flight to kill under for 120 s"
        await asyncio.sleep(0.1)
    kill = await asyncio.to_thread(killer.kill, last.replica if last else "")
    await asyncio.sleep(after_s)
    # And until a request of `kind` sent well after the kill has ended: what the test asks of the requests after it.
    deadline = time.monotonic() + AFTER_KILL_TIMEOUT_S
    while not any(o.kind == kind and o.ended and o.started > kill.killed_at + 1 for o in load.outcomes):
        assert time.monotonic() < deadline, f"no {kind} request sent after the kill ended within " \
                                            f"{AFTER_KILL_TIMEOUT_S} s of it"
        await asyncio.sleep(0.2)
    load.stop.set()
    await asyncio.gather(*workers)
    return kill


def describe(outcomes: list[Outcome]) -> list[tuple]:
    return [(o.kind, o.status, o.replica, o.error[:200]) for o in outcomes][:10]


async def flex_reaches_every_cold_replica(client: httpx.AsyncClient, url: str, model: str,
                                          timeout_s: float = 90) -> set[str]:
    """Rounds of concurrent short flex requests until their answers name COLD_REPLICAS different cold replicas (a
    Router's handle learns a replica some time after Serve reports it running); the replicas seen."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(seen) < COLD_REPLICAS and time.monotonic() < deadline:
        answers = await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
            "model": model, "prompt": f"warm {i}", "max_tokens": 32, "ignore_eos": True, "service_tier": "flex"})
            for i in range(2 * COLD_REPLICAS)))
        seen |= {a.headers.get("x-llm-lanes-replica", "") for a in answers if a.status_code == 200} - {""}
    return seen


async def test_losing_one_of_two_cold_replicas_fails_no_request(lane_loss_app, served_model):
    load = Load(lane_loss_app.url, served_model, flex_tokens=600)
    async with tenant_b(httpx.Timeout(300, connect=30)) as client:
        # The kill must hit a replica with load on it, and the other must be known to take the load over.
        warmed = await flex_reaches_every_cold_replica(client, lane_loss_app.url, served_model)
        assert len(warmed) == COLD_REPLICAS, f"flex requests reached only {sorted(warmed)}"
        killer = await asyncio.to_thread(ReplicaKiller, "ColdLane", only=False)
        try:
            workers = [asyncio.create_task(load.flex_forever(client)) for _ in range(6)]
            workers += [asyncio.create_task(load.stream_forever(client, i)) for i in range(2)]
            # The prefix cache's affinity can keep every flex request on one replica: the one answering is killed.
            kill = await run_load_around(load, workers, killer, "flex", settle_s=8, after_s=25,
                                         by_last_answer=True)
        finally:
            killer.close()
    flex = [o for o in load.outcomes if o.kind == "flex"]
    cold_replicas = {o.replica for o in flex if o.replica}
    across = [o for o in flex if o.started < kill.killed_at and o.ended > kill.sent_at]
    failed = [o for o in load.outcomes if not o.finished]
    print(f"cold replica killed: {len(load.outcomes)} requests, {len(flex)} flex ({len(across)} in flight at the "
          f"kill) on replicas {sorted(cold_replicas)}, {len(failed)} failed; flex (sent, ended) in s from the kill: "
          f"{[(round(o.started - kill.sent_at, 1), round(o.ended - kill.sent_at, 1)) for o in flex]}")
    assert kill.name in cold_replicas, (kill.name, cold_replicas)
    assert across, "no flex request was in flight at the kill: make them longer"
    assert not failed, describe(failed)
    assert wait_until(lambda: not orphaned_engine_processes(), timeout_s=30), orphaned_engine_processes()
    # Serve replaces the replica. The replacement starts while the next test runs (it needs the Routers, not the
    # cold lane); the hot replica's test, the module's last, waits until the app is whole again.
    killed_id = kill.name.rsplit("#", 1)[-1]

    def replaced() -> bool:
        replicas = deployment_replicas("ColdLane")
        return len(replicas) == COLD_REPLICAS and killed_id not in replicas

    assert wait_until(replaced, timeout_s=120), (killed_id, deployment_replicas("ColdLane"))


async def test_losing_one_of_two_router_replicas_fails_only_its_own_requests(lane_loss_app, served_model):
    assert wait_until(lambda: running_replicas("Router") == ROUTERS, timeout_s=240)
    load = Load(lane_loss_app.url, served_model)
    killer = ReplicaKiller("Router", only=False)
    try:
        async with tenant_b(httpx.Timeout(120, connect=30)) as client:
            workers = [asyncio.create_task(load.stream_forever(client, i)) for i in range(6)]
            kill = await run_load_around(load, workers, killer, "stream", settle_s=6, after_s=15)
    finally:
        killer.close()
    killed = kill.name.rsplit("#", 1)[-1]  # SERVE_REPLICA::app#Router#<unique id>, as x-llm-lanes-router names it
    # In flight while the kill was under way (between ray.kill's call and its return: the replica may die anywhere in
    # it, and on a busy host the call can take seconds).
    across = [o for o in load.outcomes if o.started < kill.killed_at and o.ended > kill.sent_at]
    # A request sent after the kill may still reach the dead replica before the proxy takes it out of rotation (its
    # first error does): a second after the kill, none may.
    after = [o for o in load.outcomes if o.started > kill.killed_at + 1]
    failed = [o for o in load.outcomes if not o.finished]
    routers = sorted({o.router for o in load.outcomes if o.router})
    print(f"Router replica {killed} killed: {len(load.outcomes)} streams, {len(across)} in flight at the kill "
          f"({sum(o.router == killed for o in across)} on it), {len(failed)} failed "
          f"({[o.error[:80] for o in failed]}); Routers that answered: {routers}")
    assert after and all(o.finished for o in after), describe([o for o in after if not o.finished])
    at_or_after = {id(o) for o in load.outcomes if o.started >= kill.sent_at}
    assert {id(o) for o in failed} <= {id(o) for o in across} | at_or_after, describe(failed)
    # Streams on the other Router replica carried on: the kill cut at most the ones the dead replica held (which
    # streams each replica holds is the proxy's choice; every stream says which one answered it).
    survivors_streams = [o for o in across if o.router and o.router != killed]
    assert all(o.finished for o in survivors_streams), describe([o for o in survivors_streams if not o.finished])
    assert all(o.router in ("", killed) for o in failed if id(o) in {id(a) for a in across}), describe(failed)
    assert wait_until(lambda: running_replicas("Router") == ROUTERS, timeout_s=120)


@dataclass
class Probe:
    sent: float
    ended: float = 0.0
    status: int = 0
    lane: str = ""
    replica: str = ""
    degraded: str = ""
    streaming: bool = False  # its first chunk came
    finished: bool = False
    error: str = ""


async def interactive_probes(client: httpx.AsyncClient, url: str, model: str, probes: list[Probe],
                             stop: asyncio.Event) -> None:
    """Short streamed interactive chats, back to back, each one's lane and x-llm-lanes-degraded kept."""
    while not stop.is_set():
        probe = Probe(time.monotonic())
        probes.append(probe)
        body = {"model": model, "messages": [{"role": "user", "content": "probe"}], "max_tokens": PROBE_TOKENS,
                "ignore_eos": True, "stream": True}
        try:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                probe.status = response.status_code
                probe.lane = response.headers.get("x-llm-lanes-lane", "")
                probe.replica = response.headers.get("x-llm-lanes-replica", "")
                probe.degraded = response.headers.get("x-llm-lanes-degraded", "")
                async for line in response.aiter_lines():
                    probe.streaming = True
                    if line == "data: [DONE]":
                        probe.finished = response.status_code == 200
                    elif line.startswith("data: ") and '"error"' in line:
                        probe.error = line[:300]
                if not probe.finished and not probe.error:
                    probe.error = (await response.aread()).decode()[:300]
        except httpx.HTTPError as error:
            probe.error = repr(error)
        probe.ended = time.monotonic()
        await asyncio.sleep(0.2)


async def test_losing_the_only_hot_replica_resumes_its_streams_and_serves_interactive_on_the_cold_lane(
        lane_loss_app, served_model):
    """kill -9 of the one HotLane replica: streams under way resume on the cold lane from the tokens they had sent
    (no error event), and interactive requests sent after it run on the cold lane at once (x-llm-lanes-degraded:
    hot_lane_down) instead of waiting in Serve's handle for the replacement."""
    assert wait_until(lambda: replicas_running(lane_loss_app), timeout_s=240)
    probes: list[Probe] = []
    stop = asyncio.Event()
    killer = await asyncio.to_thread(ReplicaKiller, "HotLane", only=True)
    try:
        async with tenant_b(httpx.Timeout(120, connect=30)) as client:
            workers = [asyncio.create_task(interactive_probes(client, lane_loss_app.url, served_model, probes, stop))
                       for _ in range(3)]
            # Killed while a stream on it is under way.
            assert await wait_until_async(lambda: any(p.lane == "hot" and p.streaming and not p.ended
                                                       for p in probes), 60), probes
            kill = await asyncio.to_thread(killer.kill)

            def served_after_the_kill() -> list[Probe]:
                return [p for p in probes if p.sent > kill.killed_at + 1 and p.ended]

            assert await wait_until_async(lambda: len(served_after_the_kill()) >= DEGRADED_PROBES, 120), probes
            stop.set()
            await asyncio.gather(*workers)
    finally:
        killer.close()
    across = [p for p in probes if p.sent < kill.sent_at < p.ended]
    # Sent a second after the kill: the Routers learn it from the first call that finds the replica dead, or from
    # the controller's health check. (Back on the hot lane once a replacement runs: tests/unit/test_replica_sets.py,
    # and the time it takes in load_tests/chaos.py.)
    after = served_after_the_kill()
    failed = [p for p in probes if p.ended and not p.finished]
    print(f"hot replica killed: {len(probes)} interactive requests ({len(across)} under way at the kill), "
          f"{len(after)} sent after it: lanes {sorted({(p.lane, p.degraded) for p in after})}; failed: "
          f"{[p.error[:80] for p in failed]}")
    assert across, "no request was under way at the kill"
    assert not failed, [(round(p.sent - kill.killed_at, 1), p.status, p.error[:160]) for p in failed][:10]
    assert all(p.lane == "cold" and "hot_lane_down" in p.degraded.split(",") for p in after), \
        [(round(p.sent - kill.killed_at, 1), p.lane, p.degraded) for p in after][:10]
    assert wait_until(lambda: not orphaned_engine_processes(), timeout_s=30), orphaned_engine_processes()
