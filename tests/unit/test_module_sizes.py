"""Small rooms (issue 36): no module in ``src/bourse`` is over :data:`MAX_LINES` lines.
A module past it is split by concern, each new module with a docstring saying what it
owns; the failure lists every module over, with its length."""

from __future__ import annotations

from pathlib import Path

import bourse

MAX_LINES = 600
PACKAGE = Path(bourse.__file__).resolve().parent


def _lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def _over() -> dict[str, int]:
    sizes = {str(p.relative_to(PACKAGE.parent)): _lines(p) for p in sorted(PACKAGE.rglob("*.py"))}
    return {name: n for name, n in sizes.items() if n > MAX_LINES}


def test_the_count_sees_the_package() -> None:
    """The walk finds this package's modules (an empty walk would pass the size test)."""
    names = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    assert {"__init__.py", "container.py", "wire/responses/__init__.py"} <= names, sorted(names)[:10]


def test_no_module_is_over_the_limit() -> None:
    over = _over()
    assert not over, f"modules over {MAX_LINES} lines (split them by concern): " + ", ".join(
        f"{name} ({n})" for name, n in sorted(over.items(), key=lambda kv: -kv[1])
    )
