"""Fair share between tenants inside a class: the Router's waiters for a hot slot take turns by tenant, and one
tenant may fill only its share of a class's queue bound when the app has several."""

from __future__ import annotations

import asyncio

import pytest

from app.classes import RequestClass
from app.lanes.admission import Decision
from app.router.admission import BackPressure
from app.router.hot_slots import LaneSlots
from tests.fakes import FakeClock

IA = RequestClass.INTERACTIVE


async def queue_requests(slots: LaneSlots, tenant: str, count: int, order: list[str]) -> list[asyncio.Task]:
    """`count` requests of `tenant` waiting for a slot of `slots` (named tenant[0] + index); each notes its name in
    `order` when it gets a slot and gives the slot back at once."""
    async def request(name):
        token = await slots.acquire(tenant)
        order.append(name)
        await asyncio.sleep(0)
        slots.release(token)

    tasks = [asyncio.create_task(request(f"{tenant[0]}{i}")) for i in range(count)]
    await asyncio.sleep(0.01)
    return tasks


def test_a_freed_slot_goes_to_the_tenants_in_turn_not_to_the_flood_in_arrival_order():
    async def run():
        slots = LaneSlots(limit=1)
        held = slots.take()
        order = []
        tasks = await queue_requests(slots, "a", 6, order) + await queue_requests(slots, "b", 2, order)
        assert slots.stats()["waiting_by_tenant"] == {"a": 6, "b": 2}
        slots.release(held)
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(run())
    # B's two requests, queued behind A's six, are served after at most one of A's each.
    assert order.index("b0") <= 1 and order.index("b1") <= 3, order
    assert [name for name in order if name[0] == "a"] == [f"a{i}" for i in range(6)]  # FIFO within a tenant


def test_one_tenant_is_plain_first_come_first_served():
    async def run():
        slots = LaneSlots(limit=1)
        held = slots.take()
        order = []

        async def request(i):
            token = await slots.acquire()
            order.append(i)
            slots.release(token)

        tasks = [asyncio.create_task(request(i)) for i in range(5)]
        await asyncio.sleep(0.01)
        slots.release(held)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run()) == list(range(5))


def test_a_tenant_fills_at_most_its_share_of_a_queue_bound_and_the_others_still_get_in():
    queues = BackPressure({IA: 8})
    queues.share_between_tenants(0.75)
    admitted = [queues.try_enqueue(IA, lambda: 1, "a").decision for _ in range(8)]
    assert admitted.count(Decision.ADMIT) == 6  # 75 % of 8
    assert [queues.try_enqueue(IA, lambda: 1, "b").decision for _ in range(3)] == [Decision.ADMIT] * 2 + [
        Decision.REJECT]  # the bound itself still holds
    queues.dequeue(IA, "a")
    assert queues.try_enqueue(IA, lambda: 1, "a").decision is Decision.ADMIT
    assert queues.queued(IA) == 8


def test_without_several_tenants_the_whole_bound_is_one_tenants():
    queues = BackPressure({IA: 4})
    assert [queues.try_enqueue(IA, lambda: 1).decision for _ in range(5)].count(Decision.ADMIT) == 4


def test_the_predicted_wait_is_a_tenants_turn_not_the_whole_line():
    async def run():
        clock = FakeClock()
        slots = LaneSlots(limit=2, clock=clock)
        held = [slots.take(), slots.take()]
        clock.advance(1.0)
        slots.release(held.pop())  # one hold time on record
        held.append(slots.take())
        waiters = [asyncio.create_task(slots.acquire("a")) for _ in range(10)]
        await asyncio.sleep(0.01)
        flood, other = slots.predicted_wait_s(tenant="a"), slots.predicted_wait_s(tenant="b")
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        return flood, other, slots

    flood, other, slots = asyncio.run(run())
    hold = slots.hold_time_s()  # the clock stood still since
    # B waits for one turn of A's line on both slots; A's own ten pass through its cap (all but one of the two
    # slots, as the tenant holding them is active too).
    assert other == pytest.approx((1 + 1) * hold / 2) and flood == pytest.approx((10 + 1) * hold / 1)


def test_a_tenant_of_weight_three_takes_three_slots_per_turn_and_its_wait_is_predicted_so():
    async def run():
        slots = LaneSlots(limit=1, tenant_weights={"gold": 3})
        held = slots.take()
        order = []
        tasks = await queue_requests(slots, "std", 4, order) + await queue_requests(slots, "gold", 6, order)
        # A new gold request waits for the 6 gold ones (two turns of 3) and a standard one per gold turn (3 turns).
        ahead_gold, ahead_std = slots._waiters.ahead_of("gold"), slots._waiters.ahead_of("std")
        slots.release(held)
        await asyncio.gather(*tasks)
        return order, ahead_gold, ahead_std

    order, ahead_gold, ahead_std = asyncio.run(run())
    assert order == ["s0", "g0", "g1", "g2", "s1", "g3", "g4", "g5", "s2", "s3"], order
    assert ahead_gold == 6 + 3 and ahead_std == 4 + 6


def test_a_flooding_tenant_leaves_a_slot_that_another_active_tenants_request_takes_at_once():
    async def run():
        clock = FakeClock()
        slots = LaneSlots(limit=4, clock=clock)
        slots.release(slots.take(tenant="b"))  # B has been here: active
        flood = [slots.take(tenant="a") for _ in range(3)]
        assert slots.free("a") == 0 and slots.free("b") == 1  # A's cap is all but one
        assert slots.at_share("a") and not slots.at_share("b")  # A is kept out by its cap, not by a full lane
        waiting_a = [asyncio.create_task(slots.acquire("a")) for _ in range(5)]
        await asyncio.sleep(0.01)
        b = await asyncio.wait_for(slots.acquire("b"), timeout=0.1)  # past A's line, into the slot kept free
        assert slots.stats()["in_flight_by_tenant"] == {"a": 3, "b": 1} and not any(t.done() for t in waiting_a)
        # What the admin stats show of it: A's requests joined the line, B's did not.
        assert slots.stats()["queued_by_tenant"] == {"a": 5}
        assert not slots.at_share("a")  # the lane is full now
        slots.release(flood.pop())  # one of A's finishes: the next of A's line takes its place
        await asyncio.sleep(0.01)
        assert sum(task.done() for task in waiting_a) == 1 and slots.in_flight == 4
        for task in waiting_a:
            task.cancel()
        await asyncio.gather(*waiting_a, return_exceptions=True)
        return slots, clock, b

    slots, clock, b = asyncio.run(run())
    slots.release(b)
    clock.advance(61)  # B gone quiet: A may have every slot again
    assert slots.free("a") == 4 - slots.in_flight


def test_one_tenant_alone_may_hold_every_slot():
    slots = LaneSlots(limit=3, clock=FakeClock())
    for _ in range(3):
        assert slots.free("a") > 0
        slots.take(tenant="a")
    assert slots.in_flight == 3


def test_a_freed_slot_skips_a_tenant_at_its_cap_for_the_next_that_may_take_it():
    async def run():
        slots = LaneSlots(limit=2, clock=FakeClock())
        a, b = slots.take(tenant="a"), slots.take(tenant="b")  # each at its cap of one
        order = []
        tasks = await queue_requests(slots, "a", 2, order) + await queue_requests(slots, "b", 1, order)
        slots.release(b)  # A is first in the rotation but holds its cap: B's waiting request takes the slot
        await asyncio.sleep(0.01)
        assert order == ["b0"]
        slots.release(a)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run()) == ["b0", "a0", "a1"]


def test_a_tenant_waiting_for_a_slot_counts_as_active_so_the_next_freed_slot_is_its_own():
    async def run():
        slots = LaneSlots(limit=3, clock=FakeClock())
        flood = [slots.take(tenant="a") for _ in range(3)]  # A alone: every slot its own
        order = []
        tasks = await queue_requests(slots, "a", 2, order) + await queue_requests(slots, "b", 1, order)
        slots.release(flood.pop())  # A, waiting first, is at its cap now that B waits: the slot is B's
        await asyncio.sleep(0.01)
        assert order == ["b0"]
        for token in flood:
            slots.release(token)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(run()) == ["b0", "a0", "a1"]
