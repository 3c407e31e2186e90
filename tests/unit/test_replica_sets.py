"""A lane without replicas is routed around at once: the registry the lanes' request routers report to, the
routers' reporting, and the Router's request path reading it (fakes for the lanes, the real pipeline)."""

from types import SimpleNamespace

import pytest

from app.classes import Lane
from app.prefix_cache import replica_sets
from app.prefix_cache.request_router import ReportsReplicaSet
from app.router import openai_api as api
from app.router.endpoints import CHAT
from tests.fakes import make_pipeline


@pytest.fixture(autouse=True)
def empty_registry():
    replica_sets.forget_all()
    yield
    replica_sets.forget_all()


def test_a_replica_seen_dead_stops_counting_before_the_controller_lists_it_off():
    assert replica_sets.routable_replicas("HotLane") is None  # nothing listed yet: nothing assumed down
    replica_sets.replicas_listed("HotLane", ["a#HotLane#1", "a#HotLane#2"])
    assert replica_sets.routable_replicas("HotLane") == 2
    replica_sets.replica_died("HotLane", "a#HotLane#1")
    replica_sets.replica_died("HotLane", "a#HotLane#9")  # never listed: nothing to take off
    assert replica_sets.routable_replicas("HotLane") == 1
    # The controller lists it still (before its health check): it stays dead.
    replica_sets.replicas_listed("HotLane", ["a#HotLane#1", "a#HotLane#2"])
    assert replica_sets.routable_replicas("HotLane") == 1
    # Listed off, then a replacement with a new id: counted as soon as the controller lists it running.
    replica_sets.replicas_listed("HotLane", ["a#HotLane#2"])
    replica_sets.replicas_listed("HotLane", ["a#HotLane#2", "a#HotLane#3"])
    assert replica_sets.routable_replicas("HotLane") == 2
    assert replica_sets.routable_replicas("ColdLane") is None


class SeenByServe:
    """Stands in for Serve's RequestRouter: what its own bookkeeping received."""

    def __init__(self):
        self._deployment_id = SimpleNamespace(name="HotLane")
        self.updates, self.deaths = [], []

    def update_replicas(self, replicas):
        self.updates.append(replicas)

    def on_replica_actor_died(self, replica_id):
        self.deaths.append(replica_id)


class ReportingRouter(ReportsReplicaSet, SeenByServe):
    pass


def replica(unique_id: str):
    full_id = f"app#HotLane#{unique_id}"
    return SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda: full_id))


def test_the_lanes_request_routers_report_what_serve_tells_them_and_keep_serves_own_bookkeeping():
    router = ReportingRouter()
    replicas = [replica("1"), replica("2")]
    router.update_replicas(replicas)
    assert router.updates == [replicas] and replica_sets.routable_replicas("HotLane") == 2
    router.on_replica_actor_died(replicas[0].replica_id)
    assert router.deaths == [replicas[0].replica_id] and replica_sets.routable_replicas("HotLane") == 1


async def answer(pipeline, service_tier: str | None = None):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if service_tier:
        body["service_tier"] = service_tier
    return await pipeline.answer(CHAT, body)


async def test_with_no_hot_replica_interactive_runs_on_the_cold_lane_and_goes_back_once_one_runs():
    pipeline, lanes, _ = make_pipeline()
    routable = {Lane.HOT: 0, Lane.COLD: 1}
    pipeline.control.routable_replicas = routable.get
    degraded = await answer(pipeline)
    assert degraded.headers()["x-llm-lanes-lane"] == "cold"
    assert degraded.headers()["x-llm-lanes-degraded"] == "hot_lane_down"
    assert not lanes["hot"].requests and lanes["cold"].requests[-1].priority == 10  # interactive's, ahead of batch
    # Realtime moves too while the cold lane starts requests in time (none measured yet: in time).
    realtime = await answer(pipeline, "priority")
    assert realtime.headers()["x-llm-lanes-lane"] == "cold" and lanes["cold"].requests[-1].priority == 0
    routable[Lane.HOT] = 1
    back = await answer(pipeline)
    assert back.headers()["x-llm-lanes-lane"] == "hot" and "x-llm-lanes-degraded" not in back.headers()
    assert len(lanes["hot"].requests) == 1


async def test_with_neither_lane_routable_realtime_is_503_and_interactive_is_left_to_wait_for_its_lane():
    pipeline, lanes, _ = make_pipeline()
    pipeline.control.routable_replicas = lambda lane: 0
    with pytest.raises(api.OpenAIError) as refused:
        await answer(pipeline, "priority")
    assert refused.value.status == 503 and refused.value.code == "hot_lane_down"
    assert refused.value.headers["Retry-After"] == "1"
    assert not lanes["hot"].requests and not lanes["cold"].requests
    # Interactive goes to its lane's handle, which holds it until a replica runs (here the fake lane answers).
    waited = await answer(pipeline)
    assert waited.headers()["x-llm-lanes-lane"] == "hot" and len(lanes["hot"].requests) == 1


async def test_a_call_waiting_for_its_first_chunk_is_decided_again_when_its_lane_loses_its_last_replica():
    """A call that reached the hot lane's handle before the lane went down would wait there for the replacement: it
    is taken back and served on the cold lane within a check (lane_call.LANE_DOWN_CHECK_S)."""
    import asyncio

    from tests.fakes import FakeLane

    pipeline, lanes, _ = make_pipeline({"hot": FakeLane("hot", delay_s=60), "cold": FakeLane("cold")})
    routable = {Lane.HOT: 1, Lane.COLD: 1}
    pipeline.control.routable_replicas = routable.get
    waiting = asyncio.create_task(answer(pipeline))
    await asyncio.sleep(0.2)
    assert len(lanes["hot"].requests) == 1 and not waiting.done()
    routable[Lane.HOT] = 0
    served = await asyncio.wait_for(waiting, timeout=5)
    assert served.headers()["x-llm-lanes-lane"] == "cold"
    assert "hot_lane_down" in served.headers()["x-llm-lanes-degraded"]
    # Leaving a lane without replicas is not one of the lane's failures: its breaker does not count it.
    assert not pipeline.control.breakers[Lane.HOT]._failure_times


async def test_a_call_is_left_in_its_lanes_handle_when_the_other_lane_cannot_take_it_either():
    """Both lanes without replicas (a rolling update of one-replica lanes), or batch work on a cold lane without
    replicas: nothing to move to, so the call keeps its place in the handle instead of being started again."""
    import asyncio

    from tests.fakes import FakeLane

    pipeline, lanes, _ = make_pipeline({"hot": FakeLane("hot", delay_s=1.0), "cold": FakeLane("cold", delay_s=1.0)})
    routable = {Lane.HOT: 1, Lane.COLD: 1}
    pipeline.control.routable_replicas = routable.get
    interactive = asyncio.create_task(answer(pipeline))
    flex = asyncio.create_task(answer(pipeline, "flex"))
    await asyncio.sleep(0.2)
    routable[Lane.HOT] = routable[Lane.COLD] = 0
    served = await asyncio.wait_for(interactive, timeout=10)
    assert served.headers()["x-llm-lanes-lane"] == "hot" and len(lanes["hot"].requests) == 1
    flexed = await asyncio.wait_for(flex, timeout=10)
    assert flexed.headers()["x-llm-lanes-lane"] == "cold" and len(lanes["cold"].requests) == 1
