"""Checks that a CSV row of usage (``bourse.http.usage_csv``) says what the JSON usage
record says, column by column."""

from __future__ import annotations

import csv
import io
from typing import Any

from bourse.http.usage_csv import COLUMNS


def parse_csv(text: str) -> list[dict[str, str]]:
    assert text.splitlines()[0].split(",") == [name for name, _ in COLUMNS], text.splitlines()[:1]
    return list(csv.DictReader(io.StringIO(text)))


def _value(doc: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        doc = doc.get(part) if isinstance(doc, dict) else None
    return doc


def assert_row_is_record(row: dict[str, str], record: dict[str, Any], account: str) -> None:
    for name, paths in COLUMNS:
        found = [v for v in (_value(record, path) for path in paths) if v is not None]
        assert len(found) <= 1, (name, found)  # one of a column's names, never two
        want = account if not paths else (found[0] if found else None)
        got = row[name]
        if want is None:
            assert got == "", (name, got)
        elif isinstance(want, bool):
            assert got == str(want).lower(), name
        elif isinstance(want, int | float):
            assert float(got) == want, (name, got, want)
        else:
            assert got == str(want), (name, got, want)
