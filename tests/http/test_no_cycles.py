"""A finished request is freed by reference counting: its run, order and settlement
form no reference cycle. A cycle per request left ~20 objects for the garbage collector
each time (a collection every ~200 requests under load, ~70 µs of CPU per request in
bench scenario (b)); this keeps it from coming back."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from bourse.services.completion import Run
from tests.support.asgi import InProcessGateway
from tests.support.bodies import USER

pytestmark = pytest.mark.anyio


@contextmanager
def unreachable() -> Iterator[list[object]]:
    """The objects that only the cycle collector would free, found at the block's end."""
    gc.collect()
    found: list[object] = []
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize("stream", [False, True])
async def test_finished_runs_are_not_left_in_cycles(gw: InProcessGateway, stream: bool) -> None:
    body = {"model": "default", "messages": USER}
    await gw.post("/v1/chat/completions", body)  # warm-up: first-use caches
    with unreachable() as found:
        for _ in range(10):
            if stream:
                res = await gw.sse(body)
                assert res.status == 200
            else:
                r = await gw.post("/v1/chat/completions", body)
                assert r.status_code == 200, r.text
    runs = [o for o in found if isinstance(o, Run)]
    assert runs == [], f"{len(runs)} finished runs were only freed by the cycle collector"
