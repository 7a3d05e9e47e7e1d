"""How the PostgreSQL adapter sends a statement (``storage/postgres.py _PgExecutor``):
as written (psycopg's raw cursor) when its parameters are ``$1``..``$n`` and n are
given, else rewritten as named parameters; both answer the same rows."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from bourse.storage.postgres import _converted, _PgExecutor

pytestmark = [pytest.mark.postgres]


def test_which_statements_go_as_written() -> None:
    assert _converted("SELECT $1, $2, $1") == ("SELECT %(p1)s, %(p2)s, %(p1)s", 2)
    assert _converted("SELECT 1") == ("SELECT 1", 0)
    assert _converted("SELECT $1, $3")[1] == -1  # a gap: named only
    assert _converted("SELECT $1 WHERE x LIKE 'a%'")[1] == 1  # as written: a % is no placeholder


def test_raw_and_named_answer_alike(postgres_dsn: str) -> None:
    cache: dict[str, tuple[str, int]] = {}
    with psycopg.connect(postgres_dsn, autocommit=True, row_factory=dict_row) as conn:
        ex = _PgExecutor(conn, cache)
        raw = "SELECT $1::int AS a, $2::text AS b, $1::int + 1 AS c"
        assert ex.fetch(raw, 4, "x") == [{"a": 4, "b": "x", "c": 5}]
        assert cache[raw][1] == 2
        # more arguments than parameters: named (the extra one is not sent)
        assert ex.fetchrow("SELECT $1::int AS a", 7, "unused") == {"a": 7}
        # a statement without parameters, raw
        assert ex.fetchrow("SELECT 3 AS n") == {"n": 3}
        ex.execute("CREATE TEMP TABLE t (k int PRIMARY KEY, v text)")
        rows: Any = ex.execute("INSERT INTO t VALUES ($1, $2), ($3, $4)", 1, "a", 2, "b")
        assert rows == 2
        assert ex.fetch("SELECT k, v FROM t WHERE k >= $1 ORDER BY k", 1) == [
            {"k": 1, "v": "a"},
            {"k": 2, "v": "b"},
        ]
