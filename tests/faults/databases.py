"""The databases a fault test runs its served gateway on: SQLite (the data folder's
file) and a fresh PostgreSQL database, as a pytest parameter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.support.databases import fresh_postgres_database

DATABASES = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
"""``params`` of a fixture that yields :func:`database`."""


@contextmanager
def database(kind: str) -> Iterator[str | None]:
    """None for SQLite (the gateway's own data folder), else a fresh PostgreSQL DSN."""
    if kind == "sqlite":
        yield None
        return
    with fresh_postgres_database() as dsn:
        yield dsn
