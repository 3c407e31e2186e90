"""Dispatcher logic against the real SQLite store, with a fake async engine call standing in for the ColdLane."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from app.batch.dispatcher import BatchDispatcher, dispatch_capacity
from app.batch.sqlite_store import SqliteBatchStore
from app.batch.store import LINE_FAILED, ClaimedLine
from app.batch.window import ConcurrencyWindow
from app.config import BatchConfig

ENDPOINT = "/v1/chat/completions"


def batch_settings(window: tuple[int, int] = (16, 32), **overrides) -> BatchConfig:
    """The schema's batch section with these window bounds; no slow start unless asked (a steady window)."""
    return BatchConfig(**{"window_min": window[0], "window_max": window[1], "window_slow_start": False, **overrides})


def make_batch(store, n: int):
    lines = [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": ENDPOINT,
                         "body": {"model": "tiny", "messages": [{"role": "user", "content": f"q{i}"}]}})
             for i in range(n)]
    input_file = store.create_file("batch", "in.jsonl", ("\n".join(lines) + "\n").encode())
    return store.create_batch(input_file.id, ENDPOINT, "24h")


def ok(line: ClaimedLine) -> dict:
    return {"status_code": 200, "request_id": f"rid-{line.custom_id}",
            "body": {"object": "chat.completion", "echo": line.custom_id, "usage": {"completion_tokens": 4}}}


def output_ids(store, batch_id: str) -> list[str]:
    batch = store.get_batch(batch_id)
    return [json.loads(x)["custom_id"] for x in store.file_content(batch.output_file_id).splitlines()]


class FakeEngine:
    """Tracks what runs concurrently, so tests can assert no line is ever executed twice at the same time."""

    def __init__(self, delay_s: tuple[float, float] = (0.001, 0.005)):
        self.delay_s = delay_s
        self.running: set[tuple[str, int]] = set()
        self.max_running = 0
        self.executions: list[tuple[str, int]] = []
        self.overlaps: list[tuple[str, int]] = []

    async def __call__(self, line: ClaimedLine) -> dict:
        key = (line.batch_id, line.line_no)
        if key in self.running:
            self.overlaps.append(key)
        self.running.add(key)
        self.max_running = max(self.max_running, len(self.running))
        self.executions.append(key)
        try:
            await asyncio.sleep(random.uniform(*self.delay_s))
            return ok(line)
        finally:
            self.running.discard(key)


@pytest.fixture
def db_path(tmp_path):
    return str(tmp_path / "batches.sqlite3")


async def test_200_line_batch_records_every_custom_id_once(db_path):
    store = SqliteBatchStore(db_path)
    batch = make_batch(store, 200)
    engine = FakeEngine()
    dispatcher = BatchDispatcher(store, engine, batch_settings((16, 32), poll_interval_s=0.01))
    await dispatcher.run_until_idle()
    final = store.get_batch(batch.id)
    assert final.status == "completed"
    assert (final.request_counts.total, final.request_counts.completed, final.request_counts.failed) == (200, 200, 0)
    ids = output_ids(store, batch.id)
    assert sorted(ids) == sorted(f"req-{i}" for i in range(200)) and len(set(ids)) == 200
    assert 1 < engine.max_running <= 32
    assert len(engine.executions) == 200 and not engine.overlaps
    assert dispatcher.stats.completed == 200 and dispatcher.stats.finalized_batches == 1
    store.close()


async def test_settlement_is_checked_only_when_no_line_of_the_batch_is_left_in_flight(db_path):
    store = SqliteBatchStore(db_path)
    batch = make_batch(store, 100)
    checks = []
    finalize = store.finalize_batch
    store.finalize_batch = lambda batch_id: checks.append(batch_id) or finalize(batch_id)
    dispatcher = BatchDispatcher(store, FakeEngine(), batch_settings((16, 16), poll_interval_s=0.01))
    await dispatcher.run_until_idle()
    assert store.get_batch(batch.id).status == "completed" and dispatcher.stats.finalized_batches == 1
    # Not once per line: only when the dispatcher's in-flight set held no other line of the batch.
    assert 1 <= len(checks) < 20, len(checks)
    store.close()


async def test_window_restarts_when_the_queue_runs_dry(db_path):
    store = SqliteBatchStore(db_path)
    make_batch(store, 40)
    settings = batch_settings((4, 16), window_slow_start=True, window_interval_s=0.01, poll_interval_s=0.01)
    window = ConcurrencyWindow(settings, min_samples=2)
    dispatcher = BatchDispatcher(store, FakeEngine(delay_s=(0.005, 0.01)), settings, window=window)
    await dispatcher.run_until_idle()
    assert window.size == 4 and window.slow_start is True  # the next job starts from the bottom again
    store.close()


async def test_window_size_bounds_concurrency(db_path):
    store = SqliteBatchStore(db_path)
    make_batch(store, 40)
    engine = FakeEngine()
    await BatchDispatcher(store, engine, batch_settings((4, 4), poll_interval_s=0.01)).run_until_idle()
    assert engine.max_running == 4 and len(engine.executions) == 40
    store.close()


@pytest.mark.parametrize(("window", "cold", "routers", "expected"), [
    (32, 1, 1, 32),   # one Router, one cold replica: the window itself
    (32, 2, 1, 64),   # the window is per cold replica: a scaled-out lane gets work for each replica
    (32, 1, 4, 8),    # four Routers share one replica's window
    (32, 3, 2, 48),
    (5, 1, 4, 2),     # a share is rounded up: 1.25 -> 2
    (16, 0, 1, 16),   # scaled to zero: still dispatch, the waiting line brings a replica back
    (1, 1, 8, 1),     # never below one line
])
def test_dispatch_capacity_is_the_routers_share_of_window_times_cold_replicas(window, cold, routers, expected):
    assert dispatch_capacity(window, cold, routers) == expected


async def test_capacity_follows_the_replica_counts(db_path):
    store = SqliteBatchStore(db_path)
    make_batch(store, 60)
    engine = FakeEngine(delay_s=(0.005, 0.01))
    dispatcher = BatchDispatcher(store, engine, batch_settings((4, 4), poll_interval_s=0.01))
    dispatcher.set_replica_counts(cold_replicas=3, router_replicas=1)
    assert dispatcher.capacity == 12
    await dispatcher.run_until_idle()
    assert engine.max_running == 12 and len(engine.executions) == 60
    store.close()


async def test_killed_dispatcher_lines_are_rerun_after_lease_expiry_without_duplicates(db_path):
    lease_s = 0.4
    store_a = SqliteBatchStore(db_path)
    batch = make_batch(store_a, 60)
    started = asyncio.Event()
    hung: list[str] = []

    async def execute_then_hang(line: ClaimedLine) -> dict:
        # The first 20 lines finish; later ones hang as if the replica died mid-request.
        if line.line_no <= 20:
            return ok(line)
        hung.append(line.custom_id)
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    dispatcher_a = BatchDispatcher(store_a, execute_then_hang,
                                   batch_settings((8, 8), lease_s=lease_s, poll_interval_s=0.01))
    task = asyncio.create_task(dispatcher_a.run())
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.sleep(0.05)
    task.cancel()  # killed: its leases stay in the store
    with pytest.raises(asyncio.CancelledError):
        await task
    assert hung and store_a.get_batch(batch.id).status == "in_progress"

    store_b = SqliteBatchStore(db_path)  # a new process on the same file
    engine_b = FakeEngine()
    dispatcher_b = BatchDispatcher(store_b, engine_b, batch_settings((8, 8), lease_s=lease_s, poll_interval_s=0.01))
    assert await dispatcher_b.step() <= 60 - 20 - len(hung)  # hung lines are not claimable yet
    await asyncio.sleep(lease_s + 0.1)
    await dispatcher_b.run_until_idle()
    final = store_b.get_batch(batch.id)
    assert final.status == "completed" and final.request_counts.completed == 60
    ids = output_ids(store_b, batch.id)
    assert len(ids) == 60 and len(set(ids)) == 60
    rerun = {f"req-{line_no - 1}" for _, line_no in engine_b.executions}
    assert set(hung) <= rerun  # the dead worker's lines ran again
    store_a.close()
    store_b.close()


async def test_two_dispatchers_never_run_the_same_line_concurrently(db_path):
    setup = SqliteBatchStore(db_path)
    batch = make_batch(setup, 150)
    engine = FakeEngine(delay_s=(0.001, 0.01))  # shared: sees both dispatchers' executions
    stores = [SqliteBatchStore(db_path), SqliteBatchStore(db_path)]
    dispatchers = [BatchDispatcher(s, engine, batch_settings((16, 16), poll_interval_s=0.01))
                   for s in stores]
    await asyncio.gather(*(d.run_until_idle() for d in dispatchers))
    assert not engine.overlaps
    assert len(engine.executions) == 150 and len(set(engine.executions)) == 150
    assert all(d.stats.completed > 0 for d in dispatchers)
    assert setup.get_batch(batch.id).status == "completed"
    assert sorted(output_ids(setup, batch.id)) == sorted(f"req-{i}" for i in range(150))
    for s in stores + [setup]:
        s.close()


async def test_client_errors_fail_at_once_and_transient_errors_retry_then_fail(db_path):
    store = SqliteBatchStore(db_path)
    batch = make_batch(store, 4)
    calls: dict[str, int] = {}

    async def execute(line: ClaimedLine) -> dict:
        calls[line.custom_id] = calls.get(line.custom_id, 0) + 1
        if line.custom_id == "req-0":
            return {"status_code": 400, "body": {"error": {"message": "bad prompt", "code": "invalid_prompt"}}}
        if line.custom_id == "req-1":
            return {"status_code": 503, "body": {"error": {"message": "overloaded", "type": "server_error"}}}
        if line.custom_id == "req-2" and calls["req-2"] == 1:
            raise ConnectionError("replica died")
        return ok(line)

    dispatcher = BatchDispatcher(store, execute, batch_settings(max_attempts=3, poll_interval_s=0.01))
    await dispatcher.run_until_idle()
    assert calls == {"req-0": 1, "req-1": 3, "req-2": 2, "req-3": 1}
    lines = {line.custom_id: line for line in store.get_lines(batch.id)}
    assert lines["req-0"].state == LINE_FAILED and lines["req-0"].error["code"] == "invalid_prompt"
    assert lines["req-1"].state == LINE_FAILED and lines["req-1"].attempts == 3
    assert lines["req-1"].error == {"code": "server_error", "message": "overloaded"}
    final = store.get_batch(batch.id)
    assert (final.status, final.request_counts.completed, final.request_counts.failed) == ("completed", 2, 2)
    errors = [json.loads(x) for x in store.file_content(final.error_file_id).splitlines()]
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("req-0", 400), ("req-1", 503)]
    assert dispatcher.stats.retried == 3
    store.close()


async def test_run_stops_cleanly_and_resumes_later(db_path):
    store = SqliteBatchStore(db_path)
    batch = make_batch(store, 30)
    engine = FakeEngine(delay_s=(0.01, 0.02))
    dispatcher = BatchDispatcher(store, engine, batch_settings((4, 4), poll_interval_s=0.01))
    task = asyncio.create_task(dispatcher.run())
    while len(engine.executions) < 5:
        await asyncio.sleep(0.005)
    dispatcher.stop()
    await asyncio.wait_for(task, 5)
    assert dispatcher.in_flight == 0
    recorded = store.get_batch(batch.id).request_counts.completed
    assert 5 <= recorded < 30 and store.backlog_stats().leased_lines == 0  # nothing left leased
    # A fresh dispatcher finishes the rest with no lease wait.
    await BatchDispatcher(store, engine, batch_settings(poll_interval_s=0.01)).run_until_idle()
    assert store.get_batch(batch.id).status == "completed" and len(engine.executions) == 30
    store.close()


async def test_shutdown_releases_the_leases_of_lines_still_running_after_the_grace(db_path):
    lease_s = 60  # long: a released line is claimable at once, an expired one only after this
    store = SqliteBatchStore(db_path)
    batch = make_batch(store, 12)
    hanging = asyncio.Event()

    async def finish_the_first_four_then_hang(line: ClaimedLine) -> dict:
        if line.line_no <= 4:
            return ok(line)
        hanging.set()
        await asyncio.Event().wait()  # a stream that outlives the replica's shutdown time
        raise AssertionError("unreachable")

    dispatcher = BatchDispatcher(store, finish_the_first_four_then_hang,
                                 batch_settings((6, 6), lease_s=lease_s, poll_interval_s=0.01))
    task = asyncio.create_task(dispatcher.run())
    await asyncio.wait_for(hanging.wait(), 5)
    await asyncio.sleep(0.05)
    leased = store.backlog_stats().leased_lines
    released = await dispatcher.shutdown(task, grace_s=0.2)
    assert task.done() and dispatcher.in_flight == 0
    assert leased > 0 and len(released) == leased and store.backlog_stats().leased_lines == 0
    # Another dispatcher claims the released lines at once (no lease_s wait) and finishes the batch exactly once.
    engine = FakeEngine()
    await BatchDispatcher(store, engine, batch_settings((6, 6), lease_s=lease_s, poll_interval_s=0.01)
                          ).run_until_idle(max_wait_s=5)
    assert {line_no for _, line_no in released} <= {line_no for _, line_no in engine.executions}
    final = store.get_batch(batch.id)
    assert final.status == "completed" and final.request_counts.completed == 12
    ids = output_ids(store, batch.id)
    assert len(ids) == 12 and len(set(ids)) == 12
    store.close()


async def test_shutdown_within_the_grace_releases_nothing(db_path):
    store = SqliteBatchStore(db_path)
    make_batch(store, 8)
    engine = FakeEngine(delay_s=(0.01, 0.02))
    dispatcher = BatchDispatcher(store, engine, batch_settings((4, 4), poll_interval_s=0.01))
    task = asyncio.create_task(dispatcher.run())
    while not engine.executions:
        await asyncio.sleep(0.005)
    assert await dispatcher.shutdown(task, grace_s=5) == []  # the lines in flight were recorded
    assert store.backlog_stats().leased_lines == 0
    store.close()


async def test_lease_is_renewed_while_a_slow_line_runs(db_path):
    store = SqliteBatchStore(db_path)
    batch = make_batch(store, 1)
    other = SqliteBatchStore(db_path)

    async def slow(line: ClaimedLine) -> dict:
        await asyncio.sleep(0.6)  # three lease lengths
        return ok(line)

    dispatcher = BatchDispatcher(store, slow, batch_settings(lease_s=0.2, poll_interval_s=0.02), renew_interval_s=0.05)
    task = asyncio.create_task(dispatcher.run())
    for _ in range(10):
        await asyncio.sleep(0.06)
        assert other.claim_lines("intruder", 1, lease_s=1) == []
    await asyncio.sleep(0.1)
    dispatcher.stop()
    await asyncio.wait_for(task, 5)
    assert store.get_batch(batch.id).status == "completed"
    store.close()
    other.close()


async def test_restart_finalizes_batch_whose_lines_were_all_recorded(db_path):
    store = SqliteBatchStore(db_path)
    batch = make_batch(store, 2)
    for line in store.claim_lines("old", 2, lease_s=30):
        store.complete_line(batch.id, line.line_no, ok(line))  # the old process died before finalizing
    dispatcher = BatchDispatcher(store, FakeEngine(), batch_settings(poll_interval_s=0.01))
    task = asyncio.create_task(dispatcher.run())
    await asyncio.sleep(0.1)
    dispatcher.stop()
    await asyncio.wait_for(task, 5)
    assert store.get_batch(batch.id).status == "completed"
    store.close()


async def test_idle_dispatcher_claims_a_new_batch_when_notified_not_at_its_next_poll(db_path):
    store = SqliteBatchStore(db_path)
    engine = FakeEngine()
    # A poll interval far longer than the test: only the notification can start the lines in time.
    dispatcher = BatchDispatcher(store, engine, batch_settings((4, 4), poll_interval_s=60))
    loop = asyncio.create_task(dispatcher.run())
    await asyncio.sleep(0.05)  # the loop has found nothing and is waiting
    batch = make_batch(store, 3)
    dispatcher.notify_new_work()
    for _ in range(200):
        if len(engine.executions) == 3:
            break
        await asyncio.sleep(0.01)
    assert sorted(line_no for _, line_no in engine.executions) == [1, 2, 3]
    dispatcher.stop()
    await asyncio.wait_for(loop, 5)  # stop() also ends the idle wait at once
    assert store.get_batch(batch.id).request_counts.completed == 3
