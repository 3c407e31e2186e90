"""Contract tests of the durable batch store, run against every backend (see tests/batch_store_backends.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from app.batch.open_store import open_batch_store
from app.batch.store import (
    LINE_CANCELLED, LINE_DONE, LINE_FAILED, LINE_LEASED, LINE_QUEUED, ConflictError, InvalidRequestError,
    NotFoundError,
)
from tests.batch_store_backends import store_factory  # noqa: F401  (fixture)
from tests.fakes import FakeClock

ENDPOINT = "/v1/chat/completions"
WINDOW = "24h"


def chat_line(custom_id: str, text: str = "hello", max_tokens: int = 16) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                       "body": {"model": "tiny", "messages": [{"role": "user", "content": text}],
                                "max_tokens": max_tokens}})


def jsonl_bytes(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def make_batch(store, n: int, **kwargs):
    content = jsonl_bytes([chat_line(f"req-{i}") for i in range(n)])
    input_file = store.create_file("batch", "input.jsonl", content)
    return store.create_batch(input_file.id, ENDPOINT, **{"completion_window": WINDOW, **kwargs})


def ok_result(custom_id: str) -> dict:
    return {"status_code": 200, "request_id": f"rid-{custom_id}",
            "body": {"id": f"chatcmpl-{custom_id}", "object": "chat.completion", "choices": [],
                     "usage": {"completion_tokens": 3}}}


def read_jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def test_files_round_trip_and_unknown_ids(store_factory):
    store = store_factory()
    record = store.create_file("batch", "in.jsonl", b"abc\n")
    assert record.id.startswith("file-") and record.bytes == 4 and record.purpose == "batch"
    assert store.get_file(record.id) == record
    assert store.file_content(record.id) == b"abc\n"
    with pytest.raises(NotFoundError):
        store.get_file("file-nope")
    with pytest.raises(NotFoundError):
        store.file_content("file-nope")
    with pytest.raises(NotFoundError):
        store.get_batch("batch_nope")
    with pytest.raises(NotFoundError) as missing:
        store.create_batch("file-nope", ENDPOINT, WINDOW)
    assert missing.value.param == "input_file_id"


def test_files_are_listed_newest_first_and_deleted(store_factory):
    store = store_factory()
    first = store.create_file("batch", "a.jsonl", b"a\n")
    second = store.create_file("batch", "b.jsonl", b"b\n")
    listed = store.list_files().data
    assert {r.id for r in listed} == {first.id, second.id}
    assert [r.created_at for r in listed] == sorted((r.created_at for r in listed), reverse=True)
    assert store.list_files(purpose="batch_output").data == []
    store.delete_file(first.id)
    assert [r.id for r in store.list_files().data] == [second.id]
    with pytest.raises(NotFoundError):
        store.get_file(first.id)
    with pytest.raises(NotFoundError):
        store.delete_file(first.id)


def test_files_are_listed_a_page_at_a_time_in_either_order(store_factory):
    store = store_factory()
    ids = [store.create_file("batch", f"{i}.jsonl", b"a\n").id for i in range(5)]
    for order in ("desc", "asc"):
        seen, after, pages = [], None, 0
        while True:
            page = store.list_files(limit=2, after=after, order=order)
            seen += [r.id for r in page.data]
            pages += 1
            if not page.has_more:
                break
            after = page.data[-1].id
        assert sorted(seen) == sorted(ids) and len(seen) == 5 and pages == 3
        created = [store.get_file(i).created_at for i in seen]
        assert created == sorted(created, reverse=order == "desc")
    with pytest.raises(NotFoundError) as unknown:
        store.list_files(after="file-nope")
    assert unknown.value.param == "after"


def test_create_batch_rejects_bad_arguments(store_factory):
    store = store_factory()
    good = store.create_file("batch", "in.jsonl", jsonl_bytes([chat_line("a")]))
    with pytest.raises(InvalidRequestError, match="endpoint") as refused:
        store.create_batch(good.id, "/v1/embeddings", WINDOW)
    assert refused.value.param == "endpoint"
    with pytest.raises(InvalidRequestError, match="completion_window") as refused:
        store.create_batch(good.id, ENDPOINT, completion_window="soon")
    assert refused.value.param == "completion_window"
    other = store.create_file("assistants", "x.jsonl", jsonl_bytes([chat_line("a")]))
    with pytest.raises(InvalidRequestError, match="purpose") as refused:
        store.create_batch(other.id, ENDPOINT, WINDOW)
    assert refused.value.param == "input_file_id"


def test_create_batch_queues_valid_lines_and_fails_bad_ones(store_factory):
    clock = FakeClock(now=1_700_000_000.0)
    store = store_factory(clock=clock)
    lines = [
        chat_line("a"),
        "{not json",
        json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "tiny", "prompt": "x"}}),
        json.dumps({"custom_id": "no-model", "method": "POST", "url": ENDPOINT, "body": {"messages": []}}),
        "",
        chat_line("a"),  # duplicate custom_id
        chat_line("b"),
    ]
    input_file = store.create_file("batch", "in.jsonl", jsonl_bytes(lines))
    batch = store.create_batch(input_file.id, ENDPOINT, WINDOW, metadata={"job": "t1"})
    assert batch.id.startswith("batch_")
    assert batch.status == "in_progress"
    assert batch.created_at == int(clock.now) and batch.expires_at == int(clock.now) + 24 * 3600
    assert batch.request_counts.total == 6 and batch.request_counts.failed == 4
    assert batch.metadata == {"job": "t1"}
    states = {line.line_no: (line.custom_id, line.state) for line in store.get_lines(batch.id)}
    assert states == {1: ("a", LINE_QUEUED), 2: (None, LINE_FAILED), 3: ("wrong-url", LINE_FAILED),
                      4: ("no-model", LINE_FAILED), 6: ("a", LINE_FAILED), 7: ("b", LINE_QUEUED)}
    errors = {line.line_no: line.error["code"] for line in store.get_lines(batch.id) if line.error}
    assert errors == {2: "invalid_json", 3: "invalid_url", 4: "missing_model", 6: "duplicate_custom_id"}


def test_full_lifecycle_writes_openai_output_and_error_files(store_factory):
    clock = FakeClock(now=1_700_000_000.0)
    store = store_factory(clock=clock)
    input_file = store.create_file("batch", "in.jsonl", jsonl_bytes([chat_line("a"), "oops", chat_line("b"),
                                                                     chat_line("c")]))
    batch = store.create_batch(input_file.id, ENDPOINT, WINDOW)
    claimed = store.claim_lines("w1", 10, lease_s=30)
    assert [c.custom_id for c in claimed] == ["a", "b", "c"]
    assert all(c.attempts == 1 and c.url == ENDPOINT and c.body["model"] == "tiny" for c in claimed)
    assert store.finalize_batch(batch.id) is None  # lines still leased
    assert store.complete_line(batch.id, claimed[0].line_no, ok_result("a"))
    assert store.fail_line(batch.id, claimed[1].line_no, {"code": "invalid_request_error", "message": "bad"},
                           {"status_code": 400, "body": {"error": {"message": "bad"}}})
    assert store.get_batch(batch.id).request_counts.completed == 1
    assert store.complete_line(batch.id, claimed[2].line_no, ok_result("c"))
    clock.advance(5)
    final = store.finalize_batch(batch.id)
    assert final is not None and final.status == "completed"
    assert final.completed_at == int(clock.now) and final.finalizing_at == int(clock.now)
    assert (final.request_counts.total, final.request_counts.completed, final.request_counts.failed) == (4, 2, 2)
    output = read_jsonl(store.file_content(final.output_file_id))
    assert [o["custom_id"] for o in output] == ["a", "c"]
    assert output[0]["response"] == {"status_code": 200, "request_id": "rid-a", "body": ok_result("a")["body"]}
    assert output[0]["error"] is None and output[0]["id"].startswith("batch_req_")
    errors = read_jsonl(store.file_content(final.error_file_id))
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(None, "invalid_json"),
                                                                       ("b", "invalid_request_error")]
    assert errors[0]["response"] is None
    assert errors[1]["response"]["status_code"] == 400
    assert store.get_file(final.output_file_id).purpose == "batch_output"
    # Finalizing again changes nothing.
    assert store.finalize_batch(batch.id) is None
    assert store.get_batch(batch.id).output_file_id == final.output_file_id


def test_all_lines_invalid_completes_at_once_with_error_file(store_factory):
    store = store_factory()
    input_file = store.create_file("batch", "in.jsonl", b"nope\n[1]\n")
    batch = store.create_batch(input_file.id, ENDPOINT, WINDOW)
    assert batch.status == "completed"
    assert batch.output_file_id is None and batch.error_file_id is not None
    assert batch.request_counts.failed == 2


def test_empty_file_fails_the_batch(store_factory):
    store = store_factory()
    input_file = store.create_file("batch", "in.jsonl", b"\n\n")
    batch = store.create_batch(input_file.id, ENDPOINT, WINDOW)
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors[0]["code"] == "empty_file"
    with pytest.raises(ConflictError):
        store.cancel_batch(batch.id)


def test_completion_is_recorded_exactly_once(store_factory):
    store = store_factory()
    batch = make_batch(store, 1)
    [line] = store.claim_lines("w1", 1, lease_s=30)
    assert store.complete_line(batch.id, line.line_no, ok_result("first")) is True
    assert store.complete_line(batch.id, line.line_no, ok_result("second")) is False
    assert store.fail_line(batch.id, line.line_no, {"code": "x", "message": "late"}) is False
    [record] = store.get_lines(batch.id)
    assert record.state == LINE_DONE and record.result["request_id"] == "rid-first"
    assert store.get_batch(batch.id).request_counts.completed == 1
    assert store.get_batch(batch.id).request_counts.failed == 0


def test_lease_expiry_requeues_and_first_recording_wins(store_factory):
    clock = FakeClock(now=1_700_000_000.0)
    store = store_factory(clock=clock)
    batch = make_batch(store, 2)
    first = store.claim_lines("dead-worker", 2, lease_s=10)
    assert len(first) == 2
    assert store.claim_lines("w2", 5, lease_s=10) == []  # leases alive: nothing to claim
    clock.advance(5)
    assert store.renew_leases("dead-worker", [(batch.id, first[0].line_no)], lease_s=10) == 1
    clock.advance(6)  # line 2's lease ran out, line 1's was renewed
    again = store.claim_lines("w2", 5, lease_s=10)
    assert [(c.line_no, c.attempts) for c in again] == [(first[1].line_no, 2)]
    # The old owner can no longer renew or release the line it lost.
    assert store.renew_leases("dead-worker", [(batch.id, first[1].line_no)], lease_s=10) == 0
    assert store.release_line(batch.id, first[1].line_no, "dead-worker") is False
    assert store.complete_line(batch.id, again[0].line_no, ok_result("w2"))
    # The slow first run finishing later records nothing.
    assert store.complete_line(batch.id, first[1].line_no, ok_result("late")) is False
    assert [r.result["request_id"] for r in store.get_lines(batch.id) if r.state == LINE_DONE] == ["rid-w2"]


def test_release_line_requeues_for_retry(store_factory):
    store = store_factory()
    batch = make_batch(store, 1)
    [line] = store.claim_lines("w1", 1, lease_s=30)
    assert store.release_line(batch.id, line.line_no, "w1") is True
    [again] = store.claim_lines("w2", 1, lease_s=30)
    assert again.line_no == line.line_no and again.attempts == 2


def test_cancel_stops_queued_lines_and_lets_in_flight_finish(store_factory):
    clock = FakeClock(now=1_700_000_000.0)
    store = store_factory(clock=clock)
    batch = make_batch(store, 4)
    in_flight = store.claim_lines("w1", 2, lease_s=30)
    cancelling = store.cancel_batch(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at == int(clock.now)
    assert store.claim_lines("w2", 10, lease_s=30) == []
    assert store.cancel_batch(batch.id).status == "cancelling"  # cancelling twice is harmless
    store.complete_line(batch.id, in_flight[0].line_no, ok_result("x"))
    assert store.finalize_batch(batch.id) is None  # one line still in flight
    store.complete_line(batch.id, in_flight[1].line_no, ok_result("y"))
    final = store.finalize_batch(batch.id)
    assert final.status == "cancelled" and final.cancelled_at is not None
    assert final.request_counts.completed == 2 and final.request_counts.total == 4
    assert [line.state for line in store.get_lines(batch.id)].count(LINE_CANCELLED) == 2
    assert len(read_jsonl(store.file_content(final.output_file_id))) == 2
    assert store.cancel_batch(batch.id).status == "cancelled"


def test_cancel_with_dead_worker_settles_after_lease_expiry(store_factory):
    clock = FakeClock(now=1_700_000_000.0)
    store = store_factory(clock=clock)
    batch = make_batch(store, 2)
    store.claim_lines("dead", 1, lease_s=10)
    assert store.cancel_batch(batch.id).status == "cancelling"
    clock.advance(11)
    final = store.finalize_batch(batch.id)
    assert final.status == "cancelled" and final.output_file_id is None


def test_cancel_of_finished_batch_is_a_conflict(store_factory):
    store = store_factory()
    batch = make_batch(store, 1)
    [line] = store.claim_lines("w1", 1, lease_s=30)
    store.complete_line(batch.id, line.line_no, ok_result("a"))
    assert store.finalize_batch(batch.id).status == "completed"
    with pytest.raises(ConflictError):
        store.cancel_batch(batch.id)
    with pytest.raises(NotFoundError):
        store.cancel_batch("batch_missing")


def test_expired_batch_keeps_results_and_fails_the_rest(store_factory):
    clock = FakeClock(now=1_700_000_000.0)
    store = store_factory(clock=clock)
    batch = make_batch(store, 3, completion_window="1h")
    claimed = store.claim_lines("w1", 2, lease_s=30)
    store.complete_line(batch.id, claimed[0].line_no, ok_result("a"))
    assert store.expire_overdue_batches() == []
    clock.advance(3601)
    assert store.expire_overdue_batches() == [batch.id]
    final = store.get_batch(batch.id)
    assert final.status == "expired" and final.expired_at == int(clock.now)
    assert (final.request_counts.completed, final.request_counts.failed) == (1, 2)
    codes = [e["error"]["code"] for e in read_jsonl(store.file_content(final.error_file_id))]
    assert codes == ["batch_expired", "batch_expired"]
    assert store.complete_line(batch.id, claimed[1].line_no, ok_result("late")) is False


def test_list_batches_newest_first_with_pagination(store_factory):
    clock = FakeClock(now=1_700_000_000.0)
    store = store_factory(clock=clock)
    ids = []
    for _ in range(5):
        ids.append(make_batch(store, 1).id)
        clock.advance(0.001)  # same second, still ordered
    page = store.list_batches(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    page2 = store.list_batches(after=page.data[-1].id, limit=2)
    assert [b.id for b in page2.data] == ids[::-1][2:4] and page2.has_more
    page3 = store.list_batches(after=page2.data[-1].id, limit=2)
    assert [b.id for b in page3.data] == ids[:1] and not page3.has_more


def test_claim_order_is_oldest_batch_first(store_factory):
    clock = FakeClock(now=1_700_000_000.0)
    store = store_factory(clock=clock)
    older = make_batch(store, 2)
    clock.advance(1)
    newer = make_batch(store, 2)
    claimed = store.claim_lines("w1", 3, lease_s=30)
    assert [c.batch_id for c in claimed] == [older.id, older.id, newer.id]


def test_backlog_stats_counts_pending_lines_and_tokens(store_factory):
    store = store_factory()
    batch = make_batch(store, 3)
    stats = store.backlog_stats()
    assert (stats.queued_lines, stats.leased_lines, stats.active_batches) == (3, 0, 1)
    per_line = stats.queued_tokens // 3
    assert per_line >= 16 + 1  # max_tokens + at least one prompt token
    [line] = store.claim_lines("w1", 1, lease_s=30)
    stats = store.backlog_stats()
    assert (stats.queued_lines, stats.leased_lines, stats.pending_lines) == (2, 1, 3)
    assert stats.pending_tokens == 3 * per_line and stats.leased_tokens == line.token_estimate
    store.complete_line(batch.id, line.line_no, ok_result("a"))
    assert store.backlog_stats().pending_lines == 2


def test_restart_sees_everything(store_factory):
    clock = FakeClock(now=1_700_000_000.0)
    first = store_factory(clock=clock)
    batch = make_batch(first, 3)
    [done, leased] = first.claim_lines("old-process", 2, lease_s=10)
    first.complete_line(batch.id, done.line_no, ok_result("a"))
    first.close()
    second = store_factory(clock=clock)
    assert [b.id for b in second.list_active_batches()] == [batch.id]
    assert second.get_batch(batch.id).request_counts.completed == 1
    assert [line.state for line in second.get_lines(batch.id)] == [LINE_DONE, LINE_LEASED, LINE_QUEUED]
    clock.advance(11)
    reclaimed = second.claim_lines("new-process", 10, lease_s=10)
    assert sorted(c.line_no for c in reclaimed) == [leased.line_no, 3]
    for line in reclaimed:
        second.complete_line(batch.id, line.line_no, ok_result(line.custom_id))
    final = second.finalize_batch(batch.id)
    assert final.status == "completed"
    assert sorted(o["custom_id"] for o in read_jsonl(second.file_content(final.output_file_id))) == [
        "req-0", "req-1", "req-2"]
    assert second.list_active_batches() == []


def test_concurrent_claimers_never_share_a_line(store_factory):
    setup = store_factory()
    batch = make_batch(setup, 300)
    stores = [store_factory() for _ in range(4)]
    claims: dict[int, list[int]] = {i: [] for i in range(len(stores))}
    errors: list[BaseException] = []
    start = threading.Barrier(len(stores))

    def claimer(index: int) -> None:
        try:
            start.wait()
            while True:
                got = stores[index].claim_lines(f"w{index}", 7, lease_s=300)
                if not got:
                    return
                claims[index].extend(c.line_no for c in got)
                time.sleep(0.002)  # hand the GIL over, as dispatching the claimed lines would
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    all_claims = [n for lines in claims.values() for n in lines]
    assert len(all_claims) == 300 and len(set(all_claims)) == 300
    assert sum(1 for lines in claims.values() if lines) >= 2  # they really ran side by side
    assert all(line.state == LINE_LEASED for line in setup.get_lines(batch.id))


def test_open_batch_store_picks_backend_by_location(store_factory):
    store = open_batch_store(store_factory.location)
    try:
        expected = "SqliteBatchStore" if store_factory.backend == "sqlite" else "PostgresBatchStore"
        assert type(store).__name__ == expected
    finally:
        store.close()
