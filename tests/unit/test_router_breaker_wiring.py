"""A failing lane's errors reach its circuit breaker through the Router's real request path (fakes around it)."""

from types import SimpleNamespace

from app.router.breaker import BreakerState
from app.classes import Lane
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
    refused = await _execute_batch_line_once(router.pipeline, line(99))
    assert refused["status_code"] == 503 and refused["body"]["error"]["code"] == "cold_breaker_open"
    assert len(router.lanes["cold"].requests) == calls, "an open breaker fails fast without calling the lane"


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
