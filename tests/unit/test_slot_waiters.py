import asyncio

import pytest

from app.router.slot_waiters import SlotWaitAbandoned, SlotWaiters


class Slots:
    def __init__(self, free: int):
        self.free = free

    def has_slot(self, tenant: str) -> bool:
        return self.free > 0

    def take(self) -> None:
        assert self.free > 0
        self.free -= 1


async def take_when_free(waiters: SlotWaiters, slots: Slots, order: list[int], i: int) -> None:
    await waiters.wait_until()
    slots.take()  # before the next await, as the Router does
    order.append(i)


async def test_a_free_slot_is_taken_without_waiting():
    slots = Slots(1)
    waiters = SlotWaiters(slots.has_slot)
    await asyncio.wait_for(waiters.wait_until(), timeout=0.1)
    assert len(waiters) == 0


async def test_freed_slots_go_to_the_waiters_in_arrival_order_one_per_slot():
    slots, order = Slots(0), []
    waiters = SlotWaiters(slots.has_slot, recheck_s=10)
    tasks = [asyncio.create_task(take_when_free(waiters, slots, order, i)) for i in range(5)]
    await asyncio.sleep(0.01)
    assert len(waiters) == 5 and order == []
    for expected in ([0], [0, 1, 2]):
        for _ in range(len(expected) - len(order)):
            slots.free += 1
            waiters.notify_one()
        await asyncio.sleep(0.01)
        assert order == expected
    slots.free += 2
    waiters.notify_one()
    waiters.notify_one()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4] and len(waiters) == 0


async def test_a_newcomer_does_not_overtake_those_waiting():
    slots, order = Slots(0), []
    waiters = SlotWaiters(slots.has_slot, recheck_s=10)
    first = asyncio.create_task(take_when_free(waiters, slots, order, 0))
    await asyncio.sleep(0.01)
    slots.free = 1  # free, but nobody was told yet: the newcomer must queue behind the first
    second = asyncio.create_task(take_when_free(waiters, slots, order, 1))
    await asyncio.sleep(0.01)
    assert order == []
    waiters.notify_one()
    await asyncio.sleep(0.01)
    assert order == [0]
    slots.free = 1
    waiters.notify_one()
    await asyncio.gather(first, second)
    assert order == [0, 1]


async def test_a_condition_that_turns_true_without_a_notification_is_seen_at_the_recheck():
    slots, order = Slots(0), []
    waiters = SlotWaiters(slots.has_slot, recheck_s=0.02)
    task = asyncio.create_task(take_when_free(waiters, slots, order, 0))
    await asyncio.sleep(0.01)
    slots.free = 1
    await asyncio.wait_for(task, timeout=1)
    assert order == [0]


async def test_a_waiter_that_leaves_is_skipped():
    slots, order = Slots(0), []
    waiters = SlotWaiters(slots.has_slot, recheck_s=10)
    gone = asyncio.create_task(take_when_free(waiters, slots, order, 0))
    stays = asyncio.create_task(take_when_free(waiters, slots, order, 1))
    await asyncio.sleep(0.01)
    gone.cancel()  # the client went away while waiting
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert len(waiters) == 1
    slots.free = 1
    waiters.notify_one()  # goes to the one still waiting, not to the one that left
    await asyncio.wait_for(stays, timeout=1)
    assert order == [1] and len(waiters) == 0


def test_recheck_must_be_positive():
    with pytest.raises(ValueError, match="recheck_s"):
        SlotWaiters(Slots(0).has_slot, recheck_s=0)


async def test_a_slot_freed_from_another_thread_wakes_the_waiter_on_its_loop():
    import threading

    slots, order = Slots(0), []
    waiters = SlotWaiters(slots.has_slot, recheck_s=10)
    task = asyncio.create_task(take_when_free(waiters, slots, order, 0))
    await asyncio.sleep(0.01)
    slots.free = 1
    thread = threading.Thread(target=waiters.notify_one)  # as a garbage-collection finalizer might
    thread.start()
    thread.join()
    await asyncio.wait_for(task, timeout=1)
    assert order == [0]


async def test_a_waiter_gives_up_at_a_recheck_without_a_slot_being_freed():
    slots = Slots(0)
    waiters = SlotWaiters(slots.has_slot, recheck_s=0.02)
    gave_up = {"now": False}
    task = asyncio.create_task(waiters.wait_until(give_up=lambda: gave_up["now"]))
    await asyncio.sleep(0.05)
    assert len(waiters) == 1 and not task.done()
    gave_up["now"] = True
    with pytest.raises(SlotWaitAbandoned):
        await asyncio.wait_for(task, 1)
    assert len(waiters) == 0
