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
                           body={"model": "tiny", "prompt": "hello", "max_tokens": 4}, attempts=0)


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
