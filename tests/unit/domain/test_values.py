"""``@immutable``: a slots dataclass at run time, frozen to mypy, hashed like a frozen one."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
from mypy import api as mypy_api

from bourse.domain.values import immutable
from bourse.services.billing import Quote


@immutable
class Point:
    x: int
    y: int = 0


def test_it_is_a_slots_dataclass_with_equality_hash_replace_and_asdict() -> None:
    p = Point(1, 2)
    assert not hasattr(p, "__dict__")
    assert p == Point(1, 2) and p != Point(2, 1)
    assert hash(p) == hash(Point(1, 2))
    assert {p, Point(1, 2)} == {p}
    assert dataclasses.replace(p, y=5) == Point(1, 5)
    assert dataclasses.asdict(p) == {"x": 1, "y": 2}
    assert Point(3) == Point(3, 0)
    with pytest.raises(TypeError):
        Point()  # type: ignore[call-arg]


def test_a_records_fields_cannot_be_assigned_under_mypy(tmp_path: Path) -> None:
    snippet = tmp_path / "assign.py"
    snippet.write_text(
        textwrap.dedent(
            """
            from bourse.domain.values import immutable
            from bourse.services.billing import Quote

            @immutable
            class Point:
                x: int

            p = Point(1)
            p.x = 2
            q = Quote(1, 2, 0.5)
            q.micros = 0
            """
        )
    )
    out, _err, status = mypy_api.run(
        ["--strict", "--no-incremental", "--cache-dir", str(tmp_path / "c"), str(snippet)]
    )
    assert status == 1, out
    assert 'Property "x" defined in "Point" is read-only' in out
    assert 'Property "micros" defined in "Quote" is read-only' in out


def test_the_hot_records_are_immutable_ones() -> None:
    # the request's records are built with @immutable, not @dataclass(frozen=True)
    assert Quote.__init__.__code__.co_names.count("__setattr__") == 0
    assert Quote.__hash__ is not None
