"""Ids (:mod:`bourse.services.ids`): their shape, every id's bytes are fresh (across the
draws of ``os.urandom``, across threads), and a forked child never repeats its parent's."""

from __future__ import annotations

import os
import re
import threading

import pytest

from bourse.services import ids
from bourse.services.ids import new_request_id, random_hex


def test_the_shapes_of_request_ids() -> None:
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", new_request_id("chat"))
    assert re.fullmatch(r"cmpl-[0-9a-f]{24}", new_request_id("completion"))
    assert re.fullmatch(r"req-[0-9a-f]{24}", new_request_id("req"))
    assert re.fullmatch(r"[0-9a-f]{16}", random_hex(8))


def test_ids_are_unique_across_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    draws: list[int] = []
    real = os.urandom

    def urandom(n: int) -> bytes:
        draws.append(n)
        return real(n)

    monkeypatch.setattr(os, "urandom", urandom)
    many = [random_hex(12) for _ in range(3 * ids._DRAW_BYTES // 12)]
    assert len(set(many)) == len(many)
    assert 3 <= len(draws) <= 4  # a few kilobytes a draw, not one draw an id
    assert len(random_hex(2 * ids._DRAW_BYTES)) == 4 * ids._DRAW_BYTES  # more than a draw at once


def test_threads_never_share_bytes() -> None:
    out: list[list[str]] = [[] for _ in range(4)]

    def work(mine: list[str]) -> None:
        mine.extend(random_hex(12) for _ in range(2000))

    threads = [threading.Thread(target=work, args=(mine,)) for mine in out]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [x for mine in out for x in mine]
    assert len(set(every)) == len(every) == 8000


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork in a threaded process (3.12+)
def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    random_hex(12)  # bytes left in the pool at the fork
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        os.write(w, ",".join(random_hex(12) for _ in range(5)).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child = f.read().split(",")
    os.waitpid(pid, 0)
    parent = [random_hex(12) for _ in range(5)]
    assert len(child) == 5
    assert not set(child) & set(parent)
