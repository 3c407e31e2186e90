"""Batch-store backends for contract tests: SQLite always, PostgreSQL when LLM_LANES_TEST_POSTGRES_URL is set.

CI gets the URL from `eval "$(.ci/postgres.sh)"` (a real server from Debian's packages on loopback). Each test gets
its own PostgreSQL schema (via the connection's search_path) so tests never see each other's rows.

Use: `from tests.batch_store_backends import store_factory  # noqa: F401` in a test module, then ask for the
`store_factory` fixture: calling it opens a new store object (own connection) on the test's database, which is
what restart and concurrent-claimer tests need.
"""

from __future__ import annotations

import os
import secrets
import urllib.parse
from typing import Any, Callable

import pytest

from app.batch.store import BatchStore

POSTGRES_URL_ENV = "LLM_LANES_TEST_POSTGRES_URL"
POSTGRES_SKIP_REASON = (
    f"{POSTGRES_URL_ENV} is not set: PostgreSQL contract tests need a server "
    '(run `eval "$(.ci/postgres.sh)"` as root to install and start one)'
)

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres",
                 marks=pytest.mark.skipif(not os.environ.get(POSTGRES_URL_ENV), reason=POSTGRES_SKIP_REASON)),
]


def _with_search_path(url: str, schema: str) -> str:
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query)
    query.append(("options", f"-c search_path={schema}"))
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query, quote_via=urllib.parse.quote)))


@pytest.fixture(params=BACKENDS)
def store_factory(request, tmp_path) -> Callable[..., BatchStore]:
    opened: list[BatchStore] = []
    cleanup: Callable[[], None] = lambda: None
    if request.param == "sqlite":
        location = str(tmp_path / "batches.sqlite3")

        def open_store(**kwargs: Any) -> BatchStore:
            from app.batch.sqlite_store import SqliteBatchStore

            store = SqliteBatchStore(location, **kwargs)
            opened.append(store)
            return store
    else:
        import psycopg

        from app.batch.postgres_store import PostgresBatchStore

        base_url = os.environ[POSTGRES_URL_ENV]
        schema = "test_" + secrets.token_hex(6)
        with psycopg.connect(base_url, autocommit=True) as admin:
            admin.execute(f"CREATE SCHEMA {schema}")
        location = _with_search_path(base_url, schema)

        def open_store(**kwargs: Any) -> BatchStore:
            store = PostgresBatchStore(location, **kwargs)
            opened.append(store)
            return store

        def cleanup() -> None:
            with psycopg.connect(base_url, autocommit=True) as admin:
                admin.execute(f"DROP SCHEMA {schema} CASCADE")

    open_store.location = location  # type: ignore[attr-defined]
    open_store.backend = request.param  # type: ignore[attr-defined]
    yield open_store
    for store in opened:
        try:
            store.close()
        except Exception:
            pass
    cleanup()
