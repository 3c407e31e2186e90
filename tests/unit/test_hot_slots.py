"""LaneSlots: a Router's share of a lane's engine slots and the predicted wait for one, from the present state."""

import asyncio

import pytest

from app.router.control import share
from app.router.hot_slots import LaneSlots
from app.router.slot_waiters import SlotWaitAbandoned
from tests.fakes import FakeClock, cpu_args


def test_no_wait_while_a_slot_is_free_and_none_predicted_before_any_hold_is_known():
    slots = LaneSlots(2, clock=FakeClock())
    assert slots.free() == 2 and slots.predicted_wait_s() == 0.0
    slots.take(), slots.take()
    assert slots.free() == 0
    assert slots.predicted_wait_s() == 0.0  # nothing ever held a slot long enough to tell: the burst waits


def test_the_wait_follows_recent_hold_times_and_ignores_idle_time():
    clock = FakeClock()
    slots = LaneSlots(4, clock=clock)
    for _ in range(4):
        token = slots.take()
        clock.advance(2.0)
        slots.release(token)
    clock.advance(3600)  # an hour idle changes nothing
    for _ in range(4):
        slots.take()
    assert slots.predicted_wait_s() == pytest.approx(0.5)  # slots free at 4 per 2 s
    assert slots.predicted_wait_s(ahead=3) == pytest.approx(2.0)


def test_requests_holding_slots_longer_than_before_raise_the_prediction():
    clock = FakeClock()
    slots = LaneSlots(2, clock=clock)
    token = slots.take()
    clock.advance(1.0)
    slots.release(token)
    slots.take(), slots.take()
    clock.advance(5.0)  # both holders are 5 s old: a hold is at least that long now
    assert slots.hold_time_s() == pytest.approx(5.0)
    assert slots.predicted_wait_s() == pytest.approx(2.5)


def test_failed_requests_do_not_teach_the_hold_time():
    clock = FakeClock()
    slots = LaneSlots(1, clock=clock)
    token = slots.take()
    clock.advance(0.01)
    slots.release(token, record_hold=False)
    assert slots.hold_time_s() is None and slots.in_flight == 0


async def test_waiters_are_served_first_come_first_served_as_slots_free():
    slots = LaneSlots(1, clock=FakeClock())
    held = slots.take()
    order = []

    async def wait(name):
        token = await slots.acquire()
        order.append(name)
        return token

    first, second = asyncio.create_task(wait("first")), asyncio.create_task(wait("second"))
    await asyncio.sleep(0)
    assert slots.waiting == 2 and slots.free() == 0
    slots.release(held)
    slots.release(await first)
    await second
    assert order == ["first", "second"]
    # The stats keep the longest line since the start, after it is gone (how an operator sees that requests waited).
    assert slots.stats()["waiting"] == 0 and slots.stats()["peak_waiting"] == 2


def test_the_share_of_slots_is_split_across_routers_rounded_up():
    assert share(28, 1, 1) == 28 and share(28, 2, 3) == 19 and share(28, 0, 1) == 0 and share(0, 4, 1) == 0


def test_the_hot_slots_leave_room_for_realtime_unless_it_has_replicas_of_its_own():
    from app.config import load_app_config
    from app.router.control import TrafficControl

    def limit(**admission):
        args = cpu_args(admission=admission)
        args["hot_lane"]["deployment"]["num_replicas"] = 2  # a reserved replica needs another one
        control = TrafficControl(load_app_config(args))
        control.set_replica_counts(hot=2, cold=1, routers=1)
        return control.hot_slots.limit, control.cold_spill.limit

    sequences = load_app_config(cpu_args()).hot_lane.engine.max_num_seqs
    assert limit(realtime_max_inflight=4) == (2 * (sequences - 4), 8)
    assert limit(realtime_reserved_hot_replicas=1) == (sequences, 8)


def start_one_at_a_time(slots: LaneSlots, clock: FakeClock, starts: int, latency_s: float) -> None:
    """A quiet lane: `starts` streams, each taking a slot, having its first token `latency_s` later and leaving."""
    for _ in range(starts):
        token = slots.take(awaits_first_token=True)
        clock.advance(latency_s)
        slots.first_token(token)
        slots.release(token)


def test_the_start_latency_is_the_recent_tail_or_longer_while_a_holder_still_waits_for_its_first_token():
    clock = FakeClock()
    slots = LaneSlots(2, clock=clock)
    start_one_at_a_time(slots, clock, starts=3, latency_s=0.1)
    assert slots.start_latency_s() == pytest.approx(0.1)
    # A burst: the holders' prefill takes far longer than the quiet spell's did, before any of them has finished.
    slow, collected = slots.take(awaits_first_token=True), slots.take()
    clock.advance(1.5)
    assert slots.start_latency_s() == pytest.approx(1.5)  # the collected answer's wait is no first token's
    slots.first_token(slow)
    assert slots.start_latency_s() > 1.4  # now one of the recent ones, at their tail
    slots.release(slow), slots.release(collected)


def test_a_newcomer_is_predicted_to_start_behind_the_holders_still_awaiting_their_first_token():
    clock = FakeClock()
    slots = LaneSlots(64, clock=clock)
    start_one_at_a_time(slots, clock, starts=4, latency_s=0.1)  # quiet
    assert slots.start_latency_s() == pytest.approx(0.1)
    # A burst takes 20 free slots at once: before any first token (and before the oldest has waited long), a
    # newcomer's start is predicted behind all 20 of them, not at the quiet spell's 0.1 s.
    burst = [slots.take(awaits_first_token=True) for _ in range(20)]
    clock.advance(0.05)
    assert slots.start_latency_s() == pytest.approx(21 * 0.1)
    # Their starts come one after the other; each recorded cost is its time over the starts it queued behind.
    for position, token in enumerate(burst):
        clock.advance(0.05 if position else 0.0)
        slots.first_token(token)
    # None awaiting now: the recent starts' tail (the slowest took 1.0 s), no queue term.
    assert 0.95 < slots.start_latency_s() <= 1.0
    for token in burst:
        slots.release(token)


def test_a_slot_released_before_its_first_token_stops_counting():
    clock = FakeClock()
    slots = LaneSlots(1, clock=clock)
    token = slots.take(awaits_first_token=True)
    clock.advance(5.0)
    slots.release(token, record_hold=False)
    assert slots.start_latency_s() == 0.0


async def test_a_waiter_that_gives_up_leaves_the_line_and_the_next_one_takes_the_slot():
    slots = LaneSlots(1)
    held = slots.take()
    late_for_target = {"first": False}
    first = asyncio.create_task(slots.acquire(give_up=lambda: late_for_target["first"]))
    second = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0.01)
    assert slots.waiting == 2
    late_for_target["first"] = True  # its TTFT target can no longer be met: it must not take the next slot
    slots.release(held)
    with pytest.raises(SlotWaitAbandoned):
        await asyncio.wait_for(first, 1)
    token = await asyncio.wait_for(second, 1)
    assert slots.in_flight == 1 and slots.waiting == 0
    slots.release(token)


def test_the_first_spilled_stream_teaches_the_cold_lanes_start_time_before_more_spill():
    from app.config import load_app_config
    from app.router.control import TrafficControl

    clock = FakeClock()
    control = TrafficControl(load_app_config(cpu_args()), clock=clock)
    control.set_replica_counts(hot=1, cold=1, routers=1)
    spill = control.cold_spill
    assert spill.free() > 2 and control._cold_spill_room(waited_s=0.0)
    first = spill.take(awaits_first_token=True)
    # Its first token has not come: the cold lane's start time under this load is unknown, so no second one yet.
    assert spill.first_start_pending() and not control._cold_spill_room(waited_s=0.0)
    clock.advance(0.2)
    spill.first_token(first)
    assert not spill.first_start_pending()
    second = spill.take(awaits_first_token=True)
    # Known now: more may spill while their expected start fits the target.
    assert control._cold_spill_room(waited_s=0.0)
    spill.release(first), spill.release(second)
