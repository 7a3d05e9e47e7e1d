"""``bourse serve`` settles its heap before serving: the start-up objects frozen out of
the collector's passes, and the young generation collected only after
``GC_YOUNG_THRESHOLD`` allocations, not swept ten times a second by the swing of the
requests in flight (bench scenario (c): ~10 % of the gateway's CPU at CPython's 700
and at 7,000)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from bourse import cli


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restored_gc")
def test_settle_heap_freezes_and_raises_the_young_threshold() -> None:
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    kept = [object() for _ in range(10)]  # noqa: F841 (alive through the freeze)
    cli.settle_heap()
    assert gc.get_freeze_count() > 0
    young, older, oldest = gc.get_threshold()
    assert young == cli.GC_YOUNG_THRESHOLD
    assert young >= 20_000, "below ~20,000 the live set of 256 waiting requests triggers collections"
    assert (older, oldest) == (10, 10)


def test_serve_settles_the_heap_before_it_serves() -> None:
    """The serving path calls it (a refactor that drops the call fails here)."""
    import inspect

    source = inspect.getsource(cli._serve_locked)
    assert "settle_heap()" in source
    assert source.index("settle_heap()") < source.index(".run(sockets=")
