"""The batch lines in SQL: claims and leases (at-least-once execution) and the recording of each line's outcome
(exactly once), the lines of a batch, and the backlog over all running batches."""

from __future__ import annotations

from typing import Any, Sequence

from app.batch.sql_common import _LINE_COLUMNS, SqlStoreBase, _dumps, _loads, tenant_clause
from app.batch.store import (
    LINE_DONE, LINE_FAILED, LINE_LEASED, LINE_QUEUED, BacklogStats, ClaimedLine, LineRecord,
)


def fair_shares(n: int, tenants: list[str], turn: int) -> list[tuple[str, int]]:
    """n lines split between tenants as evenly as whole lines allow; the remainder goes to the tenants whose turn
    it is (the turn advances each claim, so with n below the tenant count every tenant still gets its claims)."""
    if not tenants or n <= 0:
        return []
    base, extra = divmod(n, len(tenants))
    start = turn % len(tenants)
    order = tenants[start:] + tenants[:start]
    return [(tenant, base + (1 if i < extra else 0)) for i, tenant in enumerate(order) if base or i < extra]


class SqlLineStore(SqlStoreBase):
    """Claims, leases and outcomes of lines; the files and batches they belong to are SqlBatchStore's."""

    def claim_lines(self, owner: str, n: int, lease_s: float) -> list[ClaimedLine]:
        """Lease up to n runnable lines (queued, or leased with a lease that ran out): the tenants with running
        batches share the n in turn (fair_shares), each tenant's oldest batch first; a share a tenant cannot fill
        goes to the others. One tenant's large batch does not hold back another's small one."""
        if n <= 0:
            return []
        with self._lock, self._write_transaction():
            now = self._now()
            expires = now + lease_s
            tenants = [row[0] for row in self._execute(
                "SELECT DISTINCT tenant FROM llm_lanes_batches WHERE status = 'in_progress' ORDER BY tenant"
            ).fetchall()]
            keys: list[tuple[str, int]] = []
            if len(tenants) > 1:
                self._claim_turn += 1
                for tenant, share in fair_shares(n, tenants, self._claim_turn):
                    keys += self._lease_runnable(share, tenant, owner, now, expires)
            keys += self._lease_runnable(n - len(keys), None, owner, now, expires)
            claimed = []
            for batch_id, line_no in keys:
                row = self._execute(
                    "SELECT l.custom_id, b.endpoint, l.body, l.attempts, l.token_estimate, b.tenant FROM "
                    "llm_lanes_batch_lines l JOIN llm_lanes_batches b ON b.id = l.batch_id WHERE l.batch_id = ? AND "
                    "l.line_no = ?",
                    (batch_id, int(line_no)),
                ).fetchone()
                claimed.append(ClaimedLine(batch_id, int(line_no), row[0], row[1], _loads(row[2]), int(row[3]),
                                           expires, int(row[4]), row[5]))
            return claimed

    def _lease_runnable(self, n: int, tenant: str | None, owner: str, now: float,
                        expires: float) -> list[tuple[str, int]]:
        """Lease up to n runnable lines (of `tenant`'s batches, or anyone's), oldest batch first; their keys."""
        if n <= 0:
            return []
        where, params = tenant_clause(tenant, "b.tenant")
        keys = self._execute(
            "SELECT l.batch_id, l.line_no FROM llm_lanes_batch_lines l JOIN llm_lanes_batches b ON b.id = "
            f"l.batch_id WHERE b.status = 'in_progress' AND (l.state = ? OR (l.state = ? AND "
            f"l.lease_expires_at < ?)){where} ORDER BY b.created_seq, l.batch_id, l.line_no LIMIT ?"
            + self.claim_lock_clause,
            (LINE_QUEUED, LINE_LEASED, now, *params, int(n)),
        ).fetchall()
        if keys:
            self._executemany(
                "UPDATE llm_lanes_batch_lines SET state = ?, lease_owner = ?, lease_expires_at = ?, "
                "attempts = attempts + 1 WHERE batch_id = ? AND line_no = ?",
                [(LINE_LEASED, owner, expires, k[0], int(k[1])) for k in keys],
            )
        return [(k[0], int(k[1])) for k in keys]

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
