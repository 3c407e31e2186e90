"""Files and batches belong to a tenant, on every backend; claims share the cold lane between tenants."""

from __future__ import annotations

import sqlite3

import pytest

from app.batch.openai_shapes import safe_filename
from app.batch.sql_lines import fair_shares
from app.batch.store import DEFAULT_TENANT, NotFoundError
from tests.batch_store_backends import store_factory  # noqa: F401  (fixture)
from tests.unit.test_batch_store import ENDPOINT, WINDOW, chat_line, jsonl_bytes, ok_result


def batch_of(store, tenant: str, n: int):
    content = jsonl_bytes([chat_line(f"{tenant}-{i}") for i in range(n)])
    file = store.create_file("batch", "in.jsonl", content, tenant)
    return file, store.create_batch(file.id, ENDPOINT, WINDOW, None, tenant)


def test_another_tenant_sees_nothing_of_a_tenants_files_and_batches(store_factory):
    store = store_factory()
    file_a, batch_a = batch_of(store, "team-a", 2)
    file_b, batch_b = batch_of(store, "team-b", 1)
    assert store.get_file(file_a.id, "team-a") == file_a
    for call in (lambda: store.get_file(file_a.id, "team-b"), lambda: store.file_content(file_a.id, "team-b"),
                 lambda: store.get_batch(batch_a.id, "team-b"), lambda: store.cancel_batch(batch_a.id, "team-b"),
                 lambda: store.list_batches(after=batch_a.id, tenant="team-b"),
                 lambda: store.create_batch(file_a.id, ENDPOINT, WINDOW, None, "team-b")):
        with pytest.raises(NotFoundError):
            call()
    assert [b.id for b in store.list_batches(tenant="team-a").data] == [batch_a.id]
    assert [b.id for b in store.list_batches(tenant="team-b").data] == [batch_b.id]
    assert {b.id for b in store.list_batches().data} == {batch_a.id, batch_b.id}  # the app's own view
    assert store.get_batch(batch_a.id, "team-a").status == "in_progress"  # B's cancel did nothing


def test_output_files_belong_to_the_batchs_tenant(store_factory):
    store = store_factory()
    _, batch = batch_of(store, "team-a", 1)
    line = store.claim_lines("w", 1, 30)[0]
    assert line.tenant == "team-a"
    store.complete_line(line.batch_id, line.line_no, ok_result(line.custom_id))
    done = store.finalize_batch(batch.id)
    assert store.file_content(done.output_file_id, "team-a")
    with pytest.raises(NotFoundError):
        store.file_content(done.output_file_id, "team-b")


def test_claims_interleave_tenants_so_a_small_batch_is_not_held_behind_a_large_one(store_factory):
    store = store_factory()
    batch_of(store, "team-a", 40)  # first, and large
    batch_of(store, "team-b", 4)
    first = store.claim_lines("w", 8, 30)
    assert sorted(line.tenant for line in first) == ["team-a"] * 4 + ["team-b"] * 4
    # B has nothing left to claim: A gets the whole claim.
    assert {line.tenant for line in store.claim_lines("w", 8, 30)} == {"team-a"}


def test_a_single_line_claim_takes_turns_between_tenants(store_factory):
    store = store_factory()
    batch_of(store, "team-a", 10)
    batch_of(store, "team-b", 10)
    assert sorted(store.claim_lines("w", 1, 30)[0].tenant for _ in range(4)) == ["team-a"] * 2 + ["team-b"] * 2


def test_fair_shares():
    assert fair_shares(8, ["a", "b"], 0) == [("a", 4), ("b", 4)]
    assert fair_shares(5, ["a", "b", "c"], 1) == [("b", 2), ("c", 2), ("a", 1)]
    assert fair_shares(1, ["a", "b"], 1) == [("b", 1)]
    assert fair_shares(0, ["a"], 0) == [] and fair_shares(3, [], 0) == []


def test_a_database_from_before_tenants_gets_the_column_and_its_rows_the_default_tenant(tmp_path):
    from app.batch.sqlite_store import SqliteBatchStore

    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE llm_lanes_files (id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT "
                     "NULL, bytes BIGINT NOT NULL, created_at BIGINT NOT NULL, content BLOB NOT NULL)")
        conn.execute("INSERT INTO llm_lanes_files VALUES ('file-old', 'batch', 'in.jsonl', 3, 0, x'616263')")
    store = SqliteBatchStore(str(path))
    assert store.file_content("file-old", DEFAULT_TENANT) == b"abc"
    with pytest.raises(NotFoundError):
        store.get_file("file-old", "team-a")
    store.close()


@pytest.mark.parametrize("name, stored", [("../../etc/passwd", "passwd"), ("..\\..\\win.ini", "win.ini"),
                                          ("a\x00b\nc.jsonl", "abc.jsonl"), ("..", "file"), ("", "file"),
                                          ("in.jsonl", "in.jsonl"), ("x" * 300, "x" * 255)])
def test_filenames_are_stored_sanitised(name, stored):
    assert safe_filename(name) == stored


def test_the_dispatcher_finishes_a_small_batch_of_one_tenant_long_before_a_large_one_of_another(tmp_path):
    import asyncio

    from app.batch.dispatcher import BatchDispatcher
    from app.batch.sqlite_store import SqliteBatchStore
    from tests.unit.test_batch_dispatcher import FakeEngine, batch_settings

    store = SqliteBatchStore(str(tmp_path / "batches.sqlite3"))
    _, large = batch_of(store, "team-a", 200)
    _, small = batch_of(store, "team-b", 10)
    engine = FakeEngine(delay_s=(0.001, 0.002))
    dispatcher = BatchDispatcher(store, engine, batch_settings(window=(4, 4), poll_interval_s=0.01))
    asyncio.run(dispatcher.run_until_idle())
    done_at = {batch_id: max(i for i, (b, _) in enumerate(engine.executions) if b == batch_id)
               for batch_id in (large.id, small.id)}
    # B's 10 lines run in about the first 20 executions (half of each claim), not after A's 200.
    assert done_at[small.id] < 30 < done_at[large.id], done_at
    assert store.get_batch(small.id).status == store.get_batch(large.id).status == "completed"
    store.close()
