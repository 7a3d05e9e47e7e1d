"""Orders the book refuses (SPEC sections 10 and 11, issue 4): a bid that is not a
positive number and a bid below every floor are 400; a full book (``max_waiting``)
is 503 ``no_capacity`` with ``retry-after``. None of them holds money or reaches an
engine."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.e2e.market.support import holding_slot, market, order, wait_market, wait_waiting
from tests.e2e.money.support import As, new_caller
from tests.support.bodies import USER
from tests.support.env import Env
from tests.support.errors import assert_error_envelope

_n = 0


def caller(env: Env) -> As:
    global _n
    _n += 1
    return new_caller(env.gateway, f"market-bad-{_n}", 5.0)


def _mentions_bid(err: dict[str, Any], name: str) -> None:
    text = f"{err.get('param')} {err['message']}".lower()
    assert name.lower() in text, err


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("bid", [0, -1, "abc", 0.0, -0.5, True, [1], {"usd": 1}], ids=repr)
def test_body_bid_not_a_positive_number_is_400(env: Env, bid: Any, stream: bool) -> None:
    me = caller(env)
    before = me.balance()
    started = env.stats("bad-a")["started"]
    r = me.post({"model": "bad", "max_price": bid, "stream": stream})
    err = assert_error_envelope(r, 400)
    _mentions_bid(err, "max_price")
    assert env.stats("bad-a")["started"] == started
    assert me.balance() == before and me.holds() == []


def test_no_bid_bids_the_default_bid(env: Env) -> None:
    r = caller(env).post({"model": "bad"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["x_market"]["bid"] == 0.1  # default: the lowest floor


@pytest.mark.parametrize("value", ["abc", "0", "-1", "", "nan", "inf", "-inf", "1e-999"])
def test_header_bid_not_a_positive_number_is_400(env: Env, value: str) -> None:
    me = caller(env)
    r = me.post({"model": "bad"}, headers={"X-Max-Price": value})
    err = assert_error_envelope(r, 400)
    _mentions_bid(err, "max-price")
    assert me.holds() == []


def test_sdk_bad_bid_raises_bad_request(env: Env) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        env.client().chat.completions.create(
            model="bad",
            messages=USER,
            extra_body={"max_price": "abc"},
        )
    assert info.value.status_code == 400


@pytest.mark.parametrize("how", ["body", "header"])
def test_bid_below_every_floor_is_400(env: Env, how: str) -> None:
    me = caller(env)
    if how == "body":
        r = me.post({"model": "bad", "max_price": 0.05})
    else:
        r = me.post({"model": "bad"}, headers={"X-Max-Price": "0.05"})
    err = assert_error_envelope(r, 400)
    assert "floor" in err["message"].lower(), err
    assert me.holds() == []
    # the floor itself is a valid bid
    ok = me.post({"model": "bad", "max_price": 0.1})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_full_book_is_503_no_capacity_with_retry_after(env: Env, stream: bool) -> None:
    me = caller(env)
    before = me.balance()
    with holding_slot(env, "full") as holder:
        waiting = []
        for n in (1, 2):  # max_waiting = 2
            waiting.append(order(env, "full", 0.5))
            wait_waiting(env, "full", n)
        r = me.post({"model": "full", "max_price": 5.0, "stream": stream})
        err = assert_error_envelope(r, 503, "no_capacity")
        assert err["message"]
        retry = r.headers.get("retry-after")
        assert retry is not None and retry.isdigit() and int(retry) >= 1, dict(r.headers)
        # the refused order took no place and no money
        assert market(env, "full")["waiting"] == 2
        assert me.wait_settled() == []
        assert me.balance() == before
        assert all(h["state"] == "released" for h in me.holds()), me.holds()
        holder.disconnect()
        for o in waiting:
            o.join()
    wait_market(env, "full", lambda v: v["waiting"] == 0 and v["slots"]["busy"] == 0)
    # with room in the book again the same order is taken
    ok = me.post({"model": "full", "max_price": 5.0})
    assert ok.status_code == 200, ok.text
