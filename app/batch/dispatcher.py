"""The batch dispatcher: drains queued batch lines from the durable store into the cold lane.

Guarantees (with the store's contract, see app.batch.store):
- at-least-once execution: lines are leased; a dispatcher that dies leaves leases that run out, and any dispatcher
  (this replica after a restart, or another replica) claims those lines again;
- exactly-once recording: the first recorded outcome of a line wins, later ones are no-ops;
- no line runs twice at the same time while its lease is alive: leases are renewed while a line runs.

The engine call is injected: `execute(line) -> awaitable dict` with the OpenAI-style outcome
{"status_code": int, "body": dict, "request_id": str (optional)}. 2xx records the response; 4xx (other than
408/429) is the request's own fault and fails the line at once; anything else (5xx, 408, 429, an exception) is
transient and is retried until max_attempts, then the line fails.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from app.batch.store import BatchStore, ClaimedLine
from app.batch.window import ConcurrencyWindow
from app.config import BatchConfig

logger = logging.getLogger(__name__)

ExecuteFn = Callable[[ClaimedLine], Awaitable[dict[str, Any]]]

# Statuses that mean "try again later" rather than "this request is wrong".
RETRYABLE_CLIENT_STATUSES = (408, 429)


def dispatch_capacity(window_size: int, cold_replicas: int, router_replicas: int) -> int:
    """Lines one dispatcher keeps in flight: the window is per cold-lane replica, and every Router replica runs a
    dispatcher, so each takes its share of window x cold replicas. Never below one line: with the cold lane scaled
    to zero, a line waiting at the lane's handle is what brings a replica back."""
    cold, routers = max(1, cold_replicas), max(1, router_replicas)
    return max(1, math.ceil(window_size * cold / routers))


def is_success(status_code: int) -> bool:
    return 200 <= status_code < 300


def is_client_error(status_code: int) -> bool:
    return 400 <= status_code < 500 and status_code not in RETRYABLE_CLIENT_STATUSES


def output_tokens_of(result: dict[str, Any]) -> int:
    body = result.get("body")
    usage = body.get("usage") if isinstance(body, dict) else None
    return int(usage.get("completion_tokens", 0)) if isinstance(usage, dict) else 0


def error_of(result: dict[str, Any]) -> dict[str, str]:
    """OpenAI error body -> the error file's {"code", "message"}."""
    body = result.get("body")
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return {"code": str(error.get("code") or error.get("type") or "request_failed"),
                "message": str(error.get("message", ""))}
    return {"code": "request_failed", "message": f"status {result.get('status_code')}"}


@dataclass
class DispatcherStats:
    executed: int = 0
    completed: int = 0
    failed: int = 0
    retried: int = 0
    duplicates_ignored: int = 0  # outcomes that lost the exactly-once race (another run already recorded)
    finalized_batches: int = 0


class BatchDispatcher:
    def __init__(self, store: BatchStore, execute: ExecuteFn, settings: BatchConfig, *,
                 window: ConcurrencyWindow | None = None, owner: str | None = None,
                 renew_interval_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        """`settings` is the schema's batch section (lease_s, poll_interval_s, max_attempts, and the window's
        settings when no `window` is given), which validates its values."""
        self.store = store
        self.execute = execute
        self.window = window or ConcurrencyWindow(settings)
        # Unique per dispatcher instance: a restarted process must not mistake its predecessor's leases for its own.
        self.owner = owner or f"dispatcher-{uuid.uuid4().hex[:12]}"
        self.lease_s = settings.lease_s
        # Renew well before the lease runs out, so one slow store round trip cannot lose it.
        self.renew_interval_s = renew_interval_s if renew_interval_s is not None else self.lease_s / 3
        self.poll_interval_s = settings.poll_interval_s
        self.max_attempts = settings.max_attempts
        self.clock = clock
        self.stats = DispatcherStats()
        self._in_flight: dict[tuple[str, int], asyncio.Task] = {}
        self._stopping = asyncio.Event()
        # Set when this Router replica creates a batch, so an idle dispatcher claims its lines at once instead of
        # at its next poll; batches created through other replicas are found by polling.
        self._new_work = asyncio.Event()
        self._last_renew = 0.0
        # Replica counts this dispatcher's share is computed from (set_replica_counts); 1 and 1 until told.
        self.cold_replicas = 1
        self.router_replicas = 1

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def capacity(self) -> int:
        """Lines this dispatcher may have in flight now: its share of the cold lane's slots (dispatch_capacity)."""
        return dispatch_capacity(self.window.size, self.cold_replicas, self.router_replicas)

    def set_replica_counts(self, cold_replicas: int, router_replicas: int) -> None:
        """The cold lane's and the Router's running replica counts, as the Router last read them."""
        self.cold_replicas, self.router_replicas = cold_replicas, router_replicas

    def notify_new_work(self) -> None:
        """A batch was just created here: wake the loop if it is idle."""
        self._new_work.set()

    def stop(self) -> None:
        """Ask run() to stop claiming; it returns once the lines in flight have been recorded."""
        self._stopping.set()

    async def shutdown(self, run_task: asyncio.Task, grace_s: float) -> list[tuple[str, int]]:
        """Stop `run_task` (this dispatcher's run()): stop claiming, give the lines in flight `grace_s` to be
        recorded, then cancel the rest and release their leases, so that a dispatcher still running (another Router
        replica, or this one's successor) claims them at once instead of after lease_s. Returns the released lines.
        A release that loses to a recorded outcome or an expired lease changes nothing (the store's owner check)."""
        self.stop()
        done, _ = await asyncio.wait([run_task], timeout=grace_s)
        if done:
            return []
        unfinished = list(self._in_flight)
        run_task.cancel()
        await asyncio.gather(run_task, *self._in_flight.values(), return_exceptions=True)
        released = []
        for batch_id, line_no in unfinished:
            if await self._store_call(self.store.release_line, batch_id, line_no, self.owner):
                released.append((batch_id, line_no))
        if released:
            logger.info("dispatcher %s stopping: released %d leased lines", self.owner, len(released))
        return released

    async def run(self) -> None:
        """The dispatch loop: claim up to the window, run, renew, record, finalize. Returns after stop()."""
        await self._store_call(self.store.expire_overdue_batches)
        await self._finalize_settled_batches()  # batches whose last line was recorded just before a restart
        try:
            while not self._stopping.is_set():
                # Cleared before the claim, so a batch created during step() still wakes the wait below.
                self._new_work.clear()
                await self.step()
                if self._in_flight:
                    await asyncio.wait(list(self._in_flight.values()), timeout=self.poll_interval_s,
                                       return_when=asyncio.FIRST_COMPLETED)
                else:
                    await self._wait_idle()
            if self._in_flight:
                await asyncio.gather(*self._in_flight.values(), return_exceptions=True)
        except asyncio.CancelledError:
            # Killed: in-flight lines keep their leases and are re-run by whoever claims them after expiry.
            for task in self._in_flight.values():
                task.cancel()
            raise

    async def _wait_idle(self) -> None:
        """Nothing in flight: wait for stop(), a batch created here, or the next poll, whichever comes first."""
        waits = [asyncio.ensure_future(self._stopping.wait()), asyncio.ensure_future(self._new_work.wait())]
        try:
            await asyncio.wait(waits, timeout=self.poll_interval_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def step(self) -> int:
        """One pass: renew leases if due, claim into free window slots, start them. Returns lines claimed."""
        now = self.clock()
        self.window.begin(now)
        if self._in_flight and now - self._last_renew >= self.renew_interval_s:
            await self._store_call(self.store.renew_leases, self.owner, list(self._in_flight), self.lease_s)
            self._last_renew = now
        self.window.update_if_due(now)
        free = self.capacity - len(self._in_flight)
        if free <= 0 or self._stopping.is_set():
            return 0
        claimed = await self._store_call(self.store.claim_lines, self.owner, free, self.lease_s)
        if claimed and not self._in_flight:
            self._last_renew = now
        for line in claimed:
            key = (line.batch_id, line.line_no)
            self._in_flight[key] = asyncio.create_task(self._run_line(line), name=f"batch-line-{key}")
        if not claimed and not self._in_flight:
            self.window.restart()
            await self._store_call(self.store.expire_overdue_batches)
        return len(claimed)

    async def run_until_idle(self, max_wait_s: float = 60.0) -> None:
        """Drive the loop until nothing is claimable or in flight (tests, one-shot draining)."""
        deadline = self.clock() + max_wait_s
        while True:
            claimed = await self.step()
            if self._in_flight:
                await asyncio.wait(list(self._in_flight.values()), timeout=self.poll_interval_s,
                                   return_when=asyncio.FIRST_COMPLETED)
            elif not claimed:
                await self._finalize_settled_batches()
                return
            if self.clock() > deadline:
                raise TimeoutError(f"dispatcher not idle after {max_wait_s} s")

    async def _run_line(self, line: ClaimedLine) -> None:
        key = (line.batch_id, line.line_no)
        started = self.clock()
        try:
            try:
                result = await self.execute(line)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the cold lane is unreachable, a replica died mid-request, ...
                logger.warning("batch line %s failed to execute (attempt %d): %r", key, line.attempts, error)
                await self._retry_or_fail(line, {"code": "execution_failed", "message": str(error) or repr(error)},
                                          None)
                return
            self.stats.executed += 1
            status = int(result.get("status_code", 500))
            if is_success(status):
                self.window.record(self.clock() - started, output_tokens_of(result), self.clock())
                await self._record(self.store.complete_line, line, result)
                self.stats.completed += 1
            elif is_client_error(status):
                await self._record(self.store.fail_line, line, error_of(result), result)
                self.stats.failed += 1
            else:
                await self._retry_or_fail(line, error_of(result), result)
        finally:
            self._in_flight.pop(key, None)
        if not self._runs_lines_of(line.batch_id):
            # Only a batch with none of its lines in flight here can be settled: skipping the check otherwise saves
            # a store query (a count over the batch's open lines) per line, O(n^2) over a large batch.
            await self._finalize_if_settled(line.batch_id)

    def _runs_lines_of(self, batch_id: str) -> bool:
        return any(in_flight_batch == batch_id for in_flight_batch, _ in self._in_flight)

    async def _retry_or_fail(self, line: ClaimedLine, error: dict[str, str], response: dict | None) -> None:
        if line.attempts < self.max_attempts:
            await self._store_call(self.store.release_line, line.batch_id, line.line_no, self.owner)
            self.stats.retried += 1
        else:
            await self._record(self.store.fail_line, line, error, response)
            self.stats.failed += 1

    async def _record(self, method: Callable[..., bool], line: ClaimedLine, *args: Any) -> None:
        if not await self._store_call(method, line.batch_id, line.line_no, *args):
            self.stats.duplicates_ignored += 1

    async def _finalize_if_settled(self, batch_id: str) -> None:
        if await self._store_call(self.store.finalize_batch, batch_id) is not None:
            self.stats.finalized_batches += 1

    async def _finalize_settled_batches(self) -> None:
        for batch in await self._store_call(self.store.list_active_batches):
            await self._finalize_if_settled(batch.id)

    async def _store_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        # Store calls block (disk, network): keep them off the event loop that also serves HTTP.
        return await asyncio.to_thread(fn, *args)
