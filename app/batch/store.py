"""Durable batch store: the one interface (BatchStore) and the shapes it deals in (records, line states, errors).

Everything about a batch job lives in the database: the input file, the batch row, one row per input line with its
lease and result, and the output/error files. Any process (any Router replica, after any restart) can pick up where
another left off.

Concurrency contract, relied on by the dispatcher:
- claim_lines leases lines atomically: a line is handed to one claimer at a time; a lease that runs out makes the
  line claimable again (at-least-once execution).
- complete_line / fail_line record a line's outcome once: the first call wins and returns True, later ones are no-ops
  that return False (exactly-once recording), whoever holds the lease.
- finalize_batch builds the output files once, in one transaction.

The SQL both backends share: app.batch.sql_store.SqlBatchStore (files and batches) on app.batch.sql_lines (claims,
leases and line outcomes) on app.batch.sql_common (schema, row mapping, backend hooks). Backends:
app.batch.sqlite_store.SqliteBatchStore (file path, WAL) and app.batch.postgres_store.PostgresBatchStore (URL).
app.batch.open_store.open_batch_store(url_or_path) picks one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Sequence

from app.batch import openai_shapes as shapes

LINE_QUEUED = "queued"
LINE_LEASED = "leased"
LINE_DONE = "done"
LINE_FAILED = "failed"
# A line of a cancelled batch that never ran: in neither output file, counted in neither completed nor failed.
LINE_CANCELLED = "cancelled"

# The tenant of every file and batch when the app runs without keys, and of rows stored before tenants existed.
DEFAULT_TENANT = "default"

# A LoRA adapter loaded at run time (app.batch.sql_adapters): reserved while the lanes try it, then ready (served) or
# refused; unloaded when an admin unloads or replaces it. Its id is never given to another adapter.
ADAPTER_LOADING = "loading"
ADAPTER_READY = "ready"
ADAPTER_REFUSED = "refused"
ADAPTER_UNLOADED = "unloaded"

ACTIVE_BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
FINISHED_BATCH_STATUSES = shapes.TERMINAL_BATCH_STATUSES


class BatchStoreError(Exception):
    """`param`: the request field the error is about, where one is (the API names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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
    tenant: str = DEFAULT_TENANT


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
class AdapterRecord:
    """A LoRA adapter loaded at run time: `id` is the engines' adapter id (vLLM caches adapters by it)."""

    id: int
    name: str
    path: str
    state: str


@dataclass(frozen=True)
class BatchPage:
    data: list[BatchRecord]
    has_more: bool


@dataclass(frozen=True)
class FilePage:
    data: list[FileRecord]
    has_more: bool


class BatchStore(abc.ABC):
    """The durable batch store. All methods are synchronous and thread-safe; async callers use asyncio.to_thread."""

    # Files
    @abc.abstractmethod
    def create_file(self, purpose: str, filename: str, content: bytes, tenant: str = DEFAULT_TENANT) -> FileRecord:
        ...

    # `tenant`: only that tenant's rows exist for the call (another's id is NotFoundError); None: every row.
    @abc.abstractmethod
    def get_file(self, file_id: str, tenant: str | None = None) -> FileRecord: ...

    @abc.abstractmethod
    def file_content(self, file_id: str, tenant: str | None = None) -> bytes: ...

    @abc.abstractmethod
    def list_files(self, purpose: str | None = None, limit: int = 10_000, tenant: str | None = None,
                   after: str | None = None, order: str = "desc") -> FilePage:
        """Newest first (OpenAI's order; `order="asc"` oldest first), of one purpose if given; `after` is the last id
        of the previous page (NotFoundError naming `after` for an unknown one)."""

    @abc.abstractmethod
    def delete_file(self, file_id: str, tenant: str | None = None) -> None:
        """Remove a file (NotFoundError if there is none); batches that name it keep their own lines."""

    # Batches
    @abc.abstractmethod
    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None = None, tenant: str = DEFAULT_TENANT) -> BatchRecord: ...

    @abc.abstractmethod
    def get_batch(self, batch_id: str, tenant: str | None = None) -> BatchRecord: ...

    @abc.abstractmethod
    def list_batches(self, after: str | None = None, limit: int = 20, tenant: str | None = None) -> BatchPage: ...

    @abc.abstractmethod
    def list_active_batches(self) -> list[BatchRecord]: ...

    @abc.abstractmethod
    def cancel_batch(self, batch_id: str, tenant: str | None = None) -> BatchRecord: ...

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

    # LoRA adapters loaded at run time: every Router replica reads the same set, and a restart keeps it.
    @abc.abstractmethod
    def reserve_adapter(self, name: str, path: str, replace: bool, first_id: int,
                        stale_after_s: float) -> AdapterRecord:
        """A new id for adapter `name` at `path`, in state loading. InvalidRequestError when a ready adapter has the
        name and `replace` is false, ConflictError while another load of the name is under way (one reserved less
        than `stale_after_s` ago). Ids start at `first_id` and are never reused."""

    @abc.abstractmethod
    def settle_adapter(self, adapter_id: int, ready: bool) -> AdapterRecord:
        """A reserved adapter becomes ready (the one it replaces, if any, unloaded) or refused."""

    @abc.abstractmethod
    def unload_adapter(self, name: str) -> AdapterRecord:
        """The ready adapter `name` is unloaded (NotFoundError if there is none)."""

    @abc.abstractmethod
    def ready_adapters(self) -> list[AdapterRecord]:
        """The adapters served now, by id."""

    @abc.abstractmethod
    def close(self) -> None: ...

