"""Fixtures of the money tests: every ledger test runs over SQLite and PostgreSQL.

- ``db`` (per test): ``None`` (SQLite in the gateway's own data folder) or the DSN of
  a fresh PostgreSQL database, dropped after the test.
- ``module_db`` (per module): the same, for gateways shared by a module's tests
  (each test then works on its own account).

PostgreSQL follows the suite's availability rule (``tests.support.databases``):
skipped locally when unreachable, a failure under ``BOURSE_REQUIRE_SERVICES=1``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.databases import fresh_postgres_database

DB_PARAMS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
DB_IDS = ["sqlite", "postgres"]


def _database(kind: str) -> Iterator[str | None]:
    if kind == "sqlite":
        yield None
        return
    with fresh_postgres_database() as dsn:
        yield dsn


@pytest.fixture(params=DB_PARAMS, ids=DB_IDS)
def db(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """None for SQLite, else a fresh PostgreSQL DSN (one per test)."""
    yield from _database(request.param)


@pytest.fixture(scope="module", params=DB_PARAMS, ids=DB_IDS)
def module_db(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """None for SQLite, else a fresh PostgreSQL DSN (one per module)."""
    yield from _database(request.param)
