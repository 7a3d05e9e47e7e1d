"""A streamed response goes through the chat relay's machinery: the book's comments
before the first event, a disconnect that cancels the engine and is charged by the
policy, a failure after output as ``response.failed`` (the code the HTTP status would
carry), and a book timeout (408 not streamed, ``response.failed`` streamed)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.jobs.support import slot_held, unique
from tests.e2e.money.support import As, new_caller
from tests.e2e.responses.support import PRODUCTS, SERVER, Caller, types_of
from tests.support.env import Env, start_env


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with start_env("sim", PRODUCTS, server=SERVER) as e:
        yield e


def _caller(env: Env, prefix: str) -> tuple[Caller, As]:
    money = new_caller(env.gateway, unique(prefix), 10.0)
    return Caller(env.url, money.key, money.account), money


def test_a_queued_response_shows_the_books_comments_before_its_first_event(env: Env) -> None:
    me, _ = _caller(env, "queued")
    body = {"model": "one", "input": "Wait for me.", "max_price": 2.0}
    with slot_held(env.gateway, "one") as blocker, me.open_stream(body) as s:
        s.until(lambda f: f.comment is not None and f.comment.startswith("queued level="))
        assert s.raw.startswith(b": queued bid=2\n\n"), s.raw
        assert all(f.comment is not None for f in s.seen), s.seen  # no event while in the book
        blocker.response.close()  # the slot frees: the order is admitted
        s.until(lambda f: f.event == "response.completed")
    first = next(i for i, f in enumerate(s.seen) if f.event is not None)
    assert s.seen[first].event == "response.created" and first >= 2, s.seen
    assert types_of(s.events)[:2] == ["response.created", "response.in_progress"]


def test_a_disconnect_cancels_the_engine_and_charges_by_policy(env: Env) -> None:
    me, money = _caller(env, "gone")
    before = env.stats("slow-a")
    with me.open_stream({"model": "slow", "input": "Talk for a while."}) as s:
        deltas = 0
        for f in s.frames():
            if f.event == "response.output_text.delta":
                deltas += 1
            if deltas == 3:
                break
        rid = s.events[0]["response"]["id"]
    stats, waited = env.wait_stats("slow-a", lambda st: st["cancelled"] > before["cancelled"], timeout=1.0)
    assert stats["cancelled"] == before["cancelled"] + 1, (waited, stats)
    assert stats["completed"] == before["completed"], stats
    assert money.wait_settled() == []
    record = money.usage(rid)
    assert record["receipt"]["outcome"] == "disconnected", record
    generated = record["usage"]["completion_tokens"]
    assert 3 <= generated < 60 and record["usage"]["cost_micros"] > 0, (
        record
    )  # charge_on_disconnect = generated
    money.assert_books()


def test_a_failure_after_output_is_response_failed(env: Env) -> None:
    me, money = _caller(env, "fails")
    s = me.stream({"model": "fail", "input": "Go."})
    types = types_of(s.events)
    assert types.count("response.output_text.delta") == 3 and types[-1] == "response.failed", types
    failed = s.events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "upstream_error", failed
    assert "response.completed" not in types
    r = me.create_raw({"model": "fail", "input": "Go."})
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error", r.text
    assert money.wait_settled() == []
    assert money.account_view()["spent_micros"] == 0  # charge_on_error = none
    assert me.retrieve(failed["id"])["status"] == "failed"


def test_a_book_timeout(env: Env) -> None:
    me, money = _caller(env, "timeout")
    with slot_held(env.gateway, "one"):
        r = me.create_raw({"model": "one", "input": "Hi", "timeout": 0.3})
        assert r.status_code == 408 and r.json()["error"]["code"] == "book_timeout", r.text
        s = me.stream({"model": "one", "input": "Hi", "timeout": 0.3})
    assert s.raw.startswith(b": queued bid="), s.raw
    assert types_of(s.events) == ["response.created", "response.in_progress", "response.failed"], s.events
    assert s.events[-1]["response"]["error"]["code"] == "book_timeout"
    assert money.wait_settled() == [] and money.account_view()["spent_micros"] == 0
