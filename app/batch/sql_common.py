"""The SQL common to both batch-store backends: the schema, row mapping, and the base class with the backend hooks
(connection, placeholders, the writers' transaction, the claim query's locking clause)."""

from __future__ import annotations

import abc
import functools
import json
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from app.batch import openai_shapes as shapes
from app.batch.store import DEFAULT_TENANT, BatchRecord, BatchStore, RequestCounts
from app.config import RouterConfig


_SCHEMA = """
CREATE TABLE IF NOT EXISTS llm_lanes_files (
    id TEXT PRIMARY KEY,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    content {blob} NOT NULL,
    tenant TEXT NOT NULL DEFAULT 'default'
);
CREATE TABLE IF NOT EXISTS llm_lanes_batches (
    id TEXT PRIMARY KEY,
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_seq {float} NOT NULL,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL,
    in_progress_at BIGINT,
    finalizing_at BIGINT,
    completed_at BIGINT,
    failed_at BIGINT,
    expired_at BIGINT,
    cancelling_at BIGINT,
    cancelled_at BIGINT,
    output_file_id TEXT,
    error_file_id TEXT,
    total_count BIGINT NOT NULL DEFAULT 0,
    completed_count BIGINT NOT NULL DEFAULT 0,
    failed_count BIGINT NOT NULL DEFAULT 0,
    metadata TEXT,
    errors TEXT,
    tenant TEXT NOT NULL DEFAULT 'default'
);
CREATE INDEX IF NOT EXISTS llm_lanes_batches_status ON llm_lanes_batches (status);
CREATE INDEX IF NOT EXISTS llm_lanes_batches_order ON llm_lanes_batches (created_seq, id);
CREATE INDEX IF NOT EXISTS llm_lanes_batches_tenant ON llm_lanes_batches (tenant, created_seq, id);
CREATE TABLE IF NOT EXISTS llm_lanes_batch_lines (
    batch_id TEXT NOT NULL,
    line_no BIGINT NOT NULL,
    custom_id TEXT,
    body TEXT,
    state TEXT NOT NULL,
    lease_owner TEXT,
    lease_expires_at {float},
    attempts BIGINT NOT NULL DEFAULT 0,
    token_estimate BIGINT NOT NULL DEFAULT 0,
    result TEXT,
    error TEXT,
    PRIMARY KEY (batch_id, line_no)
);
CREATE INDEX IF NOT EXISTS llm_lanes_lines_state ON llm_lanes_batch_lines (state, batch_id);
CREATE TABLE IF NOT EXISTS llm_lanes_lora_adapters (
    id BIGINT PRIMARY KEY,
    name TEXT NOT NULL,
    path TEXT NOT NULL,
    state TEXT NOT NULL,
    reserved_at {float} NOT NULL,
    settled_at {float}
);
CREATE INDEX IF NOT EXISTS llm_lanes_lora_adapters_name ON llm_lanes_lora_adapters (name, state);
"""

# Tables that gained a tenant column: a database created before it gets the column, its rows the default tenant.
_TENANT_TABLES = ("llm_lanes_files", "llm_lanes_batches")

_BATCH_COLUMNS = (
    "id, input_file_id, endpoint, completion_window, status, created_at, expires_at, in_progress_at, finalizing_at, "
    "completed_at, failed_at, expired_at, cancelling_at, cancelled_at, output_file_id, error_file_id, total_count, "
    "completed_count, failed_count, metadata, errors"
)
_LINE_COLUMNS = "batch_id, line_no, custom_id, state, attempts, lease_owner, lease_expires_at, result, error"


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def _loads(value: Any) -> Any:
    return None if value is None else json.loads(value)


def tenant_clause(tenant: str | None, column: str = "tenant") -> tuple[str, tuple[str, ...]]:
    """SQL condition (and its parameter) keeping one tenant's rows; None (the app's own work) keeps every row."""
    return ("", ()) if tenant is None else (f" AND {column} = ?", (tenant,))


def _batch_from_row(row: Sequence[Any]) -> BatchRecord:
    (bid, input_file_id, endpoint, window, status, created_at, expires_at, in_progress_at, finalizing_at,
     completed_at, failed_at, expired_at, cancelling_at, cancelled_at, output_file_id, error_file_id, total,
     completed, failed, metadata, errors) = row
    return BatchRecord(
        id=bid, input_file_id=input_file_id, endpoint=endpoint, completion_window=window, status=status,
        created_at=int(created_at), expires_at=int(expires_at), in_progress_at=in_progress_at,
        finalizing_at=finalizing_at, completed_at=completed_at, failed_at=failed_at, expired_at=expired_at,
        cancelling_at=cancelling_at, cancelled_at=cancelled_at, output_file_id=output_file_id,
        error_file_id=error_file_id,
        request_counts=RequestCounts(int(total), int(completed), int(failed)),
        metadata=_loads(metadata), errors=_loads(errors),
    )


class SqlStoreBase(BatchStore):
    """What every SQL method stands on. Subclasses (the backends) provide the connection, the placeholder style, the
    transaction that serializes writers, and the claim query's locking clause.

    One connection per store object, guarded by a lock: methods are short, and separate processes/replicas each
    have their own store object (and connection), which is where the real concurrency is.
    """

    blob_type = "BLOB"
    float_type = "REAL"

    def __init__(self, clock: Callable[[], float] = time.time, estimate_tokens: shapes.TokenEstimator | None = None):
        """`estimate_tokens`: a line's token cost (the backlog unit); by default shapes.estimate_line_tokens with the
        schema's router.default_max_tokens as the completion length of a line that sets none."""
        self._clock = clock
        self._estimate_tokens = estimate_tokens or functools.partial(
            shapes.estimate_line_tokens, default_max_tokens=RouterConfig.model_fields["default_max_tokens"].default)
        self._lock = threading.Lock()
        # Which tenant gets the remainder of the next claim's fair shares (claim_lines).
        self._claim_turn = 0

    # --- backend hooks -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def _execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """Run one statement with '?' placeholders; returns a cursor (fetchall/fetchone/rowcount)."""

    @abc.abstractmethod
    def _executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None: ...

    @abc.abstractmethod
    @contextmanager
    def _write_transaction(self) -> Iterator[None]:
        """A transaction in which this writer's reads and writes are atomic with respect to other writers."""

    # Appended to the claim SELECT: Postgres locks the chosen rows and skips rows another claimer holds.
    claim_lock_clause = ""

    # A statement run first in the schema transaction so that processes starting together don't race on DDL.
    schema_lock_statement: str | None = None

    # A statement run first in a transaction that gives out adapter ids, where the write transaction alone does not
    # keep two writers from reading the same largest id (PostgreSQL's READ COMMITTED).
    adapter_lock_statement: str | None = None

    @abc.abstractmethod
    def _columns(self, table: str) -> set[str]:
        """The column names `table` has now."""

    def _create_schema(self) -> None:
        with self._lock, self._write_transaction():
            if self.schema_lock_statement:
                self._execute(self.schema_lock_statement)
            statements = [s for s in _SCHEMA.format(blob=self.blob_type, float=self.float_type).split(";")
                          if s.strip()]
            for statement in statements:
                if "llm_lanes_batches_tenant" not in statement:
                    self._execute(statement)
            for table in _TENANT_TABLES:
                if "tenant" not in self._columns(table):
                    self._execute(f"ALTER TABLE {table} ADD COLUMN tenant TEXT NOT NULL DEFAULT '{DEFAULT_TENANT}'")
            for statement in statements:
                if "llm_lanes_batches_tenant" in statement:
                    self._execute(statement)

    def _now(self) -> float:
        return self._clock()
