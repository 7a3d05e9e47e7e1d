"""Request and hold ids sort by the time they were made (issue 40: the ledger appends
their index entries), keep their shape (a prefix and 24 hex digits) and do not repeat."""

from __future__ import annotations

import re
import time

import pytest

from bourse.services.ids import new_hold_id, new_request_id


@pytest.mark.parametrize(
    ("kind", "prefix"), [("chat", "chatcmpl-"), ("completion", "cmpl-"), ("req", "req-")]
)
def test_an_id_is_its_prefix_and_24_hex_digits(kind: str, prefix: str) -> None:
    assert re.fullmatch(re.escape(prefix) + "[0-9a-f]{24}", new_request_id(kind))
    assert re.fullmatch("hold_[0-9a-f]{24}", new_hold_id())


def test_ids_made_later_sort_later(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1_796_458_444.000]
    monkeypatch.setattr(time, "time", lambda: clock[0])  # the clock ids read
    made = []
    for _ in range(200):
        made.append((new_hold_id(), new_request_id("chat")))
        clock[0] += 0.0015  # more than a millisecond apart (a float step of 1 ms may round to 0)
    assert [h for h, _ in made] == sorted(h for h, _ in made)
    assert [r for _, r in made] == sorted(r for _, r in made)


def test_ids_of_one_millisecond_do_not_repeat() -> None:
    now = time.time()
    made = {new_hold_id() for _ in range(10_000)}
    assert len(made) == 10_000
    assert time.time() - now < 60
