"""The LoRA adapters loaded at run time, in SQL: a table in the app's durable store, so every Router replica serves
the same set (each reads it every second), a restart keeps it, and an adapter id once given is never another
adapter's (the lanes' engines cache adapters by id)."""

from __future__ import annotations

from typing import Sequence

from app.batch.sql_common import SqlStoreBase
from app.batch.store import (
    ADAPTER_LOADING, ADAPTER_READY, ADAPTER_REFUSED, ADAPTER_UNLOADED, AdapterRecord, ConflictError,
    InvalidRequestError, NotFoundError,
)

_COLUMNS = "id, name, path, state"


def _record(row: Sequence) -> AdapterRecord:
    return AdapterRecord(int(row[0]), row[1], row[2], row[3])


class SqlAdapterStore(SqlStoreBase):
    """reserve_adapter -> (the lanes load it) -> settle_adapter; unload_adapter; ready_adapters (BatchStore's
    contract)."""

    def reserve_adapter(self, name: str, path: str, replace: bool, first_id: int,
                        stale_after_s: float) -> AdapterRecord:
        with self._lock, self._write_transaction():
            if self.adapter_lock_statement:
                self._execute(self.adapter_lock_statement)
            now = self._now()
            rows = self._execute(
                "SELECT state, reserved_at FROM llm_lanes_lora_adapters WHERE name = ? AND state IN (?, ?)",
                (name, ADAPTER_LOADING, ADAPTER_READY)).fetchall()
            # A load reserved longer ago than stale_after_s never settled (its Router stopped): it no longer blocks.
            if any(state == ADAPTER_LOADING and now - reserved_at < stale_after_s for state, reserved_at in rows):
                raise ConflictError(f"the lora adapter '{name}' is being loaded now: retry when that load has "
                                    "answered", param="lora_name")
            if not replace and any(state == ADAPTER_READY for state, _ in rows):
                raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded. If you want to load "
                                          "the adapter in place, set 'load_inplace' to True.", param="lora_name")
            largest = self._execute("SELECT MAX(id) FROM llm_lanes_lora_adapters").fetchone()[0]
            adapter_id = max(first_id, int(largest) + 1 if largest is not None else first_id)
            self._execute(
                "INSERT INTO llm_lanes_lora_adapters (id, name, path, state, reserved_at) VALUES (?, ?, ?, ?, ?)",
                (adapter_id, name, path, ADAPTER_LOADING, now))
            return AdapterRecord(adapter_id, name, path, ADAPTER_LOADING)

    def settle_adapter(self, adapter_id: int, ready: bool) -> AdapterRecord:
        with self._lock, self._write_transaction():
            row = self._execute(f"SELECT {_COLUMNS} FROM llm_lanes_lora_adapters WHERE id = ?",
                                (adapter_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"no adapter has id {adapter_id}")
            record = _record(row)
            now = self._now()
            if ready:
                # The adapter it replaces (load_inplace) stops being served in the same transaction.
                self._execute("UPDATE llm_lanes_lora_adapters SET state = ?, settled_at = ? WHERE name = ? AND "
                              "state = ? AND id <> ?", (ADAPTER_UNLOADED, now, record.name, ADAPTER_READY, adapter_id))
            state = ADAPTER_READY if ready else ADAPTER_REFUSED
            self._execute("UPDATE llm_lanes_lora_adapters SET state = ?, settled_at = ? WHERE id = ?",
                          (state, now, adapter_id))
            return AdapterRecord(record.id, record.name, record.path, state)

    def unload_adapter(self, name: str) -> AdapterRecord:
        with self._lock, self._write_transaction():
            row = self._execute(f"SELECT {_COLUMNS} FROM llm_lanes_lora_adapters WHERE name = ? AND state = ?",
                                (name, ADAPTER_READY)).fetchone()
            if row is None:
                raise NotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")
            self._execute("UPDATE llm_lanes_lora_adapters SET state = ?, settled_at = ? WHERE id = ?",
                          (ADAPTER_UNLOADED, self._now(), row[0]))
            return AdapterRecord(int(row[0]), row[1], row[2], ADAPTER_UNLOADED)

    def ready_adapters(self) -> list[AdapterRecord]:
        with self._lock:
            rows = self._execute(f"SELECT {_COLUMNS} FROM llm_lanes_lora_adapters WHERE state = ? ORDER BY id",
                                 (ADAPTER_READY,)).fetchall()
        return [_record(row) for row in rows]
