import asyncio
import math

import pytest

from tests.fakes import FakeClock

from app.lanes.admission import Decision, PriorityGate, kv_headroom_decision
from app.router.admission import BackPressure, RetrySchedule
from app.classes import RequestClass

RESERVE = 0.20  # the schema's admission.realtime_kv_reserve
RT, IA, BA = RequestClass.REALTIME, RequestClass.INTERACTIVE, RequestClass.BATCH


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# ---- PriorityGate ----------------------------------------------------------------------------------------------------


async def test_gate_caps_realtime_inflight_at_four_and_queues_the_rest():
    gate = PriorityGate.for_hot_replica(realtime_max_inflight=4)
    tasks = [asyncio.create_task(gate.acquire(RT)) for _ in range(6)]
    await settle()
    assert sum(t.done() for t in tasks) == 4
    assert gate.inflight(RT) == 4 and gate.waiting(RT) == 2
    # Interactive is not limited on a gate that only caps realtime: it passes the queued realtime requests.
    await asyncio.wait_for(gate.acquire(IA), 1)
    assert gate.inflight(IA) == 1
    gate.release(RT)
    await settle()
    assert sum(t.done() for t in tasks) == 5 and gate.inflight(RT) == 4
    for _ in range(4):
        gate.release(RT)
    await settle()
    assert all(t.done() for t in tasks) and gate.inflight(RT) == 1
    gate.release(RT)
    gate.release(IA)
    assert gate.inflight() == 0 and gate.waiting() == 0


async def test_gate_serves_by_priority_then_fifo():
    gate = PriorityGate(total_limit=1)
    order: list[str] = []

    async def worker(name: str, request_class: RequestClass) -> None:
        async with gate.slot(request_class):
            order.append(name)
            await asyncio.sleep(0)

    await gate.acquire(BA)  # hold the only slot so everyone below queues
    tasks = [
        asyncio.create_task(worker(name, cls))
        for name, cls in [("b1", BA), ("i1", IA), ("r1", RT), ("i2", IA), ("b2", BA), ("r2", RT)]
    ]
    await settle()
    assert order == [] and gate.waiting() == 6
    gate.release(BA)
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert order == ["r1", "r2", "i1", "i2", "b1", "b2"]


async def test_gate_explicit_priority_overrides_class_priority():
    gate = PriorityGate(total_limit=1)
    await gate.acquire(BA)
    late_interactive = asyncio.create_task(gate.acquire(IA))
    raised_batch = asyncio.create_task(gate.acquire(BA, priority=-1))
    await settle()
    gate.release(BA)
    await settle()
    assert raised_batch.done() and not late_interactive.done()
    gate.release(BA)
    await asyncio.wait_for(late_interactive, 1)


async def test_gate_blocked_class_does_not_block_other_classes():
    gate = PriorityGate({RT: 1}, total_limit=3)
    await gate.acquire(RT)
    waiting_rt = asyncio.create_task(gate.acquire(RT))
    await settle()
    assert not waiting_rt.done()
    # The realtime waiter is ahead by priority but capped by its class limit; interactive still gets the free slots.
    await asyncio.wait_for(gate.acquire(IA), 1)
    await asyncio.wait_for(gate.acquire(IA), 1)
    assert gate.inflight() == 3
    blocked_ia = asyncio.create_task(gate.acquire(IA))
    await settle()
    assert not blocked_ia.done()  # total limit reached
    gate.release(RT)
    await settle()
    assert waiting_rt.done() and not blocked_ia.done()
    waiting_rt.result()
    gate.release(IA)
    await asyncio.wait_for(blocked_ia, 1)


async def test_cancelled_waiter_leaves_queue_and_takes_no_slot():
    gate = PriorityGate(total_limit=1)
    await gate.acquire(IA)
    cancelled = asyncio.create_task(gate.acquire(RT))
    behind = asyncio.create_task(gate.acquire(IA))
    await settle()
    assert gate.waiting() == 2
    cancelled.cancel()
    await settle()
    assert cancelled.cancelled() and gate.waiting() == 1 and gate.waiting(RT) == 0
    gate.release(IA)
    await asyncio.wait_for(behind, 1)
    assert gate.inflight() == 1 and gate.inflight(RT) == 0


async def test_cancel_after_grant_hands_the_slot_on():
    gate = PriorityGate(total_limit=1)
    await gate.acquire(IA)
    granted_then_cancelled = asyncio.create_task(gate.acquire(IA))
    next_in_line = asyncio.create_task(gate.acquire(IA))
    await settle()
    gate.release(IA)  # grants the slot to the first waiter...
    granted_then_cancelled.cancel()  # ...which is cancelled before it resumes
    await settle()
    assert granted_then_cancelled.cancelled()
    await asyncio.wait_for(next_in_line, 1)
    assert gate.inflight() == 1


async def test_slot_released_when_body_raises():
    gate = PriorityGate.for_hot_replica(1)
    with pytest.raises(RuntimeError):
        async with gate.slot(RT):
            assert gate.inflight(RT) == 1
            raise RuntimeError("engine failed")
    assert gate.inflight(RT) == 0


def test_gate_rejects_bad_limits_and_unbalanced_release():
    with pytest.raises(ValueError):
        PriorityGate({RT: 0})
    with pytest.raises(ValueError):
        PriorityGate(total_limit=0)
    with pytest.raises(RuntimeError):
        PriorityGate().release(RT)


# ---- KV headroom -----------------------------------------------------------------------------------------------------


def test_interactive_admitted_up_to_reserve_boundary():
    assert kv_headroom_decision(IA, 0.0, RESERVE).decision is Decision.ADMIT
    assert kv_headroom_decision(IA, 0.80, 0.20).decision is Decision.ADMIT  # exactly 1 - reserve
    assert kv_headroom_decision(IA, 0.81, 0.20).decision is Decision.WAIT


def test_interactive_over_reserve_spills_waits_or_rejects():
    spill = kv_headroom_decision(IA, 0.9, RESERVE, can_spill=True)
    assert spill.decision is Decision.SPILL and "kv_reserve" in spill.reason
    assert kv_headroom_decision(IA, 0.9, RESERVE, can_spill=False, can_wait=True).decision is Decision.WAIT
    reject = kv_headroom_decision(IA, 0.9, RESERVE, can_spill=False, can_wait=False)
    assert reject.decision is Decision.REJECT and reject.retry_after_s >= 1


def test_realtime_uses_the_reserve_until_full():
    assert kv_headroom_decision(RT, 0.95, RESERVE).decision is Decision.ADMIT
    assert kv_headroom_decision(RT, 0.999, RESERVE).decision is Decision.ADMIT
    full = kv_headroom_decision(RT, 1.0, RESERVE)
    assert full.decision is Decision.WAIT and full.reason == "kv_full"
    # Readings slightly out of range (rounding) are clamped, not errors.
    assert kv_headroom_decision(RT, 1.02, RESERVE).decision is Decision.WAIT
    assert kv_headroom_decision(IA, -0.01, RESERVE).decision is Decision.ADMIT


def test_batch_on_hot_replica_never_rejected_for_kv():
    assert kv_headroom_decision(BA, 0.95, RESERVE, can_spill=True, can_wait=False).decision is Decision.WAIT


def test_kv_headroom_validates_inputs():
    with pytest.raises(ValueError):
        kv_headroom_decision(IA, 0.5, realtime_kv_reserve=1.0)
    with pytest.raises(ValueError):
        kv_headroom_decision(IA, math.nan, RESERVE)
    # Reserve 0: interactive may use the whole cache.
    assert kv_headroom_decision(IA, 1.0, realtime_kv_reserve=0.0).decision is Decision.ADMIT


# ---- back-pressure --------------------------------------------------------------------------------------------------


def test_back_pressure_rejects_over_bound_with_the_callers_retry_after():
    bp = BackPressure(bounds={RT: 2, IA: 3, BA: None})
    for _ in range(3):
        assert bp.try_enqueue(IA, retry_after_s=lambda: 7).decision is Decision.ADMIT
    over = bp.try_enqueue(IA, retry_after_s=lambda: 7)
    assert over.decision is Decision.REJECT and "queue_full" in over.reason and over.retry_after_s == 7
    assert bp.queued(IA) == 3
    bp.dequeue(IA)
    assert bp.try_enqueue(IA, retry_after_s=lambda: 7).decision is Decision.ADMIT
    # Classes have separate queues.
    assert bp.try_enqueue(RT, retry_after_s=lambda: 1).decision is Decision.ADMIT


def test_batch_is_never_rejected_for_load():
    bp = BackPressure(bounds={RT: 1, IA: 1, BA: 1})  # even a configured batch bound is ignored
    for _ in range(10_000):
        assert bp.try_enqueue(BA, retry_after_s=lambda: 1).decision is Decision.ADMIT
    assert bp.queued(BA) == 10_000


def test_back_pressure_validates():
    with pytest.raises(ValueError):
        BackPressure(bounds={IA: -1})
    with pytest.raises(RuntimeError):
        BackPressure(bounds={IA: 1}).dequeue(IA)


def test_retry_schedule_spreads_a_backlog_over_the_admission_interval():
    clock = FakeClock()
    schedule = RetrySchedule(clock, min_s=1, max_s=60)
    # One admitted every 0.5 s, the first not before 1.2 s from now: 2, 2 (1.7 s), 3 (2.2 s), 3, 4, ...
    told = [schedule.retry_after_s(1.2, 0.5) for _ in range(6)]
    assert told == [2, 2, 3, 3, 4, 4]
    # Time passes: the promises made so far move closer; new ones queue behind them.
    clock.advance(2.0)
    assert schedule.retry_after_s(0.0, 0.5) == 3  # the 7th promise: 4.2 s after the start, 2.2 s from now
    # Once the schedule's last time has passed, it starts again from the present.
    clock.advance(60.0)
    assert schedule.retry_after_s(0.0, 0.5) == 1


def test_retry_schedule_stays_within_its_bounds():
    clock = FakeClock()
    schedule = RetrySchedule(clock, min_s=1, max_s=5)
    assert schedule.retry_after_s(math.inf, 0.5) == 5  # unknown: the maximum
    assert [schedule.retry_after_s(0.0, 2.0) for _ in range(5)] == [1, 2, 4, 5, 5]
    # Nothing to spread by (no admission rate known yet): everyone gets the earliest time.
    fresh = RetrySchedule(clock)
    assert [fresh.retry_after_s(0.4, 0.0) for _ in range(3)] == [1, 1, 1]
    with pytest.raises(ValueError):
        RetrySchedule(clock, min_s=0)
