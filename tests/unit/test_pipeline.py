"""The request pipeline through its constructor, with fake lanes whose requests run until the test ends them: the
hot lane gets interactive work up to this Router's slots, a request past them waits for the next free slot when
that is within the TTFT SLO (also after a long idle spell), spills while the cold lane has room, and is refused
with 429 and a Retry-After from the expected drain after that."""

from __future__ import annotations

import asyncio

import pytest

from app.classes import Lane, RequestClass
from app.lanes.types import LaneChunk, LaneRequest
from app.router import openai_api as api
from app.router.endpoints import CHAT, COMPLETION
from tests.fakes import FakeClock, FakeLane, generation, make_pipeline

# 8 sequences per hot engine, 4 of them for realtime: 4 hot slots for interactive work at this (only) Router.
# No headroom: these tests put predictions on the target itself (test_headroom_moves_the_target... has one).
ADMISSION = {"realtime_max_inflight": 4, "interactive_ttft_slo_s": 1.0, "interactive_ttft_headroom": 0.0,
             "cold_spill_slots_per_replica": 2}
HOT_ENGINE = {"engine": {"kv_cache_memory_bytes": 1 << 28, "dtype": "float32", "max_num_seqs": 8}, "deployment": {}}


class HeldStream:
    """A lane request that sends its first token at once, then runs until the test finishes it."""

    def __init__(self, lane: "HeldLane", request: LaneRequest):
        self.lane, self.request = lane, request
        self.done = asyncio.Event()
        self.sent = 0
        self.cancelled = False
        lane.running.append(self)
        lane.peak = max(lane.peak, len(lane.running))

    async def __anext__(self):
        if self.sent == 0:
            self.sent = 1
            return LaneChunk(text="a", completion_tokens=1, prompt_tokens=len(self.request.prompt_token_ids),
                             lane=self.lane.name)
        if self.sent == 2:
            raise StopAsyncIteration
        await self.done.wait()
        self.sent = 2
        self._leave()
        return LaneChunk(text="b", completion_tokens=2, prompt_tokens=len(self.request.prompt_token_ids),
                         finish_reason="length", lane=self.lane.name)

    def cancel(self):
        self.cancelled = True
        self._leave()

    def _leave(self):
        if self in self.lane.running:
            self.lane.running.remove(self)


class HeldLane(FakeLane):
    def __init__(self, name: str):
        super().__init__(name)
        self.running: list[HeldStream] = []
        self.peak = 0

    def remote(self, request: LaneRequest) -> HeldStream:
        self.requests.append(request)
        return HeldStream(self, request)

    def finish_one(self):
        self.running[0].done.set()


async def collect(call) -> str:
    """The whole answer's text, read as a surface reads it."""
    return "".join([chunk.text async for chunk in call.chunks()])


class Harness:
    def __init__(self, **admission):
        self.clock = FakeClock()
        self.lanes = {"hot": HeldLane("hot"), "cold": HeldLane("cold")}
        self.pipeline, _, self.metrics = make_pipeline(self.lanes, clock=self.clock,
                                                       admission={**ADMISSION, **admission}, hot_lane=HOT_ENGINE)
        self.slots = self.pipeline.control.hot_slots
        self.answers: list[asyncio.Task] = []

    async def start(self, service_tier: str | None = None, **fields):
        """Start a request; its answer is collected in the background. Returns the call (or raises OpenAIError)."""
        call = await self.pipeline.start(COMPLETION, generation(**fields), service_tier=service_tier)
        self.answers.append(asyncio.create_task(collect(call)))
        return call

    async def settle(self):
        for _ in range(5):
            await asyncio.sleep(0)

    async def finish_all(self):
        for lane in self.lanes.values():
            for stream in list(lane.running):
                stream.done.set()
        await asyncio.gather(*self.answers)

    async def warm_up(self, hold_s: float, requests: int = 4):
        """Serve `requests` interactive requests one at a time, each holding its slot `hold_s`."""
        for _ in range(requests):
            await self.start()
            self.clock.advance(hold_s)
            self.lanes["hot"].finish_one()
            await asyncio.gather(*self.answers)
            self.answers.clear()


async def test_the_hot_lane_takes_interactive_work_up_to_its_slots_and_never_more():
    h = Harness()
    assert h.slots.limit == 4
    calls = [await h.start() for _ in range(4)]
    assert [c.lane for c in calls] == [Lane.HOT] * 4 and h.lanes["hot"].peak == 4
    waiter = asyncio.create_task(h.start())
    await h.settle()
    assert h.slots.waiting == 1 and not waiter.done() and len(h.lanes["hot"].running) == 4
    h.lanes["hot"].finish_one()  # a slot frees: the waiter takes it at once, the hot lane never idles
    call = await asyncio.wait_for(waiter, timeout=5)
    assert call.lane is Lane.HOT and h.lanes["hot"].peak == 4 and h.slots.waiting == 0
    await h.finish_all()
    assert h.slots.in_flight == 0


async def test_a_burst_after_a_long_idle_spell_waits_for_the_hot_lane_instead_of_spilling():
    h = Harness()
    await h.warm_up(hold_s=0.5)
    h.clock.advance(600)  # ten quiet minutes: nothing about the hot lane's pace has changed
    calls = [await h.start() for _ in range(4)]
    assert all(c.lane is Lane.HOT for c in calls)
    # Slots free at 4 per 0.5 s: the next request is predicted 0.125 s, within the 1 s SLO, and waits for hot.
    assert h.slots.predicted_wait_s() == pytest.approx(0.125)
    waiter = asyncio.create_task(h.start())
    await h.settle()
    assert h.slots.waiting == 1 and not h.lanes["cold"].requests
    h.lanes["hot"].finish_one()
    assert (await asyncio.wait_for(waiter, timeout=5)).lane is Lane.HOT
    await h.finish_all()


async def test_headroom_moves_the_target_admission_aims_at_below_the_configured_one():
    h = Harness(interactive_ttft_headroom=0.25)  # aims at 0.75 s of the 1 s target
    await h.warm_up(hold_s=4.0)  # slots free at 4 per 4 s: one a second
    for _ in range(4):
        await h.start()
    spilled = await h.start()  # predicted 1 s: within the target, past what admission aims at
    assert spilled.lane is Lane.COLD and h.slots.waiting == 0
    await h.finish_all()


async def test_past_the_slo_interactive_spills_while_the_cold_lane_has_room_then_gets_429():
    h = Harness()
    await h.warm_up(hold_s=4.0)  # slots free at 4 per 4 s: one a second
    for _ in range(4):
        await h.start()
    first_waiter = asyncio.create_task(h.start())  # predicted 1 s: within the SLO, waits
    await h.settle()
    assert h.slots.waiting == 1
    spilled = [await h.start() for _ in range(2)]  # predicted 2 s: over the SLO, the cold lane has 2 places
    assert [c.lane for c in spilled] == [Lane.COLD, Lane.COLD]
    assert all(c.headers()["x-llm-lanes-degraded"] == "hot_saturated" for c in spilled)
    assert all(r.priority < 20 for r in h.lanes["cold"].requests)  # ahead of batch work there
    with pytest.raises(api.OpenAIError) as refused:
        await h.start()
    assert refused.value.status == 429 and refused.value.code == "hot_lane_full"
    assert refused.value.headers["Retry-After"] == "1"  # a place opens within the SLO in ~1 s
    # The next ones refused are told to come back one admission interval (a slot frees every second) after another,
    # not all at the same time.
    later = []
    for _ in range(3):
        with pytest.raises(api.OpenAIError) as again:
            await h.start()
        later.append(again.value.headers["Retry-After"])
    assert later == ["2", "3", "4"]
    assert again.value.message.endswith("; retry in 4 s")
    rejected = [tags for _, tags in h.metrics.of("llm_lanes_requests_total") if tags["outcome"] == "rejected"]
    assert rejected == [{"lane": "none", "request_class": "interactive", "outcome": "rejected", "status": "429"}] * 4
    # Realtime and batch never wait for the Router's interactive slots.
    assert (await h.start(service_tier="priority")).lane is Lane.HOT
    assert (await h.start(service_tier="flex")).lane is Lane.COLD
    h.lanes["hot"].finish_one()
    await asyncio.wait_for(first_waiter, timeout=5)
    await h.finish_all()
    assert h.slots.in_flight == 0 and h.pipeline.control.cold_spill.in_flight == 0


async def test_a_refusal_under_load_is_decided_before_vllm_renders_the_prompt(monkeypatch):
    h = Harness()
    await h.warm_up(hold_s=4.0)
    for _ in range(4):
        await h.start()
    waiter = asyncio.create_task(h.start())
    await h.settle()
    [await h.start() for _ in range(2)]  # the cold lane's spill room taken: the next interactive request is refused

    def render(*args):
        raise AssertionError("a request refused for the load was rendered")

    monkeypatch.setattr(h.pipeline.surface, "answer", render)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "stream": True}
    with pytest.raises(api.OpenAIError) as refused:
        await h.pipeline.answer(CHAT, body)
    assert refused.value.status == 429 and refused.value.code == "hot_lane_full"
    assert refused.value.headers["Retry-After"].isdigit()
    rejected = [tags for _, tags in h.metrics.of("llm_lanes_requests_total") if tags["outcome"] == "rejected"]
    assert rejected == [{"lane": "none", "request_class": "interactive", "outcome": "rejected", "status": "429"}]
    # Invalid whatever the load: still the 400 (the body's fault), not the 429.
    with pytest.raises(api.OpenAIError) as invalid:
        await h.pipeline.answer(CHAT, {**body, "temperature": -1})
    assert invalid.value.status == 400
    # Realtime and batch are not the interactive line's to refuse; a prompt that may be long is rendered first.
    control = h.pipeline.control
    assert control.refusal_before_render(RequestClass.INTERACTIVE, 10, 2).code == "hot_lane_full"
    assert control.refusal_before_render(RequestClass.REALTIME, 10, 2) is None
    assert control.refusal_before_render(RequestClass.BATCH, 10, 2) is None
    assert control.refusal_before_render(RequestClass.INTERACTIVE, None, 2) is None
    assert control.refusal_before_render(RequestClass.INTERACTIVE, h.pipeline.cfg.model.max_model_len, 2) is None
    h.lanes["hot"].finish_one()
    await asyncio.wait_for(waiter, timeout=5)
    await h.finish_all()


async def test_a_full_queue_refuses_before_rendering_and_a_prompt_it_cannot_bound_is_rendered_first(monkeypatch):
    pipeline, lanes, metrics = make_pipeline(admission={"interactive_queue_bound": 0})
    rendered = []
    real_answer = pipeline.surface.answer

    async def answer(*args):
        rendered.append(args)
        return await real_answer(*args)

    monkeypatch.setattr(pipeline.surface, "answer", answer)
    with pytest.raises(api.OpenAIError) as full:
        await pipeline.answer(COMPLETION, {"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert full.value.code == "queue_full" and not rendered
    # A model not served here is its 404 under any load (vLLM's code says so once it takes the request).
    with pytest.raises(api.OpenAIError) as unknown:
        await pipeline.answer(COMPLETION, {"model": "gpt-4", "prompt": "hello", "max_tokens": 2})
    assert unknown.value.status == 404 and len(rendered) == 1
    rendered.clear()
    assert [tags for _, tags in metrics.of("llm_lanes_admission_decisions_total")] == [
        {"decision": "reject", "reason": "queue_full", "request_class": "interactive"}]
    # An image's tokens are not its URL's bytes: rendered, then refused by admission as before.
    image = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}
    with pytest.raises(api.OpenAIError):
        await pipeline.answer(CHAT, image)
    assert len(rendered) == 1 and not lanes["hot"].requests


@pytest.mark.parametrize("body, chat, bound", [
    ({"prompt": "héllo"}, False, 6 + api.COMPLETION_EXTRA_TOKENS_BOUND),
    ({"prompt": [1, 2, 3]}, False, 3 + api.COMPLETION_EXTRA_TOKENS_BOUND),
    ({"prompt": ["ab", "abcd"], "suffix": "x"}, False, 5 + api.COMPLETION_EXTRA_TOKENS_BOUND),
    ({"prompt": [[1], [1, 2]]}, False, 2 + api.COMPLETION_EXTRA_TOKENS_BOUND),
    ({"prompt": ""}, False, None), ({"prompt": ["a", ""]}, False, None), ({"prompt_embeds": "x"}, False, None),
    ({"messages": []}, True, None),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ x }}"}, True, None),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, True, None),
])
def test_the_prompt_tokens_bound_is_the_texts_bytes_or_unknown(body, chat, bound):
    assert api.prompt_tokens_bound(body, chat=chat) == bound


def test_a_chat_prompts_bound_covers_its_messages_and_tools():
    messages = [{"role": "user", "content": "héllo " * 50}]
    bound = api.prompt_tokens_bound({"messages": messages}, chat=True)
    assert bound >= len(("héllo " * 50).encode()) + api.CHAT_TEMPLATE_TOKENS_BOUND
    tools = [{"type": "function", "function": {"name": "f" * 100, "parameters": {}}}]
    assert api.prompt_tokens_bound({"messages": messages, "tools": tools}, chat=True) > bound + 100


async def test_a_waiting_request_whose_client_leaves_gives_up_its_place():
    h = Harness()
    for _ in range(4):
        await h.start()
    waiter = asyncio.create_task(h.start())
    await h.settle()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert h.slots.waiting == 0 and h.slots.in_flight == 4
    assert h.pipeline.control.queue_depths()["interactive"] == 0
    await h.finish_all()


async def test_without_admission_the_pipeline_is_a_plain_pool():
    lanes = {"hot": HeldLane("hot"), "cold": HeldLane("cold")}
    pipeline, _, _ = make_pipeline(lanes, admission={"enabled": False})
    assert pipeline.control.hot_slots is None
    calls = [await pipeline.start(COMPLETION, generation()) for _ in range(20)]
    assert all(c.lane is Lane.HOT for c in calls) and lanes["hot"].peak == 20
    for call in calls:
        call.stream.cancel()


async def test_a_request_whose_hot_slot_does_not_come_within_the_slo_is_decided_again():
    h = Harness(interactive_ttft_slo_s=0.2)  # a short target, so the wait runs out in real time
    for _ in range(4):
        await h.start()
    # No hold time is known yet: the prediction is 0 s and the request waits for the hot lane, as long as the
    # target leaves; then it is decided again, and with its target spent no lane can start it in time: 429.
    with pytest.raises(api.OpenAIError) as refused:
        await asyncio.wait_for(h.start(), timeout=5)
    assert refused.value.status == 429 and refused.value.code == "hot_lane_full"
    assert h.slots.waiting == 0 and h.slots.in_flight == 4 and not h.lanes["cold"].requests
    await h.finish_all()


async def test_the_slot_is_free_when_the_lane_has_sent_its_last_chunk_not_when_the_client_has_read_it():
    h = Harness()
    call = await h.pipeline.start(COMPLETION, generation(stream=True))
    chunks = call.chunks()
    assert (await anext(chunks)).text == "a" and h.slots.in_flight == 1
    h.lanes["hot"].finish_one()
    last = await anext(chunks)  # the lane's last chunk, handed to a client that has not read past it
    assert last.finish_reason == "length" and h.slots.in_flight == 0
    await chunks.aclose()


async def test_the_slot_is_free_when_the_engine_is_done_while_the_client_still_reads_earlier_chunks():
    h = Harness()
    call = await h.pipeline.start(COMPLETION, generation(stream=True))
    chunks = call.chunks()
    assert (await anext(chunks)).text == "a"
    for _ in range(3):
        await h.start()
    assert h.slots.in_flight == h.slots.limit == 4
    waiter = asyncio.create_task(h.start())  # every slot is taken: this request waits for one
    await h.settle()
    assert h.slots.waiting == 1
    h.lanes["hot"].finish_one()  # the first answer's engine is done; its client has not asked for more yet
    await asyncio.wait_for(waiter, timeout=5)
    assert h.slots.waiting == 0 and h.slots.in_flight == 4  # the waiter holds the slot the first answer left
    # The first client still gets its whole answer, in order, from the chunks read ahead of it.
    rest = [chunk async for chunk in chunks]
    assert rest[-1].finish_reason == "length" and "".join(c.text for c in rest)
    await h.finish_all()
    assert h.slots.in_flight == 0


async def test_a_client_that_leaves_mid_answer_stops_the_read_ahead_and_the_lane_call():
    h = Harness()
    call = await h.pipeline.start(COMPLETION, generation(stream=True))
    chunks = call.chunks()
    await anext(chunks)
    stream = h.lanes["hot"].running[0]
    await chunks.aclose()  # the client is gone before the engine is done
    await h.settle()
    assert stream.cancelled and h.slots.in_flight == 0 and call._ahead is None


async def test_the_router_keeps_its_recent_ttft_per_class_and_lane():
    h = Harness()
    for _ in range(3):
        call = await h.pipeline.start(COMPLETION, generation(stream=True))
        h.answers.append(asyncio.create_task(collect(call)))
    await h.start(stream=False)  # a whole answer at once has no TTFT of its own
    summary = h.pipeline.recent_ttft.summary()
    assert list(summary) == ["interactive"] and summary["interactive"]["hot"]["count"] == 3
    assert 0 <= summary["interactive"]["hot"]["p50_ms"] <= summary["interactive"]["hot"]["p99_ms"]
    await h.finish_all()
