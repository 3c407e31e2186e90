"""SqlBatchStore: the batch store's logic in SQL common to SQLite and PostgreSQL (the backends subclass it): files
and batches here, lines in app.batch.sql_lines, the schema and backend hooks in app.batch.sql_common."""

from __future__ import annotations

from app.batch import openai_shapes as shapes
from app.batch.sql_common import _BATCH_COLUMNS, _batch_from_row, _dumps, _loads, tenant_clause
from app.batch.sql_adapters import SqlAdapterStore
from app.batch.sql_lines import SqlLineStore
from app.batch.store import (
    ACTIVE_BATCH_STATUSES, FINISHED_BATCH_STATUSES, LINE_CANCELLED, LINE_DONE, LINE_FAILED, LINE_LEASED, LINE_QUEUED,
    DEFAULT_TENANT, BatchPage, BatchRecord, ConflictError, FilePage, FileRecord, InvalidRequestError, NotFoundError,
)


class SqlBatchStore(SqlLineStore, SqlAdapterStore):
    """The store's logic in SQL common to SQLite and PostgreSQL: files and batches here, lines in SqlLineStore, the
    backend hooks in SqlStoreBase (which the backends implement).

    Files and batches belong to a tenant. A method given `tenant` sees that tenant's rows only (another tenant's id
    is NotFoundError, as an unknown one); `tenant=None` is the app's own access (dispatcher, finalizing)."""

    # --- files ---------------------------------------------------------------------------------------------------
    def _insert_file(self, purpose: str, filename: str, content: bytes, now: float, tenant: str) -> FileRecord:
        record = FileRecord(shapes.new_file_id(), purpose, shapes.safe_filename(filename), len(content), int(now))
        self._execute(
            "INSERT INTO llm_lanes_files (id, purpose, filename, bytes, created_at, content, tenant) VALUES "
            "(?, ?, ?, ?, ?, ?, ?)",
            (record.id, purpose, record.filename, record.bytes, record.created_at, bytes(content), tenant),
        )
        return record

    def create_file(self, purpose: str, filename: str, content: bytes, tenant: str = DEFAULT_TENANT) -> FileRecord:
        with self._lock, self._write_transaction():
            return self._insert_file(purpose, filename, content, self._now(), tenant)

    def get_file(self, file_id: str, tenant: str | None = None) -> FileRecord:
        where, params = tenant_clause(tenant)
        with self._lock:
            row = self._execute(
                f"SELECT id, purpose, filename, bytes, created_at FROM llm_lanes_files WHERE id = ?{where}",
                (file_id, *params),
            ).fetchone()
        if row is None:
            raise NotFoundError(f"No such file: {file_id}")
        return FileRecord(row[0], row[1], row[2], int(row[3]), int(row[4]))

    def file_content(self, file_id: str, tenant: str | None = None) -> bytes:
        where, params = tenant_clause(tenant)
        with self._lock:
            row = self._execute(f"SELECT content FROM llm_lanes_files WHERE id = ?{where}",
                                (file_id, *params)).fetchone()
        if row is None:
            raise NotFoundError(f"No such file: {file_id}")
        return bytes(row[0])

    def list_files(self, purpose: str | None = None, limit: int = 10_000, tenant: str | None = None,
                   after: str | None = None, order: str = "desc") -> FilePage:
        limit = max(1, int(limit))
        tenant_where, tenant_params = tenant_clause(tenant)
        where, params = tenant_where, tenant_params
        if purpose is not None:
            where, params = where + " AND purpose = ?", (*params, purpose)
        direction, past = ("ASC", ">") if order == "asc" else ("DESC", "<")
        with self._lock:
            if after is not None:
                cursor_row = self._execute(f"SELECT created_at, id FROM llm_lanes_files WHERE id = ?{tenant_where}",
                                           (after, *tenant_params)).fetchone()
                if cursor_row is None:
                    raise NotFoundError(f"No such file: {after}", param="after")
                where += f" AND (created_at {past} ? OR (created_at = ? AND id {past} ?))"
                params = (*params, cursor_row[0], cursor_row[0], cursor_row[1])
            rows = self._execute(
                f"SELECT id, purpose, filename, bytes, created_at FROM llm_lanes_files WHERE 1 = 1{where} "
                f"ORDER BY created_at {direction}, id {direction} LIMIT ?", (*params, limit + 1)
            ).fetchall()
        return FilePage([FileRecord(r[0], r[1], r[2], int(r[3]), int(r[4])) for r in rows[:limit]],
                        has_more=len(rows) > limit)

    def delete_file(self, file_id: str, tenant: str | None = None) -> None:
        where, params = tenant_clause(tenant)
        with self._lock, self._write_transaction():
            deleted = self._execute(f"DELETE FROM llm_lanes_files WHERE id = ?{where}", (file_id, *params)).rowcount
        if not deleted:
            raise NotFoundError(f"No such file: {file_id}")

    # --- batches -------------------------------------------------------------------------------------------------
    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None = None, tenant: str = DEFAULT_TENANT) -> BatchRecord:
        try:
            shapes.check_endpoint(endpoint)
        except ValueError as error:
            raise InvalidRequestError(str(error), param="endpoint") from None
        try:
            window_s = shapes.completion_window_seconds(completion_window)
        except ValueError as error:
            raise InvalidRequestError(str(error), param="completion_window") from None
        try:
            input_file = self.get_file(input_file_id, tenant)
        except NotFoundError as error:
            raise NotFoundError(str(error), param="input_file_id") from None
        if input_file.purpose != shapes.BATCH_FILE_PURPOSE:
            raise InvalidRequestError(
                f"file {input_file_id} has purpose {input_file.purpose!r}; a batch needs purpose 'batch'",
                param="input_file_id")
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
                "created_at, expires_at, in_progress_at, failed_at, total_count, failed_count, metadata, errors, "
                "tenant) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (batch_id, input_file_id, endpoint, completion_window, status, now, int(now), int(now + window_s),
                 in_progress_at, failed_at, total, len(rejected), _dumps(metadata), _dumps(errors), tenant),
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
        return self.get_batch(batch_id, tenant)

    def _get_batch_unlocked(self, batch_id: str, tenant: str | None = None) -> BatchRecord:
        where, params = tenant_clause(tenant)
        row = self._execute(f"SELECT {_BATCH_COLUMNS} FROM llm_lanes_batches WHERE id = ?{where}",
                            (batch_id, *params)).fetchone()
        if row is None:
            raise NotFoundError(f"No such batch: {batch_id}")
        return _batch_from_row(row)

    def get_batch(self, batch_id: str, tenant: str | None = None) -> BatchRecord:
        with self._lock:
            return self._get_batch_unlocked(batch_id, tenant)

    def list_batches(self, after: str | None = None, limit: int = 20, tenant: str | None = None) -> BatchPage:
        """Newest first, like OpenAI; `after` is the last id of the previous page."""
        limit = max(1, min(int(limit), 100))
        where, params = tenant_clause(tenant)
        with self._lock:
            if after is None:
                rows = self._execute(
                    f"SELECT {_BATCH_COLUMNS} FROM llm_lanes_batches WHERE 1 = 1{where} ORDER BY created_seq DESC, "
                    "id DESC LIMIT ?",
                    (*params, limit + 1),
                ).fetchall()
            else:
                cursor_row = self._execute(
                    f"SELECT created_seq, id FROM llm_lanes_batches WHERE id = ?{where}", (after, *params)
                ).fetchone()
                if cursor_row is None:
                    raise NotFoundError(f"No such batch: {after}", param="after")
                rows = self._execute(
                    f"SELECT {_BATCH_COLUMNS} FROM llm_lanes_batches WHERE (created_seq < ? OR "
                    f"(created_seq = ? AND id < ?)){where} ORDER BY created_seq DESC, id DESC LIMIT ?",
                    (cursor_row[0], cursor_row[0], cursor_row[1], *params, limit + 1),
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

    def cancel_batch(self, batch_id: str, tenant: str | None = None) -> BatchRecord:
        """Queued lines stop being claimable at once; in-flight lines may still record their result; the batch is
        'cancelling' until finalize_batch turns it 'cancelled'. Cancelling twice is harmless."""
        with self._lock, self._write_transaction():
            batch = self._get_batch_unlocked(batch_id, tenant)
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
        return self.get_batch(batch_id, tenant)

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
        tenant = self._execute("SELECT tenant FROM llm_lanes_batches WHERE id = ?", (batch_id,)).fetchone()[0]
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
                shapes.BATCH_OUTPUT_PURPOSE, f"{batch_id}_output.jsonl", shapes.jsonl(outputs), now, tenant).id
        if errors:
            error_file_id = self._insert_file(
                shapes.BATCH_OUTPUT_PURPOSE, f"{batch_id}_error.jsonl", shapes.jsonl(errors), now, tenant).id
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
