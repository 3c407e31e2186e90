"""Decode handoff (admission.interactive_decode_handoff_tokens): the rule in app/router/handoff.py, then the Router's
real request path with fake lanes that generate one token per chunk -- the hot lane serves the first tokens, the cold
lane the rest, and the client sees one answer."""

from __future__ import annotations

import json

import pytest

from app.config import ConfigError, load_app_config
from app.lanes.types import LaneChunk, LaneReplicaLost, LaneRequest
from app.router.breaker import BreakerState
from app.classes import Lane, RequestClass, policy_for
from app.router.endpoints import COMPLETION
from app.router.handoff import REASON_DECODE_ON_COLD, handoff_after_tokens
from app.router.lane_caps import LaneCaps
from app.router.spill import COLD_LANE_INTERACTIVE_PRIORITY
from tests.fakes import FakeLane, FakeStream, cpu_args, engine_output, make_router

TWO_LANES = {Lane.HOT: LaneCaps(2048), Lane.COLD: LaneCaps(2048)}


def plan(**overrides) -> int | None:
    inputs = dict(request_class=RequestClass.INTERACTIVE, lane=Lane.HOT, prompt_tokens=100, max_tokens=32, has_stop_strings=False,
                  handoff_tokens=1, lane_caps=TWO_LANES)
    return handoff_after_tokens(**{**inputs, **overrides})


# ---- the rule ------------------------------------------------------------------------------------------------------

def test_an_interactive_request_on_the_hot_lane_is_handed_off_after_the_set_tokens():
    assert plan() == 1
    assert plan(handoff_tokens=4) == 4


@pytest.mark.parametrize("overrides", [
    {"handoff_tokens": 0},                                   # off (the default)
    {"request_class": RequestClass.REALTIME},                # realtime keeps the hot lane's step time
    {"request_class": RequestClass.BATCH, "lane": Lane.COLD},
    {"lane": Lane.COLD},                                     # spilled to the cold lane already
    {"max_tokens": 1},                                       # nothing left after the hot part
    {"max_tokens": 4, "handoff_tokens": 4},
    {"has_stop_strings": True},                              # a stop string could straddle the boundary
    {"lane_caps": {Lane.HOT: LaneCaps(2048)}},               # no cold lane
    {"lane_caps": {Lane.HOT: LaneCaps(4096), Lane.COLD: LaneCaps(120)}},  # the cold lane can't hold it
    {"lane_caps": {Lane.HOT: LaneCaps(2048), Lane.COLD: LaneCaps(2048, max_tokens_cap=16)}},  # would be clipped
])
def test_the_hot_lane_keeps_the_request_when_a_handoff_does_not_apply(overrides):
    assert plan(**overrides) is None


def test_a_one_lane_app_refuses_the_setting_and_names_the_fix():
    with pytest.raises(ConfigError) as caught:
        load_app_config(cpu_args(cold_lane=None, admission={"interactive_decode_handoff_tokens": 1}))
    assert "interactive_decode_handoff_tokens" in str(caught.value) and "set it to 0" in str(caught.value)


# ---- the Router's request path ------------------------------------------------------------------------------------

class TokenLane(FakeLane):
    """Generates max_tokens tokens, one per chunk (streamed) or all in one chunk; token i of a request is
    `first_token + i` and its text `t<id>.`. `eos_after`: finishes with "stop" after that many tokens."""

    def __init__(self, name: str, first_token: int, eos_after: int | None = None):
        super().__init__(name)
        self.first_token = first_token
        self.eos_after = eos_after

    def remote(self, request: LaneRequest) -> FakeStream:
        self.requests.append(request)
        count = request.sampling.max_tokens if self.eos_after is None else min(self.eos_after,
                                                                              request.sampling.max_tokens)
        finish = "stop" if self.eos_after is not None and count == self.eos_after else "length"
        ids = [self.first_token + i for i in range(count)]
        pieces = [[i] for i in ids] if request.stream else [ids]
        chunks, done = [], 0
        for n, piece in enumerate(pieces):
            done += len(piece)
            last = n == len(pieces) - 1
            text = "".join(f"t{i}." for i in piece)
            output = engine_output(request, text, piece, last, finish)
            output.num_cached_tokens = 3
            chunks.append(LaneChunk(
                text=text, completion_tokens=done,
                prompt_tokens=len(request.prompt_token_ids), cached_prompt_tokens=3,
                finish_reason=finish if last else None, lane=self.name,
                token_ids=tuple(piece) if request.return_token_ids else (), output=output))
        return FakeStream(chunks)


def make_router_with(lanes: dict[str, FakeLane], tmp_path=None):
    import tempfile
    from pathlib import Path

    return make_router(Path(tmp_path or tempfile.mkdtemp()), lanes=lanes)


def handoff_router(tmp_path, tokens: int = 1, hot_eos_after: int | None = None):
    lanes = {"hot": TokenLane("hot", 100, eos_after=hot_eos_after), "cold": TokenLane("cold", 500)}
    return make_router(tmp_path, lanes=lanes, admission={"interactive_decode_handoff_tokens": tokens})


async def start(router, stream: bool, max_tokens: int = 5, **fields):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": max_tokens, "stream": stream, **fields}
    if stream:
        body["stream_options"] = {"include_usage": True}
    answer = await router.pipeline.answer(COMPLETION, body)
    return answer.calls[0].context.lane_request, answer


async def streamed_events(router, answer) -> list[dict]:
    events = [e async for e in answer.events]
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


async def test_a_streamed_answer_continues_on_the_cold_lane_after_its_first_token(tmp_path):
    router = handoff_router(tmp_path)
    lane_request, generation = await start(router, stream=True)
    assert generation.headers()["x-llm-lanes-lane"] == "hot"
    assert generation.headers()["x-llm-lanes-degraded"] == REASON_DECODE_ON_COLD
    events = await streamed_events(router, generation)

    hot, = router.lanes["hot"].requests
    cold, = router.lanes["cold"].requests
    assert hot.sampling.max_tokens == 1 and hot.return_token_ids
    assert hot.priority == policy_for(RequestClass.INTERACTIVE).priority
    # The cold lane goes on from the prompt plus the token the client already has, for the tokens still owed.
    assert cold.prompt_token_ids == [*lane_request.prompt_token_ids, 100]
    assert cold.sampling.max_tokens == 4 and cold.priority == COLD_LANE_INTERACTIVE_PRIORITY
    # Its token ids still come back: were the cold replica lost mid-answer, the stream would resume from them.
    assert cold.request_id == f"{lane_request.request_id}-decode" and cold.return_token_ids

    choices = [e["choices"][0] for e in events if e.get("choices")]
    assert "".join(c["text"] for c in choices) == "t100.t500.t501.t502.t503."
    assert [c["finish_reason"] for c in choices] == [None] * 4 + ["length"]  # one end, the cold lane's
    usage = events[-1]["usage"]
    assert usage["prompt_tokens"] == len(lane_request.prompt_token_ids) and usage["completion_tokens"] == 5
    assert usage["prompt_tokens_details"]["cached_tokens"] == 3
    # Both parts ended well: no breaker counts a failure, the request's end-to-end time is sampled once.
    assert router.control.breaker_states() == {"hot": "closed", "cold": "closed"}


async def test_an_answer_collected_whole_joins_both_parts(tmp_path):
    router = handoff_router(tmp_path, tokens=2)
    _, generation = await start(router, stream=False, max_tokens=6)
    response = generation.response
    assert response["choices"][0]["text"] == "t100.t101.t500.t501.t502.t503."
    assert response["choices"][0]["finish_reason"] == "length"
    assert response["usage"]["completion_tokens"] == 6
    assert router.lanes["cold"].requests[0].sampling.max_tokens == 4
    # The headers, made once the answer is whole, name the lane that started it; the handoff is a degrade reason.
    assert generation.headers()["x-llm-lanes-lane"] == "hot"
    assert generation.headers()["x-llm-lanes-degraded"] == REASON_DECODE_ON_COLD


async def test_an_answer_that_ends_on_the_hot_lane_is_not_continued(tmp_path):
    router = handoff_router(tmp_path, tokens=2, hot_eos_after=1)  # EOS at the first token
    _, generation = await start(router, stream=True)
    events = await streamed_events(router, generation)
    assert not router.lanes["cold"].requests
    choices = [e["choices"][0] for e in events if e.get("choices")]
    assert [c["finish_reason"] for c in choices] == ["stop"] and events[-1]["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("fields", [{"max_tokens": 1}, {"stop": ["\n"]}, {"service_tier": "priority"}])
async def test_requests_outside_the_rule_run_whole_on_their_lane(tmp_path, fields):
    router = handoff_router(tmp_path)
    _, generation = await start(router, stream=True, **fields)
    await streamed_events(router, generation)
    assert not router.lanes["cold"].requests
    request, = router.lanes["hot"].requests
    assert request.sampling.max_tokens == fields.get("max_tokens", 5)
    # A stream a continuation carries exactly asks for its token ids (to resume it after a replica loss).
    assert request.return_token_ids is ("stop" not in fields)
    assert REASON_DECODE_ON_COLD not in generation.headers().get("x-llm-lanes-degraded", "")


async def test_the_hot_lane_finishes_the_answer_while_the_cold_lanes_breaker_is_open(tmp_path):
    router = handoff_router(tmp_path)
    _, generation = await start(router, stream=True)
    breaker = router.control.breakers[Lane.COLD]
    for _ in range(router.cfg.admission.breaker.failure_threshold):  # opens between the first token and the rest
        breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    events = await streamed_events(router, generation)
    assert not router.lanes["cold"].requests
    first, rest = router.lanes["hot"].requests
    assert rest.sampling.max_tokens == 4 and rest.prompt_token_ids[-1] == 100
    assert rest.priority == policy_for(RequestClass.INTERACTIVE).priority
    assert events[-1]["usage"]["completion_tokens"] == 5



async def test_a_cold_lane_failure_after_the_first_token_ends_the_stream_with_an_error_and_counts_against_it(
        tmp_path):
    from tests.unit.test_router_breaker_wiring import DeadLane

    router = handoff_router(tmp_path)
    router.lanes["cold"] = DeadLane("cold")
    _, generation = await start(router, stream=True)
    raw = [e async for e in generation.events]
    events = [json.loads(e.removeprefix("data: ")) for e in raw]  # no [DONE]: the stream ended on the error
    texts = [e["choices"][0]["text"] for e in events if e.get("choices")]
    assert texts == ["t100."]  # the first token, from the hot lane, reached the client
    error = events[-1]["error"]  # then an OpenAI-shaped error event, not a silent end
    assert error["code"] == "lane_unavailable" and "cold lane" in error["message"]
    assert len(router.control.breakers[Lane.COLD]._failure_times) == 1  # the cold lane's failure, not the hot one's
    assert not router.control.breakers[Lane.HOT]._failure_times


@pytest.mark.parametrize("fields, blocker", [({"n": 2}, "n"), ({"logprobs": 1}, "logprobs"), ({"seed": 7}, "seed"),
                                             ({"response_format": {"type": "json_object"}}, "structured_output")])
async def test_a_request_the_continuation_cannot_answer_skips_the_handoff_and_says_so(tmp_path, fields, blocker):
    router = handoff_router(tmp_path)
    lane_request, answer = await start(router, stream=False, **fields)
    assert answer.calls[0].context.handoff_blocker == blocker
    assert not router.lanes["cold"].requests
    request, = router.lanes["hot"].requests
    assert request.sampling.max_tokens == 5 and not request.return_token_ids
    assert answer.headers()["x-llm-lanes-degraded"] == "handoff_skipped"


# ---- a stream resumed after its replica is lost ---------------------------------------------------------------------

class LosingLane(TokenLane):
    """A TokenLane whose first `losses` streams lose their replica after `after` chunks (LaneReplicaLost)."""

    def __init__(self, name: str, first_token: int, after: int, losses: int = 1):
        super().__init__(name, first_token)
        self.after, self.losses = after, losses

    def remote(self, request: LaneRequest) -> FakeStream:
        stream = super().remote(request)
        if self.losses > 0:
            self.losses -= 1
            chunks = list(stream._chunks)[:self.after]

            async def lost():
                for chunk in chunks:
                    yield chunk
                raise LaneReplicaLost("the lane replica is gone: ActorDiedError")

            return LostStream(lost())
        return stream


class LostStream:
    def __init__(self, generator):
        self._generator = generator
        self.cancelled = False

    def __aiter__(self):
        return self

    def __anext__(self):
        return self._generator.__anext__()

    def cancel(self):
        self.cancelled = True


async def test_a_stream_whose_hot_replica_is_lost_mid_answer_resumes_on_the_cold_lane_without_an_error():
    router = make_router_with({"hot": LosingLane("hot", 100, after=2), "cold": TokenLane("cold", 500)})
    lane_request, generation = await start(router, stream=True)
    events = await streamed_events(router, generation)
    assert not any("error" in event for event in events), events
    texts = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    # Two tokens from the lost replica, the rest from the cold lane, which went on from the prompt and those two.
    assert texts == "t100.t101.t500.t501.t502."
    assert events[-1]["usage"]["completion_tokens"] == 5
    cold, = router.lanes["cold"].requests
    assert cold.prompt_token_ids == [*lane_request.prompt_token_ids, 100, 101]
    assert cold.sampling.max_tokens == 3 and cold.priority == COLD_LANE_INTERACTIVE_PRIORITY
    # The loss counts against the hot lane's breaker; the answer itself succeeded.
    assert len(router.control.breakers[Lane.HOT]._failure_times) == 1


async def test_a_stream_the_continuation_cannot_carry_still_ends_with_the_error_event():
    router = make_router_with({"hot": LosingLane("hot", 100, after=2), "cold": TokenLane("cold", 500)})
    _, generation = await start(router, stream=True, seed=7)  # a seed's sampling state does not carry over
    events = [e async for e in generation.events]
    assert '"lane_unavailable"' in events[-1] and not router.lanes["cold"].requests


async def test_a_stream_resumes_at_most_twice():
    router = make_router_with({"hot": LosingLane("hot", 100, after=1), "cold": LosingLane("cold", 500, after=1,
                                                                                        losses=5)})
    _, generation = await start(router, stream=True)
    events = [e async for e in generation.events]
    assert '"lane_unavailable"' in events[-1]
    assert len(router.lanes["cold"].requests) == 2
