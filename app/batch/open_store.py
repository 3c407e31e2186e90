"""open_batch_store: the batch store a serve config's `batch.store` names (a SQLite path or a PostgreSQL URL).

Its own module so that the interface (app.batch.store) and its two backends import in one direction only.
"""

from __future__ import annotations

from typing import Any

from app.batch.store import BatchStore
from app.config import is_postgres_url


def open_batch_store(location: str, **kwargs: Any) -> BatchStore:
    """A PostgreSQL URL (postgresql://...) opens PostgresBatchStore; anything else is a SQLite file path."""
    if is_postgres_url(location):
        # psycopg is imported only where a PostgreSQL store is used.
        from app.batch.postgres_store import PostgresBatchStore

        return PostgresBatchStore(location, **kwargs)
    from app.batch.sqlite_store import SqliteBatchStore

    return SqliteBatchStore(location, **kwargs)
