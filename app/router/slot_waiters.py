"""Requests waiting in the Router for a slot: tenants take turns, each tenant's requests first come, first served;
woken one per freed slot.

Fair share: a freed slot goes to the next tenant in rotation that has a request waiting (weighted round robin: a
tenant of weight w takes up to w slots in a row on its turn, 1 by default), so one tenant's flood of waiting
requests delays another tenant's by at most its weight in slots per turn, not by the whole flood. With one tenant
this is plain first come, first served.

Pure asyncio, no Ray. Whether a tenant may take a slot now (`can_take`) lives elsewhere (LaneSlots: a free slot
within the tenant's cap); this only parks the waiters and wakes them. A freed slot goes to the first tenant in the
rotation that may take it, so a tenant at its cap neither takes nor blocks a slot kept for the others, and a newcomer
takes a free slot at once when none of those waiting may take it. A waiter also re-checks every `recheck_s`,
because a condition can become true without a slot being freed (the Router's share of the slots grows when a
replica comes up).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, deque
from collections.abc import Callable, Mapping

from app.batch.store import DEFAULT_TENANT

RECHECK_S = 0.25


class SlotWaitAbandoned(Exception):
    """A waiter left the line because its give_up() turned true."""


class SlotWaiters:
    def __init__(self, can_take: Callable[[str], bool], recheck_s: float = RECHECK_S,
                 weights: Mapping[str, int] | None = None):
        """`can_take(tenant)`: a request of `tenant` may take a slot now. `weights`: slots a tenant takes in a row on
        its turn (auth.tenant_weights); 1 for a tenant not named."""
        if recheck_s <= 0:
            raise ValueError(f"recheck_s={recheck_s} must be > 0")
        if weights and min(weights.values()) < 1:
            raise ValueError(f"tenant weights must be >= 1, got {dict(weights)}")
        self.can_take = can_take
        self.recheck_s = recheck_s
        self.weights = dict(weights or {})
        self._queues: dict[str, deque[asyncio.Future]] = {}
        self._turns: deque[str] = deque()  # tenants with a queue, the next to be served first
        self._served_this_turn = 0  # slots the tenant at the front of _turns has taken on its current turn
        # Requests in line or woken and not yet back from wait_until(), per tenant.
        self._waiting_tenants: Counter[str] = Counter()
        self.peak_waiting = 0
        # Requests that found no slot for them and joined the line, per tenant, since the start: with the turns and
        # the slot a flooding tenant leaves free, another tenant's requests join it rarely.
        self.queued_by_tenant: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        """Requests waiting now."""
        return sum(self._waiting_tenants.values())

    def waiting_by_tenant(self) -> dict[str, int]:
        return {tenant: sum(not w.done() for w in queue) for tenant, queue in self._queues.items()}

    def waiting_tenants(self) -> list[str]:
        """Tenants with a request in line or woken and not yet back."""
        return list(self._waiting_tenants)

    def served_first(self) -> bool:
        """Some request waiting (in line or woken) may take a slot now: it goes before any newcomer."""
        return any(self.can_take(tenant) for tenant in self._waiting_tenants)

    def weight(self, tenant: str) -> int:
        return self.weights.get(tenant, 1)

    def ahead_of(self, tenant: str) -> int:
        """Requests served before one of `tenant` that joins the line now: its tenant's own waiting requests, and of
        every other tenant as many as take their turns meanwhile (its weight per turn of this tenant, at most all
        it has waiting)."""
        waiting = self.waiting_by_tenant()
        own = waiting.get(tenant, 0)
        turns = math.ceil((own + 1) / self.weight(tenant))
        return own + sum(min(count, turns * self.weight(other)) for other, count in waiting.items() if other != tenant)

    def _enqueue(self, tenant: str, waiter: asyncio.Future) -> None:
        if tenant not in self._queues:
            self._queues[tenant] = deque()
            self._turns.append(tenant)
        self._queues[tenant].append(waiter)

    async def wait_until(self, tenant: str = DEFAULT_TENANT, give_up: Callable[[], bool] | None = None) -> None:
        """Return once a request of `tenant` may take a slot; the caller takes it before its next await. `give_up`,
        asked at each re-check and wake-up before can_take(): true leaves the line (SlotWaitAbandoned), handing a
        wake-up on to the next waiter."""
        # Those already waiting go first: a newcomer does not overtake one that may take the free slot.
        if self.can_take(tenant) and not self.served_first():
            return
        loop = self._loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._enqueue(tenant, waiter)
        self._waiting_tenants[tenant] += 1
        self.queued_by_tenant[tenant] += 1
        self.peak_waiting = max(self.peak_waiting, len(self))
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(waiter), timeout=self.recheck_s)
                except asyncio.TimeoutError:
                    if give_up is not None and give_up():
                        raise SlotWaitAbandoned() from None
                    if self.can_take(tenant):
                        return
                    continue  # still in line, same place
                if give_up is not None and give_up():
                    raise SlotWaitAbandoned()
                if self.can_take(tenant):
                    return
                # Woken, but the slot went to a request that may take it first: back in line, at the end of its
                # tenant's.
                waiter = loop.create_future()
                self._enqueue(tenant, waiter)
        except (asyncio.CancelledError, SlotWaitAbandoned):
            if waiter.done():
                self.notify_one()  # woken but gone: hand the wake-up on
            raise
        finally:
            self._waiting_tenants[tenant] -= 1
            if not self._waiting_tenants[tenant]:
                del self._waiting_tenants[tenant]
            if not waiter.done():
                waiter.cancel()  # out of line: notify_one skips it

    def notify_one(self) -> None:
        """A slot was freed: wake the longest-waiting request of the tenant whose turn it is (it re-checks the
        condition itself). Safe from any
        thread (a garbage-collection finalizer may free a slot off the event loop's thread)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._loop is not None and running is not self._loop:
            # Not on the waiters' loop (another thread, or another loop): hand the wake-up over to it.
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._wake_first)
            return
        self._wake_first()

    def _wake_first(self) -> None:
        """Wake the next request of the first tenant in the rotation that may take a slot now; tenants ahead of it
        that may not (at their cap) keep their places."""
        for tenant in list(self._turns):
            queue = self._queues[tenant]
            while queue and queue[0].done():
                queue.popleft()  # left the line (cancelled) or already woken
            if not queue:
                self._leave_rotation(tenant)
                continue
            if not self.can_take(tenant):
                continue
            if tenant != self._turns[0]:
                # Its turn comes early, as those ahead cannot use this slot.
                self._turns.remove(tenant)
                self._turns.appendleft(tenant)
                self._served_this_turn = 0
            queue.popleft().set_result(None)
            self._served_this_turn += 1
            if self._served_this_turn >= self.weight(tenant) or not queue:
                self._end_turn(tenant)
            return

    def _leave_rotation(self, tenant: str) -> None:
        if self._turns[0] == tenant:
            self._served_this_turn = 0
        self._turns.remove(tenant)
        del self._queues[tenant]

    def _end_turn(self, tenant: str) -> None:
        """The tenant at the front has had its turn: to the back of the rotation while it has requests waiting."""
        self._turns.popleft()
        self._served_this_turn = 0
        if self._queues[tenant]:
            self._turns.append(tenant)  # its next request waits for the other tenants' turns
        else:
            del self._queues[tenant]
