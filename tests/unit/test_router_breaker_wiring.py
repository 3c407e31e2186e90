"""A failing lane's errors reach its circuit breaker through the Router's real request path (fakes around it)."""

import asyncio
from types import SimpleNamespace

from app.router.breaker import BreakerState
from app.classes import Lane, RequestClass
from app.router.batch_api import _execute_batch_line_once
from tests.fakes import FakeLane, make_router


class DeadStream:
    def __aiter__(self):
        return self

    async def __anext__(self):
        raise RuntimeError("the replica died")

    def cancel(self):
        pass


class DeadLane(FakeLane):
    def remote(self, request):
        self.requests.append(request)
        return DeadStream()


async def _execute_realtime(router) -> dict:
    from app.router import openai_api as api
    from app.router.endpoints import COMPLETION

    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "service_tier": "priority"}
    try:
        await router.pipeline.answer(COMPLETION, body)
    except api.OpenAIError as error:
        return {"status_code": error.status, "body": error.body()}
    return {"status_code": 200, "body": {}}


def line(i: int):
    return SimpleNamespace(batch_id="b", line_no=i, custom_id=f"c{i}", url="/v1/completions",
                           body={"model": "tiny", "prompt": "hello", "max_tokens": 4}, attempts=0,
                           tenant="default")


async def test_lane_failures_open_its_breaker_and_then_fail_fast(tmp_path):
    router = make_router(tmp_path)
    router.lanes["cold"] = DeadLane("cold")
    threshold = router.cfg.admission.breaker.failure_threshold
    for i in range(threshold):
        result = await _execute_batch_line_once(router.pipeline, line(i))
        assert result["status_code"] == 503 and result["body"]["error"]["code"] == "lane_unavailable"
    assert router.control.breakers[Lane.COLD].state is BreakerState.OPEN
    calls = len(router.lanes["cold"].requests)
    # Batch work waits in the Router for the open breaker (spill.py rule 6a) without calling the lane meanwhile.
    waiting = asyncio.create_task(_execute_batch_line_once(router.pipeline, line(99)))
    await asyncio.sleep(0.3)
    assert not waiting.done() and len(router.lanes["cold"].requests) == calls
    waiting.cancel()
    # Interactive work crosses to the hot lane; realtime fails fast (the hot lane's breaker here).
    for _ in range(threshold):
        router.control.finished(RequestClass.INTERACTIVE, Lane.HOT, ok=False, e2e_s=None)
    refused = await _execute_realtime(router)
    assert refused["status_code"] == 503 and refused["body"]["error"]["code"] == "hot_breaker_open"


def test_a_call_without_an_outcome_neither_resets_nor_adds_to_the_failure_streak():
    from app.classes import RequestClass
    from app.config import load_app_config
    from app.router.control import TrafficControl
    from tests.fakes import cpu_args

    control = TrafficControl(load_app_config(cpu_args()))
    threshold = control.cfg.admission.breaker.failure_threshold
    for _ in range(threshold - 1):
        control.finished(RequestClass.INTERACTIVE, Lane.HOT, ok=False, e2e_s=None)
    control.finished(RequestClass.INTERACTIVE, Lane.HOT, ok=None, e2e_s=None)  # a refused input, a client gone
    assert control.breakers[Lane.HOT].state is BreakerState.CLOSED
    control.finished(RequestClass.INTERACTIVE, Lane.HOT, ok=False, e2e_s=None)
    assert control.breakers[Lane.HOT].state is BreakerState.OPEN


async def test_batch_work_waiting_for_an_open_breaker_runs_once_the_lane_answers_again(tmp_path):
    router = make_router(tmp_path, admission={"breaker": {"failure_threshold": 2, "cooldown_s": 0.3,
                                                          "success_threshold": 1}})
    router.lanes["cold"] = DeadLane("cold")
    for i in range(2):
        await _execute_batch_line_once(router.pipeline, line(i))
    assert router.control.breakers[Lane.COLD].state is BreakerState.OPEN
    router.lanes["cold"] = FakeLane("cold")  # the replacement replica is up
    result = await asyncio.wait_for(_execute_batch_line_once(router.pipeline, line(9)), timeout=10)
    assert result["status_code"] == 200, result
    assert router.control.breakers[Lane.COLD].state is BreakerState.CLOSED
