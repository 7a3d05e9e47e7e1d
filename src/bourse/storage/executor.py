"""What every SQL transaction of the stores is written against: the :class:`Executor`
(one connection inside one transaction, supplied by each adapter), its rows, the
adapter-neutral :class:`IntegrityError`, and the parameters of multi-row statements.
SQL is written with numbered ``$n`` parameters; each adapter rewrites them for its
driver.
"""

from __future__ import annotations

import functools
import os
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


class IntegrityError(Exception):
    """A uniqueness or check constraint refused a write (adapter-neutral)."""


def new_id(prefix: str) -> str:
    return prefix + os.urandom(10).hex()


@functools.lru_cache(maxsize=1024)
def values_list(rows: int, columns: int, cast: tuple[str, ...] = (), *, start: int = 0) -> str:
    """``($1, $2), ($3, $4)``: the parameters of a multi-row VALUES list, numbered
    after ``start`` (``cast``, if given, types each column, as ``CAST($n AS type)``).
    Kept once made: a batch of writes asks for one on every transaction, with a few
    shapes (batches are at most :data:`~bourse.storage.batching.MAX_BATCH` long)."""
    out = []
    for r in range(rows):
        cells = [f"${start + r * columns + c + 1}" for c in range(columns)]
        if cast:
            cells = [f"CAST({p} AS {t})" if t else p for p, t in zip(cells, cast, strict=True)]
        out.append("(" + ", ".join(cells) + ")")
    return ", ".join(out)
