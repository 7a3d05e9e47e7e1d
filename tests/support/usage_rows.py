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
    for name, path in COLUMNS:
        want = account if not path else _value(record, path)
        got = row[name]
        if want is None:
            assert got == "", (name, got)
        elif isinstance(want, bool):
            assert got == str(want).lower(), name
        elif isinstance(want, int | float):
            assert float(got) == want, (name, got, want)
        else:
            assert got == str(want), (name, got, want)
