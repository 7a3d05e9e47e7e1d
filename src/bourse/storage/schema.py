"""Versioned migrations, one SQL file per version, valid on SQLite and PostgreSQL.

The files are ``migrations/NNNN_name.sql`` in this package (read with
:mod:`importlib.resources`, so they ship in the wheel): version ``NNNN`` is applied
once, in order, inside a transaction, and recorded in ``schema_migrations``. Add a
file; never edit one that has shipped. Statements end with ``;``; whole-line ``--``
comments are dropped before splitting. Money columns are integer micro-USD with
CHECK constraints that make an overdraft or an over-charge impossible at the
database level.
"""

from __future__ import annotations

import re
from importlib import resources

_FILE = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


def statements(sql: str) -> list[str]:
    """The statements of one migration file, without comments and empty ones."""
    text = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    return [s.strip() for s in text.split(";") if s.strip()]


def migrations() -> list[tuple[int, list[str]]]:
    """Every migration as ``(version, statements)``, in version order; versions run 1, 2, … without gaps."""
    found: list[tuple[int, list[str]]] = []
    for entry in resources.files("bourse.storage").joinpath("migrations").iterdir():
        match = _FILE.match(entry.name)
        if match is not None:
            found.append((int(match.group(1)), statements(entry.read_text(encoding="utf-8"))))
    found.sort(key=lambda m: m[0])
    versions = [v for v, _ in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"the migration files are not numbered 1 to {len(found)}: {versions}")
    return found
