"""Durable batch store: the one interface (BatchStore) and the SQL logic both backends share.

Everything about a batch job lives in the database: the input file, the batch row, one row per input line with its
lease and result, and the output/error files. Any process (any Router replica, after any restart) can pick up where
another left off.

Concurrency contract, relied on by the dispatcher:
- claim_lines leases lines atomically: a line is handed to one claimer at a time; a lease that runs out makes the
  line claimable again (at-least-once execution).
- complete_line / fail_line record a line's outcome once: the first call wins and returns True, later ones are no-ops
  that return False (exactly-once recording), whoever holds the lease.
- finalize_batch builds the output files once, in one transaction.

Backends: app.batch.sqlite_store.SqliteBatchStore (file path, WAL) and app.batch.postgres_store.PostgresBatchStore
(URL). app.batch.open_store.open_batch_store(url_or_path) picks one.
"""

from __future__ import annotations

import abc
import functools
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from app.batch import openai_shapes as shapes
from app.config import RouterConfig

LINE_QUEUED = "queued"
LINE_LEASED = "leased"
LINE_DONE = "done"
LINE_FAILED = "failed"
# A line of a cancelled batch that never ran: in neither output file, counted in neither completed nor failed.
LINE_CANCELLED = "cancelled"

ACTIVE_BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
FINISHED_BATCH_STATUSES = shapes.TERMINAL_BATCH_STATUSES


class BatchStoreError(Exception):
    pass


class NotFoundError(BatchStoreError):
    """Unknown file or batch id (the API answers 404)."""


class ConflictError(BatchStoreError):
    """The batch is in a state that forbids the operation, e.g. cancelling a completed batch (409)."""


class InvalidRequestError(BatchStoreError):
    """Bad arguments: unsupported endpoint, wrong file purpose, bad completion window (400)."""


@dataclass(frozen=True)
class FileRecord:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int


@dataclass(frozen=True)
class RequestCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass(frozen=True)
class BatchRecord:
    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    request_counts: RequestCounts = field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class ClaimedLine:
    """A leased line handed to a dispatcher: run `body` against `url`, then complete or fail it."""

    batch_id: str
    line_no: int
    custom_id: str
    url: str
    body: dict[str, Any]
    attempts: int  # including the current one
    lease_expires_at: float
    token_estimate: int


@dataclass(frozen=True)
class LineRecord:
    batch_id: str
    line_no: int
    custom_id: str | None
    state: str
    attempts: int
    lease_owner: str | None
    lease_expires_at: float | None
    result: dict[str, Any] | None
    error: dict[str, Any] | None


@dataclass(frozen=True)
class BacklogStats:
    """Work not yet recorded, over all running batches: the cold lane's autoscaling signal."""

    queued_lines: int
    queued_tokens: int
    leased_lines: int
    leased_tokens: int
    active_batches: int

    @property
    def pending_lines(self) -> int:
        return self.queued_lines + self.leased_lines

    @property
    def pending_tokens(self) -> int:
        return self.queued_tokens + self.leased_tokens


@dataclass(frozen=True)
class BatchPage:
    data: list[BatchRecord]
    has_more: bool


class BatchStore(abc.ABC):
    """The durable batch store. All methods are synchronous and thread-safe; async callers use asyncio.to_thread."""

    # Files
    @abc.abstractmethod
    def create_file(self, purpose: str, filename: str, content: bytes) -> FileRecord: ...

    @abc.abstractmethod
    def get_file(self, file_id: str) -> FileRecord: ...

    @abc.abstractmethod
    def file_content(self, file_id: str) -> bytes: ...

    # Batches
    @abc.abstractmethod
    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str = "24h",
                     metadata: dict[str, str] | None = None) -> BatchRecord: ...

    @abc.abstractmethod
    def get_batch(self, batch_id: str) -> BatchRecord: ...

    @abc.abstractmethod
    def list_batches(self, after: str | None = None, limit: int = 20) -> BatchPage: ...

    @abc.abstractmethod
    def list_active_batches(self) -> list[BatchRecord]: ...

    @abc.abstractmethod
    def cancel_batch(self, batch_id: str) -> BatchRecord: ...

    @abc.abstractmethod
    def finalize_batch(self, batch_id: str) -> BatchRecord | None: ...

    @abc.abstractmethod
    def expire_overdue_batches(self) -> list[str]: ...

    # Lines
    @abc.abstractmethod
    def claim_lines(self, owner: str, n: int, lease_s: float) -> list[ClaimedLine]: ...

    @abc.abstractmethod
    def renew_leases(self, owner: str, keys: Sequence[tuple[str, int]], lease_s: float) -> int: ...

    @abc.abstractmethod
    def release_line(self, batch_id: str, line_no: int, owner: str) -> bool: ...

    @abc.abstractmethod
    def complete_line(self, batch_id: str, line_no: int, result: dict[str, Any]) -> bool: ...

    @abc.abstractmethod
    def fail_line(self, batch_id: str, line_no: int, error: dict[str, Any],
                  response: dict[str, Any] | None = None) -> bool: ...

    @abc.abstractmethod
    def get_lines(self, batch_id: str) -> list[LineRecord]: ...

    @abc.abstractmethod
    def backlog_stats(self) -> BacklogStats: ...

    @abc.abstractmethod
    def close(self) -> None: ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS llm_lanes_files (
    id TEXT PRIMARY KEY,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    content {blob} NOT NULL
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
    errors TEXT
);
CREATE INDEX IF NOT EXISTS llm_lanes_batches_status ON llm_lanes_batches (status);
CREATE INDEX IF NOT EXISTS llm_lanes_batches_order ON llm_lanes_batches (created_seq, id);
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
"""

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


class SqlBatchStore(BatchStore):
    """The store's logic in SQL common to SQLite and PostgreSQL. Subclasses provide the connection, the placeholder
    style, the transaction that serializes writers, and the claim query's locking clause.

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

    def _create_schema(self) -> None:
        with self._lock, self._write_transaction():
            if self.schema_lock_statement:
                self._execute(self.schema_lock_statement)
            for statement in _SCHEMA.format(blob=self.blob_type, float=self.float_type).split(";"):
                if statement.strip():
                    self._execute(statement)

    def _now(self) -> float:
        return self._clock()

    # --- files ---------------------------------------------------------------------------------------------------
    def _insert_file(self, purpose: str, filename: str, content: bytes, now: float) -> FileRecord:
        record = FileRecord(shapes.new_file_id(), purpose, filename, len(content), int(now))
        self._execute(
            "INSERT INTO llm_lanes_files (id, purpose, filename, bytes, created_at, content) VALUES (?, ?, ?, ?, ?, ?)",
            (record.id, purpose, filename, record.bytes, record.created_at, bytes(content)),
        )
        return record

    def create_file(self, purpose: str, filename: str, content: bytes) -> FileRecord:
        with self._lock, self._write_transaction():
            return self._insert_file(purpose, filename, content, self._now())

    def get_file(self, file_id: str) -> FileRecord:
        with self._lock:
            row = self._execute(
                "SELECT id, purpose, filename, bytes, created_at FROM llm_lanes_files WHERE id = ?", (file_id,)
            ).fetchone()
        if row is None:
            raise NotFoundError(f"No such file: {file_id}")
        return FileRecord(row[0], row[1], row[2], int(row[3]), int(row[4]))

    def file_content(self, file_id: str) -> bytes:
        with self._lock:
            row = self._execute("SELECT content FROM llm_lanes_files WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"No such file: {file_id}")
        return bytes(row[0])

    # --- batches -------------------------------------------------------------------------------------------------
    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str = "24h",
                     metadata: dict[str, str] | None = None) -> BatchRecord:
        try:
            shapes.check_endpoint(endpoint)
            window_s = shapes.completion_window_seconds(completion_window)
        except ValueError as error:
            raise InvalidRequestError(str(error)) from None
        input_file = self.get_file(input_file_id)
        if input_file.purpose != shapes.BATCH_FILE_PURPOSE:
            raise InvalidRequestError(
                f"file {input_file_id} has purpose {input_file.purpose!r}; a batch needs purpose 'batch'"
            )
        valid, rejected = shapes.parse_batch_file(self.file_content(input_file_id), endpoint)
        now = self._now()
        batch_id = shapes.new_batch_id()
        total = len(valid) + len(rejected)
        errors = None
        status, in_progress_at, failed_at = "in_progress", int(now), None
        if total == 0:
            # OpenAI fails a batch whose input has no requests at validation time.
            status, in_progress_at, failed_at = "failed", None, int(now)
            errors = [{"code": "empty_file", "message": "The input file has no requests.", "param": None,
                       "line": None}]
        line_rows = [
            (batch_id, p.line_no, p.custom_id, _dumps(p.body), LINE_QUEUED, int(self._estimate_tokens(p.body)), None)
            for p in valid
        ] + [
            (batch_id, r.line_no, r.custom_id, None, LINE_FAILED, 0, _dumps({"code": r.code, "message": r.message}))
            for r in rejected
        ]
        with self._lock, self._write_transaction():
            self._execute(
                "INSERT INTO llm_lanes_batches (id, input_file_id, endpoint, completion_window, status, created_seq, "
                "created_at, expires_at, in_progress_at, failed_at, total_count, failed_count, metadata, errors) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, input_file_id, endpoint, completion_window, status, now, int(now), int(now + window_s),
                 in_progress_at, failed_at, total, len(rejected), _dumps(metadata), _dumps(errors)),
            )
            if line_rows:
                self._executemany(
                    "INSERT INTO llm_lanes_batch_lines (batch_id, line_no, custom_id, body, state, token_estimate, "
                    "error) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    line_rows,
                )
        if status == "in_progress" and not valid:
            # Every line was rejected: nothing to dispatch, so write the error file now.
            self.finalize_batch(batch_id)
        return self.get_batch(batch_id)

    def _get_batch_unlocked(self, batch_id: str) -> BatchRecord:
        row = self._execute(f"SELECT {_BATCH_COLUMNS} FROM llm_lanes_batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"No such batch: {batch_id}")
        return _batch_from_row(row)

    def get_batch(self, batch_id: str) -> BatchRecord:
        with self._lock:
            return self._get_batch_unlocked(batch_id)

    def list_batches(self, after: str | None = None, limit: int = 20) -> BatchPage:
        """Newest first, like OpenAI; `after` is the last id of the previous page."""
        limit = max(1, min(int(limit), 100))
        with self._lock:
            if after is None:
                rows = self._execute(
                    f"SELECT {_BATCH_COLUMNS} FROM llm_lanes_batches ORDER BY created_seq DESC, id DESC LIMIT ?",
                    (limit + 1,),
                ).fetchall()
            else:
                cursor_row = self._execute(
                    "SELECT created_seq, id FROM llm_lanes_batches WHERE id = ?", (after,)
                ).fetchone()
                if cursor_row is None:
                    raise NotFoundError(f"No such batch: {after}")
                rows = self._execute(
                    f"SELECT {_BATCH_COLUMNS} FROM llm_lanes_batches WHERE created_seq < ? OR "
                    "(created_seq = ? AND id < ?) ORDER BY created_seq DESC, id DESC LIMIT ?",
                    (cursor_row[0], cursor_row[0], cursor_row[1], limit + 1),
                ).fetchall()
        return BatchPage([_batch_from_row(r) for r in rows[:limit]], has_more=len(rows) > limit)

    def list_active_batches(self) -> list[BatchRecord]:
        placeholders = ", ".join("?" for _ in ACTIVE_BATCH_STATUSES)
        with self._lock:
            rows = self._execute(
                f"SELECT {_BATCH_COLUMNS} FROM llm_lanes_batches WHERE status IN ({placeholders}) "
                "ORDER BY created_seq, id",
                ACTIVE_BATCH_STATUSES,
            ).fetchall()
        return [_batch_from_row(r) for r in rows]

    def cancel_batch(self, batch_id: str) -> BatchRecord:
        """Queued lines stop being claimable at once; in-flight lines may still record their result; the batch is
        'cancelling' until finalize_batch turns it 'cancelled'. Cancelling twice is harmless."""
        with self._lock, self._write_transaction():
            batch = self._get_batch_unlocked(batch_id)
            if batch.status in FINISHED_BATCH_STATUSES and batch.status != "cancelled":
                raise ConflictError(f"Batch {batch_id} is {batch.status} and cannot be cancelled.")
            if batch.status in ("in_progress", "validating"):
                now = int(self._now())
                # Conditional, so a concurrent finalize in another process cannot be overwritten.
                if self._execute(
                    "UPDATE llm_lanes_batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND "
                    "status IN ('in_progress', 'validating')",
                    (now, batch_id),
                ).rowcount != 1:
                    raise ConflictError(f"Batch {batch_id} finished while being cancelled.")
                self._execute(
                    "UPDATE llm_lanes_batch_lines SET state = ? WHERE batch_id = ? AND state = ?",
                    (LINE_CANCELLED, batch_id, LINE_QUEUED),
                )
        # With nothing in flight the batch can turn 'cancelled' right away.
        self.finalize_batch(batch_id)
        return self.get_batch(batch_id)

    def finalize_batch(self, batch_id: str) -> BatchRecord | None:
        """Write the output/error files and the final status once every line is settled; None if lines remain.
        Safe to call from several dispatchers at once: the status change is conditional, so one of them wins."""
        with self._lock:
            # Cheap read first: most calls happen while lines are still running.
            row = self._execute(
                "SELECT b.status, (SELECT COUNT(*) FROM llm_lanes_batch_lines l WHERE l.batch_id = b.id AND "
                "l.state IN (?, ?)) FROM llm_lanes_batches b WHERE b.id = ?",
                (LINE_QUEUED, LINE_LEASED, batch_id),
            ).fetchone()
            if row is None:
                raise NotFoundError(f"No such batch: {batch_id}")
            status, unsettled = row[0], int(row[1])
            if status not in ("in_progress", "cancelling"):
                return None
            now = self._now()
            if unsettled and status == "cancelling":
                # A dead worker's lines of a cancelled batch are not re-run: their lease running out settles them.
                with self._write_transaction():
                    self._execute(
                        "UPDATE llm_lanes_batch_lines SET state = ?, lease_owner = NULL WHERE batch_id = ? AND "
                        "state = ? AND lease_expires_at < ?",
                        (LINE_CANCELLED, batch_id, LINE_LEASED, now),
                    )
                unsettled = int(self._execute(
                    "SELECT COUNT(*) FROM llm_lanes_batch_lines WHERE batch_id = ? AND state IN (?, ?)",
                    (batch_id, LINE_QUEUED, LINE_LEASED),
                ).fetchone()[0])
            if unsettled:
                return None
            final_status = "cancelled" if status == "cancelling" else "completed"
            with self._write_transaction():
                claimed = self._execute(
                    "UPDATE llm_lanes_batches SET status = 'finalizing', finalizing_at = ? WHERE id = ? AND status = ?",
                    (int(now), batch_id, status),
                ).rowcount
                if claimed != 1:
                    return None  # another dispatcher finalized it first
                self._write_result_files(batch_id, final_status, now)
            return self._get_batch_unlocked(batch_id)

    def _write_result_files(self, batch_id: str, final_status: str, now: float) -> None:
        rows = self._execute(
            "SELECT line_no, custom_id, state, result, error FROM llm_lanes_batch_lines WHERE batch_id = ? AND "
            "state IN (?, ?) ORDER BY line_no",
            (batch_id, LINE_DONE, LINE_FAILED),
        ).fetchall()
        outputs, errors = [], []
        for line_no, custom_id, state, result, error in rows:
            result, error = _loads(result), _loads(error)
            line_id = f"batch_req_{batch_id.removeprefix('batch_')}_{line_no}"
            if state == LINE_DONE:
                outputs.append(shapes.output_line(custom_id, int(result.get("status_code", 200)), result.get("body"),
                                                  result.get("request_id"), line_id))
            else:
                response = result or {}
                errors.append(shapes.error_line(
                    custom_id, error.get("code", "request_failed"), error.get("message", ""),
                    status_code=response.get("status_code"), body=response.get("body"),
                    request_id=response.get("request_id"), line_id=line_id,
                ))
        output_file_id = error_file_id = None
        if outputs:
            output_file_id = self._insert_file(
                shapes.BATCH_OUTPUT_PURPOSE, f"{batch_id}_output.jsonl", shapes.jsonl(outputs), now).id
        if errors:
            error_file_id = self._insert_file(
                shapes.BATCH_OUTPUT_PURPOSE, f"{batch_id}_error.jsonl", shapes.jsonl(errors), now).id
        time_column = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[final_status]
        self._execute(
            f"UPDATE llm_lanes_batches SET status = ?, {time_column} = ?, output_file_id = ?, error_file_id = ?, "
            "completed_count = ?, failed_count = ? WHERE id = ?",
            (final_status, int(now), output_file_id, error_file_id, len(outputs), len(errors), batch_id),
        )

    def expire_overdue_batches(self) -> list[str]:
        """Batches past expires_at stop: unfinished lines fail with 'batch_expired', finished ones are kept in the
        output file, status 'expired' (OpenAI's behaviour). Returns the expired batch ids."""
        with self._lock:
            now = self._now()
            overdue = [r[0] for r in self._execute(
                "SELECT id FROM llm_lanes_batches WHERE status = 'in_progress' AND expires_at <= ?", (int(now),)
            ).fetchall()]
            expired = []
            for batch_id in overdue:
                with self._write_transaction():
                    if self._execute(
                        "UPDATE llm_lanes_batches SET status = 'finalizing', finalizing_at = ? WHERE id = ? AND "
                        "status = 'in_progress'", (int(now), batch_id),
                    ).rowcount != 1:
                        continue
                    self._execute(
                        "UPDATE llm_lanes_batch_lines SET state = ?, lease_owner = NULL, error = ? WHERE batch_id = ? "
                        "AND state IN (?, ?)",
                        (LINE_FAILED, _dumps({"code": "batch_expired",
                                              "message": "This request could not be executed before the completion "
                                                         "window expired."}),
                         batch_id, LINE_QUEUED, LINE_LEASED),
                    )
                    self._write_result_files(batch_id, "expired", now)
                expired.append(batch_id)
            return expired

    # --- lines ---------------------------------------------------------------------------------------------------
    def claim_lines(self, owner: str, n: int, lease_s: float) -> list[ClaimedLine]:
        """Lease up to n runnable lines (queued, or leased with a lease that ran out), oldest batch first."""
        if n <= 0:
            return []
        with self._lock, self._write_transaction():
            now = self._now()
            expires = now + lease_s
            keys = self._execute(
                "SELECT l.batch_id, l.line_no FROM llm_lanes_batch_lines l JOIN llm_lanes_batches b ON b.id = "
                "l.batch_id WHERE b.status = 'in_progress' AND (l.state = ? OR (l.state = ? AND "
                "l.lease_expires_at < ?)) ORDER BY b.created_seq, l.batch_id, l.line_no LIMIT ?"
                + self.claim_lock_clause,
                (LINE_QUEUED, LINE_LEASED, now, int(n)),
            ).fetchall()
            if not keys:
                return []
            self._executemany(
                "UPDATE llm_lanes_batch_lines SET state = ?, lease_owner = ?, lease_expires_at = ?, "
                "attempts = attempts + 1 WHERE batch_id = ? AND line_no = ?",
                [(LINE_LEASED, owner, expires, k[0], int(k[1])) for k in keys],
            )
            claimed = []
            for batch_id, line_no in keys:
                row = self._execute(
                    "SELECT l.custom_id, b.endpoint, l.body, l.attempts, l.token_estimate FROM llm_lanes_batch_lines "
                    "l JOIN llm_lanes_batches b ON b.id = l.batch_id WHERE l.batch_id = ? AND l.line_no = ?",
                    (batch_id, int(line_no)),
                ).fetchone()
                claimed.append(ClaimedLine(batch_id, int(line_no), row[0], row[1], _loads(row[2]), int(row[3]),
                                           expires, int(row[4])))
            return claimed

    def renew_leases(self, owner: str, keys: Sequence[tuple[str, int]], lease_s: float) -> int:
        """Extend the leases `owner` still holds; returns how many it still held."""
        if not keys:
            return 0
        with self._lock, self._write_transaction():
            expires = self._now() + lease_s
            renewed = 0
            for batch_id, line_no in keys:
                renewed += self._execute(
                    "UPDATE llm_lanes_batch_lines SET lease_expires_at = ? WHERE batch_id = ? AND line_no = ? AND "
                    "state = ? AND lease_owner = ?",
                    (expires, batch_id, int(line_no), LINE_LEASED, owner),
                ).rowcount
            return renewed

    def release_line(self, batch_id: str, line_no: int, owner: str) -> bool:
        """Give a leased line back to the queue (a transient failure that will be retried)."""
        with self._lock, self._write_transaction():
            return self._execute(
                "UPDATE llm_lanes_batch_lines SET state = ?, lease_owner = NULL, lease_expires_at = NULL WHERE "
                "batch_id = ? AND line_no = ? AND state = ? AND lease_owner = ?",
                (LINE_QUEUED, batch_id, int(line_no), LINE_LEASED, owner),
            ).rowcount == 1

    def _settle_line(self, batch_id: str, line_no: int, state: str, result: Any, error: Any) -> bool:
        counter = "completed_count" if state == LINE_DONE else "failed_count"
        with self._lock, self._write_transaction():
            # The state condition is the exactly-once guard: only the first outcome moves the line out of
            # queued/leased; any later one (a re-run after a lease ran out, a retry) changes nothing.
            changed = self._execute(
                "UPDATE llm_lanes_batch_lines SET state = ?, result = ?, error = ?, lease_owner = NULL WHERE "
                "batch_id = ? AND line_no = ? AND state IN (?, ?)",
                (state, _dumps(result), _dumps(error), batch_id, int(line_no), LINE_QUEUED, LINE_LEASED),
            ).rowcount
            if changed == 1:
                self._execute(f"UPDATE llm_lanes_batches SET {counter} = {counter} + 1 WHERE id = ?", (batch_id,))
            return changed == 1

    def complete_line(self, batch_id: str, line_no: int, result: dict[str, Any]) -> bool:
        """Record a response: result = {"status_code": int, "body": {...}, "request_id": str (optional)}."""
        return self._settle_line(batch_id, line_no, LINE_DONE, result, None)

    def fail_line(self, batch_id: str, line_no: int, error: dict[str, Any],
                  response: dict[str, Any] | None = None) -> bool:
        """Record a failure: error = {"code", "message"}; response (status_code/body) if the engine answered."""
        return self._settle_line(batch_id, line_no, LINE_FAILED, response, error)

    def get_lines(self, batch_id: str) -> list[LineRecord]:
        with self._lock:
            rows = self._execute(
                f"SELECT {_LINE_COLUMNS} FROM llm_lanes_batch_lines WHERE batch_id = ? ORDER BY line_no", (batch_id,)
            ).fetchall()
        return [LineRecord(r[0], int(r[1]), r[2], r[3], int(r[4]), r[5], r[6], _loads(r[7]), _loads(r[8]))
                for r in rows]

    def backlog_stats(self) -> BacklogStats:
        with self._lock:
            rows = self._execute(
                "SELECT l.state, COUNT(*), COALESCE(SUM(l.token_estimate), 0) FROM llm_lanes_batch_lines l JOIN "
                "llm_lanes_batches b ON b.id = l.batch_id WHERE b.status = 'in_progress' AND l.state IN (?, ?) "
                "GROUP BY l.state",
                (LINE_QUEUED, LINE_LEASED),
            ).fetchall()
            active = int(self._execute(
                "SELECT COUNT(*) FROM llm_lanes_batches WHERE status IN ('in_progress', 'cancelling')"
            ).fetchone()[0])
        by_state = {r[0]: (int(r[1]), int(r[2])) for r in rows}
        queued = by_state.get(LINE_QUEUED, (0, 0))
        leased = by_state.get(LINE_LEASED, (0, 0))
        return BacklogStats(queued[0], queued[1], leased[0], leased[1], active)
