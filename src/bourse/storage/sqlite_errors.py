"""Which SQLite failures mean the database cannot take a transaction now (the HTTP
layer answers those 503 ``no_capacity``), as opposed to a statement that is wrong."""

from __future__ import annotations

import sqlite3

from bourse.ports.stores import StoreUnavailable

UNAVAILABLE_CODES = frozenset({
    sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_NOMEM, sqlite3.SQLITE_READONLY,
    sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_FULL, sqlite3.SQLITE_CANTOPEN,
    sqlite3.SQLITE_PROTOCOL,
})  # fmt: skip
"""The primary result codes of a database that cannot take a transaction now (the disk
is full, failing or read-only, memory ran out, the file is locked past the busy timeout),
as opposed to a statement that is wrong."""


def unavailable_as_such(exc: Exception) -> Exception:
    """``exc`` as :class:`StoreUnavailable` when SQLite failed for one of
    :data:`UNAVAILABLE_CODES` (the HTTP layer answers 503 ``no_capacity``), else ``exc``."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(exc, sqlite3.Error) and code is not None and code & 0xFF in UNAVAILABLE_CODES:
        out = StoreUnavailable(f"SQLite: {exc}")
        out.__cause__ = exc
        return out
    return exc
