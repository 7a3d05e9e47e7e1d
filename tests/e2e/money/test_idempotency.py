"""Idempotency keys (SPEC 2, Stripe's rules): the same key and body replay the stored
answer without a second charge; another body, or the first still running, is 409
``idempotency_conflict``; a streamed request's key answers 409 pointing at its usage
record. Over SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.money.support import As, assert_ledger_balanced, new_caller
from tests.support.errors import assert_error_envelope
from tests.support.gateway import Gateway, running_gateway

CONFIG = """
[products.idem]
sim_overrides = true
[[products.idem.deployments]]
engine = "sim"
slots = 8
floor = 1.0
"""


@pytest.fixture(scope="module")
def gw(module_db: str | None) -> Iterator[Gateway]:
    with running_gateway(CONFIG, database=module_db) as g:
        yield g


_n = 0


def caller(gw: Gateway) -> As:
    global _n
    _n += 1
    return new_caller(gw, f"idem-{_n}", 1.0)


def test_same_key_and_body_replays_the_answer_and_charges_once(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    body = {"model": "idem", "max_tokens": 20, "seed": 3}
    h = {"idempotency-key": "order-1"}
    first = me.post(body, headers=h)
    assert first.status_code == 200, first.text
    assert "idempotent-replayed" not in first.headers
    cost = int(first.headers["x-bourse-cost-micros"])
    assert cost > 0
    assert me.balance() == before - cost
    second = me.post(body, headers=h)
    assert second.status_code == 200, second.text
    assert second.headers.get("idempotent-replayed") == "true", dict(second.headers)
    assert second.content == first.content
    assert second.headers["x-request-id"] == first.headers["x-request-id"]
    assert second.headers["x-bourse-cost-micros"] == first.headers["x-bourse-cost-micros"]
    assert me.balance() == before - cost, "an idempotent retry must not be charged again"
    assert len(me.holds()) == 1
    # the key is the caller's: the same key from another account is a new request
    other = caller(gw)
    third = other.post(body, headers=h)
    assert third.status_code == 200 and "idempotent-replayed" not in third.headers
    assert third.headers["x-request-id"] != first.headers["x-request-id"]
    me.assert_books()
    assert_ledger_balanced(gw)


def test_same_key_with_another_body_is_409(gw: Gateway) -> None:
    me = caller(gw)
    h = {"idempotency-key": "order-2"}
    first = me.post({"model": "idem", "max_tokens": 20}, headers=h)
    assert first.status_code == 200, first.text
    balance = me.balance()
    r = me.post({"model": "idem", "max_tokens": 21}, headers=h)
    assert_error_envelope(r, 409, "idempotency_conflict")
    assert me.balance() == balance
    assert len(me.holds()) == 1


def test_same_key_while_the_first_is_running_is_409(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    body = {"model": "idem", "max_tokens": 40, "sim": {"tokens_per_s": 20, "output_tokens": 30}}
    h = {"idempotency-key": "order-3"}
    box: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", me.post(body, headers=h)))
    t.start()
    try:
        deadline = time.monotonic() + 10
        while not me.holds("open") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert me.holds("open"), "the first request never placed its hold"
        r = me.post(body, headers=h)
        assert_error_envelope(r, 409, "idempotency_conflict")
        assert len(me.holds()) == 1  # the conflict placed no hold
    finally:
        t.join(timeout=30)
    first = box["r"]
    assert first.status_code == 200, first.text
    cost = int(first.headers["x-bourse-cost-micros"])
    # once the first is done, the same key and body replay it
    again = me.post(body, headers=h)
    assert again.status_code == 200 and again.headers.get("idempotent-replayed") == "true"
    assert again.content == first.content
    assert me.balance() == before - cost
    me.assert_books()


def test_streamed_key_replayed_is_409_pointing_at_the_usage_record(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    body = {"model": "idem", "max_tokens": 20, "stream_options": {"include_usage": True}}
    h = {"idempotency-key": "order-4"}
    res = me.stream(body, headers=h)
    assert res.status == 200 and res.kinds()[-1] == "DONE", res.kinds()
    rid = res.headers["x-request-id"]
    cost = res.chunks[-1]["usage"]["cost_micros"]
    assert me.wait_settled() == []
    again = me.stream(body, headers=h)  # the same bytes again
    assert again.status == 409, (again.status, again.raw)
    err = again.body_json["error"]
    assert err["code"] == "idempotency_conflict", err
    assert f"/v1/usage/{rid}" in err["message"], err
    assert me.usage(rid)["receipt"]["cost_micros"] == cost
    assert me.balance() == before - cost
    assert len(me.holds()) == 1
    me.assert_books()
    assert_ledger_balanced(gw)
