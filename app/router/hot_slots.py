"""A Router's share of a lane's engine slots, and the predicted wait for one. Pure asyncio, no Ray.

The hot lane takes interactive requests from this Router up to `limit` at once (its engines' sequences, less the
realtime queue, split across Router replicas); more would only queue inside the engines, out of reach of the
Router's queue bound and its 429s. A request that finds no free slot waits here, first come first served, and
takes the next one freed.

The predicted wait is built from the present state only: the slots in use and how long a request holds one, taken
as the larger of the recent hold times and the mean age of the requests holding slots now (they hold theirs at
least that long). Nothing decays through idle time, so a burst after a quiet spell is predicted from what the lane
is doing, not from how little it did while idle. The time from a slot to the first token is read the same way:
the tail of the recent ones, or longer while a request holding a slot has waited longer than that for its first
token (a burst slows prefill before any slow start has finished and been recorded), or longer while many holders
still await their first token: a newcomer's prefill queues behind theirs, so its start is counted as one recent
start's cost per request ahead of it (each recent start's time divided by the starts it queued behind, plus one).

Tenants: while another tenant waits for these slots or has used them within the last `TENANT_ACTIVE_S`, one tenant
holds at most all but one of them, so a flood of one tenant leaves a slot that another's next request takes at once
(rather than after the flood's next finish, which under a flood of long answers came hundreds of milliseconds
apart). With one tenant in sight every slot is its own. Not a smaller share (each active tenant its weighted part
of the slots, the surplus to the cold lane): on a small host the surplus loads the cold engine's cores, which the
proxy and the Routers use too, and the other tenant's first tokens come no sooner (measured on 2 cores).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping

from app.observability.percentile import percentile
from app.router.slot_waiters import DEFAULT_TENANT, SlotWaiters

START_LATENCY_PERCENTILE = 99
# Hold times kept for the prediction: enough to smooth one slow request, few enough to follow a change of load.
HOLD_TIME_SAMPLES = 32
# How long a tenant that took a slot counts as active: long enough to span an interactive client's think time.
TENANT_ACTIVE_S = 60.0


class LaneSlots:
    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic,
                 hold_samples: int = HOLD_TIME_SAMPLES, tenant_weights: Mapping[str, int] | None = None):
        self.limit = max(limit, 0)
        self.clock = clock
        self.in_flight = 0
        self.peak_in_flight = 0
        self._holders: dict[int, tuple[float, str]] = {}  # token -> (when it took its slot, its tenant)
        self._held_by: Counter[str] = Counter()
        self._last_take_by: dict[str, float] = {}  # tenant -> when it last took a slot
        # token -> (when it took its slot, holders then awaiting their first token ahead of it)
        self._awaiting_first_token: dict[int, tuple[float, int]] = {}
        self._next_token = 0
        self._holds: deque[float] = deque(maxlen=hold_samples)
        self._start_latencies: deque[float] = deque(maxlen=hold_samples)
        # Each recent start's time per request it queued behind (itself included): the lane's pace of starts.
        self._start_costs: deque[float] = deque(maxlen=hold_samples)
        self._waiters = SlotWaiters(self.may_take, weights=tenant_weights)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def cap(self, tenant: str) -> int:
        """Slots `tenant` may hold: all but one while another tenant waits here or took a slot lately (limit
        permitting), else all."""
        if self.limit < 2:
            return self.limit
        since = self.clock() - TENANT_ACTIVE_S
        others = (any(other != tenant for other in self._waiters.waiting_tenants())
                  or any(other != tenant and taken >= since for other, taken in self._last_take_by.items()))
        return self.limit - 1 if others else self.limit

    def at_share(self, tenant: str) -> bool:
        """`tenant` holds its share while the lane has slots free: its cap, not the lane, keeps it out."""
        return self.in_flight < self.limit and not self.may_take(tenant)

    def may_take(self, tenant: str) -> bool:
        return self.in_flight < self.limit and self._held_by[tenant] < self.cap(tenant)

    def free(self, tenant: str = DEFAULT_TENANT) -> int:
        """Slots a newcomer of `tenant` could take now: none while a request waiting may take one (it goes first)."""
        if self._waiters.served_first():
            return 0
        return max(min(self.limit - self.in_flight, self.cap(tenant) - self._held_by[tenant]), 0)

    def set_limit(self, limit: int) -> None:
        self.limit = max(limit, 0)
        self._waiters.notify_one()

    def hold_time_s(self) -> float | None:
        """Expected time a request holds a slot: max(mean recent hold, mean age of the current holders)."""
        now = self.clock()
        ages = [now - since for since, _ in self._holders.values()]
        candidates = []
        if self._holds:
            candidates.append(sum(self._holds) / len(self._holds))
        if ages:
            candidates.append(sum(ages) / len(ages))
        return max(candidates) if candidates else None

    def first_token(self, token: int) -> None:
        """The request holding `token` has its first token: the time since it took the slot (its prefill and the
        hops) feeds start_latency_s()."""
        awaited = self._awaiting_first_token.pop(token, None)
        if awaited is not None:
            since, ahead = awaited
            latency = self.clock() - since
            self._start_latencies.append(latency)
            self._start_costs.append(latency / (ahead + 1))

    def start_latency_s(self) -> float:
        """Time from a slot to the first token for a request taking one now: the 99th percentile of the recent ones
        (a target on the TTFT's tail needs the tail of this part of it), the longest a holder is waiting for its
        first token now, or the median recent cost of one start times the starts it would queue behind (the holders
        awaiting their first token, and itself), whichever is largest; 0 before any is known."""
        recent = percentile(list(self._start_latencies), START_LATENCY_PERCENTILE) if self._start_latencies else 0.0
        if not self._awaiting_first_token:
            return recent
        oldest = self.clock() - min(since for since, _ in self._awaiting_first_token.values())
        queued = ((len(self._awaiting_first_token) + 1) * percentile(list(self._start_costs), 50)
                  if self._start_costs else 0.0)
        return max(recent, oldest, queued)

    def first_start_pending(self) -> bool:
        """No start through these slots has reached its first token yet, and one is under way: the lane's pace is
        still unknown, and the one under way is what will tell it."""
        return not self._start_latencies and bool(self._awaiting_first_token)

    def predicted_wait_s(self, ahead: int | None = None, tenant: str | None = None) -> float:
        """Wait for a slot of a request joining the line behind `ahead` others (default: those served before a
        request of `tenant` joining now, tenants taking turns; without a tenant: all those waiting).

        Slots free at about limit / hold-time per second once all are taken, and a tenant's own at cap / hold-time
        (its own requests ahead of it pass through its share); with no hold time known yet (nothing ever held one)
        the wait is taken as 0: the first burst waits for the slots it fills.
        """
        if ahead is None:
            ahead = self._waiters.ahead_of(tenant) if tenant is not None else self.waiting
        if ahead == 0 and (self.in_flight < self.limit if tenant is None else self.may_take(tenant)):
            return 0.0
        if self.limit == 0:
            return float("inf")
        hold = self.hold_time_s()
        if hold is None:
            return 0.0
        wait = (ahead + 1) * hold / self.limit
        if tenant is not None:
            own = self._waiters.waiting_by_tenant().get(tenant, 0)
            wait = max(wait, (own + 1) * hold / self.cap(tenant))
        return wait

    def admit_interval_s(self) -> float | None:
        """Time between two freed slots once all are taken (hold time / limit); None before any hold time is known,
        inf with no slots."""
        if self.limit == 0:
            return float("inf")
        hold = self.hold_time_s()
        return None if hold is None else hold / self.limit

    def take(self, awaits_first_token: bool = False, tenant: str = DEFAULT_TENANT) -> int:
        """Take a slot now for `tenant` (the caller checked free() or was granted one); returns the token for
        release(). `awaits_first_token`: the holder reports its first token (first_token()), so its wait for it
        counts in start_latency_s() (a streamed request; a collected answer's first chunk is its whole answer)."""
        token = self._next_token
        self._next_token += 1
        now = self.clock()
        self._holders[token] = (now, tenant)
        self._held_by[tenant] += 1
        self._last_take_by[tenant] = now
        if len(self._last_take_by) > 1:
            self._forget_inactive_tenants(now)
        if awaits_first_token:
            self._awaiting_first_token[token] = (now, len(self._awaiting_first_token))
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return token

    async def acquire(self, tenant: str = DEFAULT_TENANT, awaits_first_token: bool = False,
                      give_up: Callable[[], bool] | None = None) -> int:
        """Wait for a slot (tenants in turn, FIFO within one), take it, return its token. Cancellation leaves the
        line; so does `give_up()` turning true while waiting (SlotWaitAbandoned: the wait it still has is no longer
        worth it)."""
        await self._waiters.wait_until(tenant, give_up)
        return self.take(awaits_first_token, tenant)

    def release(self, token: int, record_hold: bool = True) -> None:
        """Give a slot back (exactly once per take). `record_hold`: its hold time feeds the prediction (False for a
        request that ended early by failure or cancellation, whose hold says nothing about the lane's pace)."""
        holder = self._holders.pop(token, None)
        self._awaiting_first_token.pop(token, None)
        if holder is None:
            return
        since, tenant = holder
        self.in_flight -= 1
        self._held_by[tenant] -= 1
        if not self._held_by[tenant]:
            del self._held_by[tenant]
        if record_hold:
            self._holds.append(self.clock() - since)
        self._waiters.notify_one()

    def _forget_inactive_tenants(self, now: float) -> None:
        for tenant, taken in list(self._last_take_by.items()):
            if taken < now - TENANT_ACTIVE_S:
                del self._last_take_by[tenant]

    def stats(self) -> dict[str, float | int | None]:
        hold = self.hold_time_s()
        return {"limit": self.limit, "in_flight": self.in_flight, "in_flight_by_tenant": dict(self._held_by),
                "waiting": self.waiting,
                "waiting_by_tenant": self._waiters.waiting_by_tenant(),
                "queued_by_tenant": dict(self._waiters.queued_by_tenant),
                "peak_in_flight": self.peak_in_flight, "peak_waiting": self._waiters.peak_waiting,
                "hold_time_s": round(hold, 3) if hold is not None else None}
