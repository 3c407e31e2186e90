"""A lost lane replica on the Router's real request path (fake lanes): a request not started yet is started again, a
started stream ends with an OpenAI error event, and Ray's actor errors become LaneReplicaLost at the lane clients."""

from __future__ import annotations

import pytest

from app.classes import Lane
from app.lanes.types import LaneReplicaLost
from app.router import openai_api as api
from app.router.endpoints import CHAT, COMPLETION
from app.router import lane_call
from app.router.lane_call import LANE_LOSS_RETRIES
from tests.fakes import FakeLane, lane_chunks, make_pipeline


class LostStream:
    """A call on a replica that dies after `chunks_before` chunks."""

    def __init__(self, request, chunks_before: int):
        self.chunks = lane_chunks(request, "hot")
        self.sent, self.chunks_before = 0, chunks_before
        self.cancelled = False

    async def __anext__(self):
        if self.sent >= self.chunks_before:
            raise LaneReplicaLost("the lane replica is gone: ActorDiedError")
        self.sent += 1
        return self.chunks[self.sent - 1]

    def cancel(self):
        self.cancelled = True


class LosingLane(FakeLane):
    """Its first `losses` calls land on a replica that dies (after `chunks_before` chunks); later ones stream."""

    def __init__(self, name: str, losses: int, chunks_before: int = 0):
        super().__init__(name)
        self.losses, self.chunks_before = losses, chunks_before

    def remote(self, request):
        if len(self.requests) < self.losses:
            self.requests.append(request)
            return LostStream(request, self.chunks_before)
        return super().remote(request)


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 6, **fields}


async def test_a_request_lost_before_its_first_token_is_started_again():
    lanes = {"hot": LosingLane("hot", losses=1), "cold": FakeLane("cold")}
    pipeline, _, _ = make_pipeline(lanes)
    answer = await pipeline.answer(COMPLETION, completion())
    assert answer.response["choices"][0]["text"] == "abcdef"
    assert len(lanes["hot"].requests) == 2  # the lost call, then the one that answered
    assert answer.calls[0].lane is Lane.HOT and pipeline.control.breaker_states()["hot"] == "closed"


async def test_a_lane_losing_every_replica_answers_503_after_the_retries():
    lanes = {"hot": LosingLane("hot", losses=100), "cold": FakeLane("cold")}
    pipeline, _, _ = make_pipeline(lanes, admission={"breaker": {"failure_threshold": 10}})
    with pytest.raises(api.OpenAIError) as refused:
        await pipeline.answer(COMPLETION, completion())
    assert refused.value.status == 503 and refused.value.body()["error"]["code"] == "lane_unavailable"
    assert len(lanes["hot"].requests) == LANE_LOSS_RETRIES + 1


async def test_batch_work_lost_with_its_replica_is_started_again_until_its_lane_serves_it(monkeypatch):
    monkeypatch.setattr(lane_call, "BATCH_LANE_LOSS_WAIT_S", 0.01)
    lanes = {"hot": FakeLane("hot"), "cold": LosingLane("cold", losses=LANE_LOSS_RETRIES + 3)}
    pipeline, _, _ = make_pipeline(lanes, admission={"breaker": {"failure_threshold": 100}})
    answer = await pipeline.answer(COMPLETION, completion(service_tier="flex"))
    assert answer.response["choices"][0]["text"] == "abcdef" and answer.calls[0].lane is Lane.COLD
    assert len(lanes["cold"].requests) == LANE_LOSS_RETRIES + 4 and not lanes["hot"].requests


async def test_a_call_lost_with_its_replica_pauses_before_it_is_started_again(monkeypatch):
    pauses = []
    real_sleep = lane_call.asyncio.sleep

    async def sleep(seconds):
        pauses.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(lane_call.asyncio, "sleep", sleep)
    lanes = {"hot": LosingLane("hot", losses=1), "cold": FakeLane("cold")}
    pipeline, _, _ = make_pipeline(lanes)
    await pipeline.answer(COMPLETION, completion())
    assert [p for p in pauses if p] == [lane_call.LANE_LOSS_BACKOFF_S]  # asyncio.sleep(0) is the fakes' own


async def test_losses_that_open_the_breaker_move_interactive_work_to_the_other_lane():
    lanes = {"hot": LosingLane("hot", losses=100), "cold": FakeLane("cold")}
    pipeline, _, _ = make_pipeline(lanes, admission={"breaker": {"failure_threshold": 2}})
    answer = await pipeline.answer(COMPLETION, completion())
    call = answer.calls[0]
    assert call.lane is Lane.COLD and "hot_breaker_open" in call.context.reasons
    assert answer.response["choices"][0]["text"] == "abcdef"
    assert len(lanes["hot"].requests) == 2


async def test_a_started_stream_a_continuation_cannot_carry_ends_with_an_openai_error_event_when_its_replica_is_lost():
    # With a seed, a new engine request would not sample as the lost one would have (a stream that a continuation
    # carries resumes instead: tests/unit/test_handoff.py).
    lanes = {"hot": LosingLane("hot", losses=1, chunks_before=1), "cold": FakeLane("cold")}
    pipeline, _, _ = make_pipeline(lanes)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
            "seed": 7}
    answer = await pipeline.answer(CHAT, body)
    events = [event async for event in answer.events]
    assert len(lanes["hot"].requests) == 1 and not lanes["cold"].requests  # started: never run twice
    assert '"error"' in events[-1] and "lane_unavailable" in events[-1] and "[DONE]" not in events[-1]
    assert any('"ab"' in event for event in events[:-1])  # what the client had before the loss


async def test_serve_lane_stream_turns_ray_actor_errors_into_lane_replica_lost():
    from ray.exceptions import ActorDiedError, RayTaskError

    from app.router.deployment import ServeLaneStream

    class Generator:
        def __init__(self, error):
            self.error, self.cancelled = error, False

        async def __anext__(self):
            raise self.error

        def cancel(self):
            self.cancelled = True

    with pytest.raises(LaneReplicaLost):
        await ServeLaneStream(Generator(ActorDiedError())).__anext__()
    wrapped = RayTaskError("generate", "traceback", ActorDiedError())
    with pytest.raises(LaneReplicaLost):
        await ServeLaneStream(Generator(wrapped)).__anext__()
    # A replica whose engine died under it says so (app/lanes/engine.py), as Ray's wrapper of its LaneReplicaLost.
    engine_dead = RayTaskError("generate", "traceback", LaneReplicaLost("the hot lane's engine died"))
    with pytest.raises(LaneReplicaLost):
        await ServeLaneStream(Generator(engine_dead)).__anext__()
    with pytest.raises(LaneReplicaLost):
        await ServeLaneStream(Generator(engine_dead.as_instanceof_cause())).__anext__()
    with pytest.raises(ValueError):  # anything else passes through unchanged
        await ServeLaneStream(Generator(ValueError("bad"))).__anext__()
    with pytest.raises(StopAsyncIteration):
        await ServeLaneStream(Generator(StopAsyncIteration())).__anext__()
    generator = Generator(ValueError())
    ServeLaneStream(generator).cancel()
    assert generator.cancelled


async def test_an_engine_that_died_under_its_replica_is_a_lost_replica_mid_stream_too():
    """kill -9 of a lane takes the replica and its engine processes; when the engine goes first, the replica raises
    vLLM's EngineDeadError to the calls under way: the engine adapter reports it as LaneReplicaLost, so the Router
    resumes the streams elsewhere instead of ending them with an error."""
    from types import SimpleNamespace

    from vllm.v1.engine.exceptions import EngineDeadError

    from app.classes import RequestClass
    from app.config import load_app_config
    from app.lanes.engine import VllmEngine
    from app.lanes.types import LaneRequest, SamplingOptions
    from tests.fakes import cpu_args

    class DyingAsyncLLM:
        async def generate(self, prompt, params, request_id, priority=0):
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1], text="a", finish_reason=None)],
                                  num_cached_tokens=0, finished=False)
            raise EngineDeadError()

    cfg = load_app_config(cpu_args())
    engine = VllmEngine(cfg, cfg.hot_lane.engine, "hot", "r1")
    engine._engine = DyingAsyncLLM()
    request = LaneRequest("r", [1, 2], SamplingOptions(max_tokens=4), RequestClass.INTERACTIVE, 10)
    chunks = []
    with pytest.raises(LaneReplicaLost, match="engine died"):
        async for chunk in engine.generate(request):
            chunks.append(chunk)
    assert [c.text for c in chunks] == ["a"]
