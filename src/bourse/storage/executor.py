"""What the store's SQL runs on: one connection inside one transaction (the adapters'
executors, :mod:`bourse.storage.sqlite` and :mod:`bourse.storage.postgres`), and the row
it reads. Its own module so that every module of SQL (the ledger's, the sealing key's)
depends on it and none on another."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

Row = Mapping[str, Any]


class Executor(Protocol):
    """One connection inside one transaction (synchronous, on the database thread)."""

    clock: str
    """An SQL expression for the database's own clock, in seconds since the epoch: every
    lease and take-over between replicas is judged on it, never on a replica's clock
    (which may be minutes off). On SQLite (one process, one file) it is that process's."""

    def fetch(self, sql: str, *args: Any) -> list[Row]: ...
    def fetchrow(self, sql: str, *args: Any) -> Row | None: ...
    def execute(self, sql: str, *args: Any) -> int:
        """Run a statement; the number of rows it changed."""
        ...
