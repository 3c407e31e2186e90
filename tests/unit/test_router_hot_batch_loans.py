"""Batch lent to the hot lane (admission.hot_batch_borrow_max) through the Router's real request path, fakes around
it: a loan is taken only while a slot is free and nothing latency-bound waits, and every loan comes back however the
request ends."""

import asyncio

from app.router import openai_api as api
from app.classes import Lane, RequestClass
from tests.unit.test_observability_wiring import FakeLane, make_router
from tests.unit.test_router_breaker_wiring import DeadLane, line


def borrowing_router(tmp_path, slots: int = 1, cold_slots: int = 0):
    """cold_slots: this Router's share of the cold lane's batch slots (0: full, so a loan is the next step)."""
    router = make_router(tmp_path, admission={"hot_batch_borrow_max": slots})
    router.control.cold_batch_slots = lambda: cold_slots
    return router


async def test_batch_runs_on_the_hot_lane_while_a_loan_is_free_and_returns_it(tmp_path):
    router = borrowing_router(tmp_path)
    result = await router._execute_batch_line_once(line(0))
    assert result["status_code"] == 200
    assert [r.request_class for r in router.lanes["hot"].requests] == ["batch"] and not router.lanes["cold"].requests
    assert router.lanes["hot"].requests[0].priority == 20  # batch priority on the hot engine, behind everyone
    assert router.control.hot_batch_loans == 0  # the request ended: its loan is back


async def test_no_loan_while_the_cold_share_has_room(tmp_path):
    router = borrowing_router(tmp_path, cold_slots=2)
    await router._execute_batch_line_once(line(0))
    assert not router.lanes["hot"].requests and len(router.lanes["cold"].requests) == 1
    assert router.control.batch_in_flight[Lane.COLD] == 0  # ended: its cold slot is free again
    router.control.batch_started(Lane.COLD)
    router.control.batch_started(Lane.COLD)  # the cold share is full now
    await router._execute_batch_line_once(line(1))
    assert len(router.lanes["hot"].requests) == 1


async def test_no_loan_when_the_loans_are_taken_or_latency_bound_work_waits(tmp_path):
    router = borrowing_router(tmp_path)
    router.control.batch_started(Lane.HOT)  # the one loan is in use
    await router._execute_batch_line_once(line(0))
    assert not router.lanes["hot"].requests and len(router.lanes["cold"].requests) == 1
    router.control.batch_ended(Lane.HOT)
    router.control.back_pressure.try_enqueue(RequestClass.INTERACTIVE)  # an interactive request waits here
    await router._execute_batch_line_once(line(1))
    assert not router.lanes["hot"].requests and len(router.lanes["cold"].requests) == 2


async def test_default_keeps_batch_off_the_hot_lane(tmp_path):
    router = make_router(tmp_path)
    router.control.cold_batch_slots = lambda: 0
    await router._execute_batch_line_once(line(0))
    assert not router.lanes["hot"].requests and router.control.hot_batch_loans == 0


async def test_a_failed_loan_is_returned(tmp_path):
    router = borrowing_router(tmp_path)
    router.lanes["hot"] = DeadLane("hot")
    result = await router._execute_batch_line_once(line(0))
    assert result["status_code"] == 503 and len(router.lanes["hot"].requests) == 1
    assert router.control.hot_batch_loans == 0


def test_the_dispatcher_claims_the_loans_on_top_of_its_cold_share(tmp_path):
    from app.batch.dispatcher import BatchDispatcher
    from app.batch.window import ConcurrencyWindow

    router = borrowing_router(tmp_path, slots=4)
    dispatcher = BatchDispatcher(router.batch_store, router._execute_batch_line, window=ConcurrencyWindow(16, 32),
                                 hot_loans=4)
    dispatcher.set_replica_counts(cold_replicas=2, router_replicas=1)
    assert (dispatcher.cold_capacity, dispatcher.capacity) == (32, 36)


class HoldingLane(FakeLane):
    """A lane whose requests hold their slot until the test lets them finish."""

    def __init__(self, name: str):
        super().__init__(name)
        self.release = asyncio.Event()

    def remote(self, request):
        stream = super().remote(request)
        release = self.release

        class Held(type(stream)):
            async def __anext__(self):
                await release.wait()
                return await super().__anext__()

        stream.__class__ = Held
        return stream


async def run_flex(router, i: int) -> str:
    body = api.CompletionRequest.model_validate({"model": "tiny", "prompt": f"hello {i}", "max_tokens": 4,
                                                 "service_tier": "flex"})
    _, generation = await router._start(body, "completion", None, router._new_record(None, "completion"))
    await router._collect("completion", "id", "tiny", generation)
    return generation.lane.value


async def test_flex_requests_wait_in_the_router_for_a_batch_slot_and_take_loans_as_they_free(tmp_path):
    router = make_router(tmp_path, admission={"hot_batch_borrow_max": 1}, batch={"flex_waits_for_window": True})
    router.control.cold_batch_slots = lambda: 1
    router.lanes = {"hot": HoldingLane("hot"), "cold": HoldingLane("cold")}
    tasks = [asyncio.create_task(run_flex(router, i)) for i in range(3)]
    await asyncio.sleep(0.05)
    # The cold share (1) first, then the hot lane's one loan; the third waits in the Router, not in a lane's queue.
    assert (len(router.lanes["cold"].requests), len(router.lanes["hot"].requests)) == (1, 1)
    assert len(router.batch_waiters) == 1 and router.control.hot_batch_loans == 1
    router.lanes["hot"].release.set()  # the loan ends: the waiting request takes it
    await asyncio.sleep(0.05)
    assert len(router.lanes["hot"].requests) == 2 and len(router.batch_waiters) == 0
    router.lanes["cold"].release.set()
    assert sorted(await asyncio.gather(*tasks)) == ["cold", "hot", "hot"]
    assert router.control.batch_in_flight == {Lane.HOT: 0, Lane.COLD: 0}
    assert router.control.batch_in_flight_peak == {Lane.HOT: 1, Lane.COLD: 1}


async def test_flex_requests_go_straight_to_their_lane_by_default(tmp_path):
    router = make_router(tmp_path)
    router.control.cold_batch_slots = lambda: 1
    router.lanes = {"hot": HoldingLane("hot"), "cold": HoldingLane("cold")}
    tasks = [asyncio.create_task(run_flex(router, i)) for i in range(3)]
    await asyncio.sleep(0.05)
    assert len(router.lanes["cold"].requests) == 3 and len(router.batch_waiters) == 0
    router.lanes["cold"].release.set()
    assert await asyncio.gather(*tasks) == ["cold"] * 3
