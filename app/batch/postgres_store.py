"""PostgreSQL backend of the batch store (psycopg 3), for Router replicas on several nodes.

Claims use SELECT ... FOR UPDATE SKIP LOCKED: concurrent claimers lock disjoint sets of lines without waiting on
each other, and a line locked by one claimer is invisible to the others until its lease is committed.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import psycopg

from app.batch.sql_store import SqlBatchStore

# Arbitrary constant key for pg_advisory_xact_lock: serializes schema creation between processes starting together.
SCHEMA_ADVISORY_LOCK_KEY = 0x6C6C6D6C616E6573  # "llmlanes"


def _to_pyformat(sql: str) -> str:
    # The shared SQL uses '?' placeholders (SQLite's style) and contains no literal '?' or '%'.
    return sql.replace("?", "%s")


class PostgresBatchStore(SqlBatchStore):
    blob_type = "BYTEA"
    float_type = "DOUBLE PRECISION"
    claim_lock_clause = " FOR UPDATE OF l SKIP LOCKED"
    schema_lock_statement = f"SELECT pg_advisory_xact_lock({SCHEMA_ADVISORY_LOCK_KEY})"
    adapter_lock_statement = "LOCK TABLE llm_lanes_lora_adapters IN SHARE ROW EXCLUSIVE MODE"

    def __init__(self, url: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.url = url
        # autocommit: single statements commit on their own; multi-statement work uses explicit transactions.
        self._conn = psycopg.connect(url, autocommit=True)
        self._create_schema()

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._conn.execute(_to_pyformat(sql), tuple(params))

    def _columns(self, table: str) -> set[str]:
        rows = self._conn.execute("SELECT column_name FROM information_schema.columns WHERE table_name = %s AND "
                                  "table_schema = current_schema()", (table,)).fetchall()
        return {row[0] for row in rows}

    def _executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self._conn.cursor() as cursor:
            cursor.executemany(_to_pyformat(sql), [tuple(r) for r in rows])

    @contextmanager
    def _write_transaction(self) -> Iterator[None]:
        with self._conn.transaction():
            yield

    def close(self) -> None:
        with self._lock:
            self._conn.close()
