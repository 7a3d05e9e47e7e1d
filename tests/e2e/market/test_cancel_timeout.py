"""Leaving the book (SPEC section 10, issue 4): a client that disconnects while its
order is queued takes the order out of the book and pays nothing (its hold is
released); an order still waiting at its book timeout ends with 408 book_timeout
(HTTP for a non-streamed request, in band for a stream) and pays nothing."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.market.support import holding_slot, market, order, wait_market, wait_waiting
from tests.e2e.money.support import As, assert_ledger_balanced, new_caller
from tests.support.bodies import USER
from tests.support.env import Env

_n = 0


def caller(env: Env) -> As:
    global _n
    _n += 1
    return new_caller(env.gateway, f"market-dc-{_n}", 5.0)


def _hold_of(me: As, request_id: str) -> dict[str, Any]:
    [h] = [h for h in me.holds() if h["request_id"] == request_id]
    return h


def _assert_nothing_charged(env: Env, me: As, before: int, request_id: str) -> None:
    assert me.wait_settled() == [], me.holds("open")
    assert me.balance() == before
    h = _hold_of(me, request_id)
    assert h["state"] == "released" and h["charged_micros"] == 0, h
    rec = me.usage(request_id)
    assert rec["usage"]["cost_micros"] == 0, rec
    assert rec["usage"]["completion_tokens"] == 0, rec
    assert rec["usage"]["x_market"]["cleared_price"] in (None, 0), rec  # never admitted
    me.assert_books()
    assert_ledger_balanced(env.gateway)


@pytest.mark.parametrize("client", ["raw", "sdk"])
def test_disconnect_while_queued_removes_the_order_and_charges_nothing(env: Env, client: str) -> None:
    me = caller(env)
    before = me.balance()
    started = env.stats("dc-a")["started"]
    with holding_slot(env, "dc") as holder:
        base = market(env, "dc")
        if client == "raw":
            o = order(env, "dc", 0.5, key=me.key)
            rid = o.request_id
        else:
            sdk = env.gateway.client(api_key=me.key)
            stream = sdk.chat.completions.create(
                model="dc",
                messages=USER,
                stream=True,
                extra_body={"max_price": 0.5},
            )
            rid = stream.response.headers["x-request-id"]
        wait_waiting(env, "dc", 1)
        # while it waits, its hold (the quote at its bid) is open
        [h] = me.holds("open")
        assert h["request_id"] == rid, h
        assert before - me.balance() == h["amount_micros"] > 0
        if client == "raw":
            o.disconnect()
        else:
            stream.close()
            sdk.close()
        # the order leaves the book at once; nothing was admitted meanwhile
        view = wait_waiting(env, "dc", 0, timeout=2.0)
        assert view["admitted_total"] == base["admitted_total"], view
        assert view["slots"]["busy"] == 1, view
        holder.disconnect()
    wait_market(env, "dc", lambda v: v["slots"]["busy"] == 0)
    # it never reached the engine (only the holder did)
    assert env.stats("dc-a")["started"] == started + 1
    _assert_nothing_charged(env, me, before, rid)
    assert me.usage(rid)["outcome"] in ("disconnected", "canceled")


def test_book_timeout_non_streamed_is_408_and_charges_nothing(env: Env) -> None:
    me = caller(env)
    before = me.balance()
    with holding_slot(env, "dc"):
        r = me.post({"model": "dc", "max_price": 0.5, "timeout": 0.3})
        assert r.status_code == 408, r.text
        assert r.json()["error"]["code"] == "book_timeout", r.text
        rid = r.headers["x-request-id"]
        assert market(env, "dc")["waiting"] == 0
        # the X-Book-Timeout header works the same
        r2 = me.post({"model": "dc"}, headers={"X-Book-Timeout": "0.3", "X-Max-Price": "0.6"})
        assert r2.status_code == 408 and r2.json()["error"]["code"] == "book_timeout", r2.text
    _assert_nothing_charged(env, me, before, rid)
    _assert_nothing_charged(env, me, before, r2.headers["x-request-id"])
    assert me.usage(rid)["outcome"] == "timeout"


def test_book_timeout_streamed_is_in_band_and_charges_nothing(env: Env) -> None:
    me = caller(env)
    before = me.balance()
    with holding_slot(env, "dc"):
        o = order(env, "dc", 0.5, key=me.key, timeout=0.4)
        o.join(timeout=5)
        assert market(env, "dc")["waiting"] == 0
    kinds = o.kinds()
    assert o.status == 200, kinds
    assert kinds[0] == "c:queued bid=0.5", kinds
    assert [k for k in kinds if not k.startswith("c:")] == ["error", "DONE"], kinds
    err = o.result().chunks[-1]["error"]
    assert err["code"] == "book_timeout", err
    _assert_nothing_charged(env, me, before, o.request_id)
    assert me.usage(o.request_id)["outcome"] == "timeout"


def test_an_order_left_in_the_book_does_not_hold_the_slot_after_it_frees(env: Env) -> None:
    """After a disconnect and a timeout the book is empty; the next order is admitted at once."""
    wait_market(env, "dc", lambda v: v["slots"]["busy"] == 0 and v["waiting"] == 0)
    r = httpx.post(
        env.url + "/v1/chat/completions",
        json={"model": "dc", "messages": USER, "max_price": 0.5, "timeout": 1},
        headers=env.auth,
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["x_market"]["position_at_entry"] == 0
    assert r.json()["usage"]["x_market"]["cleared_price"] == pytest.approx(0.2)
