"""SQLite backend of the batch store: one file, WAL journal, writers serialized with BEGIN IMMEDIATE.

Several processes on one host (Router replicas, a restarted app) may open the same file: BEGIN IMMEDIATE takes the
database's write lock before the claim's SELECT, so two claimers never see the same queued line; WAL lets readers
(status polls, downloads) run alongside the writer.
"""

from __future__ import annotations

import os
import sqlite3
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from app.batch.sql_store import SqlBatchStore

# How long a writer waits for another process's write lock before SQLite raises "database is locked".
BUSY_TIMEOUT_MS = 30_000


class SqliteBatchStore(SqlBatchStore):
    blob_type = "BLOB"
    float_type = "REAL"

    def __init__(self, path: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.path = path
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        # isolation_level=None: no implicit transactions; this class opens them explicitly.
        # check_same_thread=False: the store's own lock serializes use across threads (asyncio.to_thread callers).
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                     timeout=BUSY_TIMEOUT_MS / 1000)
        self._conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        self._conn.execute("PRAGMA journal_mode = WAL")
        # NORMAL is durable across application crashes in WAL mode (only an OS crash can lose the last commits).
        self._conn.execute("PRAGMA synchronous = NORMAL")
        self._create_schema()

    def _execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._conn.execute(sql, tuple(params))

    def _columns(self, table: str) -> set[str]:
        return {row[1] for row in self._conn.execute(f"PRAGMA table_info({table})").fetchall()}

    def _executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._conn.executemany(sql, [tuple(r) for r in rows])

    @contextmanager
    def _write_transaction(self) -> Iterator[None]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._conn.close()
