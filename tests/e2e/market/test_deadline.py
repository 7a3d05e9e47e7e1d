"""Deadline orders through the served gateway (issue 38, SPEC section 10), over both
books (in process and Redis): ``deadline_s`` (or ``X-Deadline-S``) with ``max_price``
as the ceiling. On a busy one-slot product the order starts at the bid the wait
forecast prices for its deadline (``Market.bid_for``; the schedule with a fixed
pricing is tests/unit/services/test_deadline.py), is raised as its deadline nears, overtakes a lower fixed bid and is admitted before its
deadline, paying the second price; the receipt says the bid it started at, the bid
it cleared at and the price it paid. One that cannot make it ends 408
``book_timeout`` at its deadline, its bid raised to its ceiling. Bad terms are 400s
naming the field. The same through ``/v1/jobs`` and the Responses API."""

from __future__ import annotations

import threading
import time
from typing import Any

import openai
import pytest

from tests.e2e.jobs.support import Jobs
from tests.e2e.market.support import holding_slot, market, order, wait_market, wait_waiting
from tests.e2e.money.support import As, assert_ledger_balanced, expected_cost, new_caller
from tests.support.bodies import USER
from tests.support.env import Env

FLOOR = 0.1
"""Every deadline product's floor: where a deadline order starts on a book nobody outbids."""
SHORT = {"output_tokens": 4, "tokens_per_s": 40}
DEADLINE_S = 4.0
CEILING = 2.0
LOW = 0.5
"""A fixed bid waiting ahead of the deadline order until it is raised."""

_n = 0


def caller(env: Env) -> As:
    global _n
    _n += 1
    return new_caller(env.gateway, f"market-deadline-{_n}", 5.0)


def raised(env: Env, product: str, bid: float = CEILING) -> dict[str, Any]:
    """The market view once the best bid waiting is ``bid`` (a raise, seen by everyone)."""
    return wait_market(env, product, lambda v: v["best_bid"] == bid, DEADLINE_S + 2, f"best bid {bid}")


def check_receipt(xm: dict[str, Any], *, start: float | None, bid: float, price: float | None) -> None:
    """``start`` None: the forecast's (``Market.bid_for``), between the floor and the bid."""
    assert xm["deadline_s"] == DEADLINE_S, xm
    if start is None:
        assert FLOOR <= xm["start_bid"] <= xm["bid"], xm
    else:
        assert xm["start_bid"] == pytest.approx(start), xm
    assert xm["bid"] == pytest.approx(bid), xm
    if price is None:
        assert xm["cleared_price"] is None, xm
    else:
        assert xm["cleared_price"] == pytest.approx(price), xm


def test_a_deadline_order_starts_low_is_raised_and_admitted_before_its_deadline(env: Env) -> None:
    me = caller(env)
    client = env.gateway.client(api_key=me.key)
    before = me.balance()
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            stream = client.chat.completions.create(
                model="dl", messages=USER, stream=True, stream_options={"include_usage": True},
                extra_body={"max_price": CEILING, "deadline_s": DEADLINE_S, "sim": SHORT},
            )  # fmt: skip
            out["request_id"] = stream.response.headers["x-request-id"]
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and "first" not in out:
                    out["first"] = time.monotonic()
                if chunk.usage is not None:
                    out["usage"] = chunk.usage.model_dump()
        except BaseException as exc:  # reported below
            out["error"] = exc

    with holding_slot(env, "dl") as holder:
        low = order(env, "dl", LOW, key=me.key, sim=SHORT)
        wait_waiting(env, "dl", 1)
        sent = time.monotonic()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        view = wait_waiting(env, "dl", 2)
        # it starts at the forecast's bid (the floor up to its ceiling), behind the fixed bid or ahead
        assert view["best_bid"] >= LOW, view
        view = raised(env, "dl")  # raised to its ceiling as its deadline nears: first now
        assert time.monotonic() - sent < DEADLINE_S
        assert view["waiting"] == 2 and view["level"] == CEILING, view
        holder.disconnect()  # the slot frees: the raised order takes it, ahead of the fixed bid
        t.join(20)
        assert not t.is_alive() and "error" not in out, out.get("error")
        low.join()
    client.close()
    assert out["first"] - sent < DEADLINE_S  # started before its deadline
    assert low.first_content_at() > out["first"]  # the raise overtook the earlier, lower bid
    xm = out["usage"]["x_market"]
    # started at the floor, cleared at its ceiling, paid the bid it beat (the second price)
    check_receipt(xm, start=None, bid=CEILING, price=LOW)
    assert xm["queued_ms"] < DEADLINE_S * 1000, xm
    rec = me.usage(out["request_id"])
    assert rec["outcome"] == "completed" and rec["usage"]["x_market"] == xm, rec
    u = rec["usage"]
    assert u["cost_micros"] == expected_cost(int(u["prompt_tokens"]) + int(u["completion_tokens"]), LOW), u
    assert low.x_market()["start_bid"] == low.x_market()["bid"] == LOW  # a fixed bid: never raised
    assert low.x_market()["deadline_s"] is None
    me.wait_settled()
    assert me.balance() == before - u["cost_micros"] - low.usage_chunk()["usage"]["cost_micros"]
    me.assert_books()
    assert_ledger_balanced(env.gateway)


def test_a_deadline_order_that_cannot_make_it_ends_408_at_its_deadline(env: Env) -> None:
    me = caller(env)
    before = me.balance()
    client = env.gateway.client(api_key=me.key)
    with holding_slot(env, "dlx"):
        # streamed (raw, to read the frames): its bid in each queued frame, raised to the ceiling
        s = order(env, "dlx", None, key=me.key, headers={"X-Max-Price": "1", "X-Deadline-S": "1.5"})
        # not streamed, through the SDK: the 408 as an exception
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(
                model="dlx", messages=USER, extra_body={"max_price": CEILING, "deadline_s": DEADLINE_S}
            )
        waited = time.monotonic() - t0
        s.join()
    client.close()
    assert err.value.status_code == 408, err.value
    assert err.value.code == "book_timeout", err.value.body
    assert DEADLINE_S - 0.1 <= waited < DEADLINE_S + 3, waited
    rec = me.usage(err.value.response.headers["x-request-id"])
    assert rec["outcome"] == "timeout", rec
    check_receipt(rec["usage"]["x_market"], start=None, bid=CEILING, price=None)  # bid its ceiling at the end
    assert rec["usage"]["cost_micros"] == 0, rec
    # the stream: in-band 408, and its queued frames show the bid rising to its ceiling
    [err_frame] = [c for c in s.result().chunks if "error" in c]
    assert err_frame["error"]["code"] == "book_timeout", err_frame
    bids = [float(c.rsplit(" bid=", 1)[1]) for c in s.comments() if c.startswith("queued level=")]
    assert bids and bids[0] >= FLOOR and bids[-1] == 1.0, bids
    assert bids == sorted(bids), bids  # raised only
    me.wait_settled()
    assert me.balance() == before  # nothing charged
    me.assert_books()


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"deadline_s": 5}, {}, "max_price"),  # a deadline needs a ceiling
        ({}, {"X-Deadline-S": "5"}, "max_price"),
        ({"deadline_s": 0, "max_price": 1}, {}, "deadline_s"),
        ({"deadline_s": -2, "max_price": 1}, {}, "deadline_s"),
        ({"deadline_s": "soon", "max_price": 1}, {}, "deadline_s"),
        ({"deadline_s": 100_000, "max_price": 1}, {}, "deadline_s"),  # over book_timeout_max_s
        ({"max_price": 1}, {"X-Deadline-S": "soon"}, "X-Deadline-S"),
        ({"max_price": 1}, {"X-Deadline-S": "0"}, "X-Deadline-S"),
        ({"deadline_s": 5, "max_price": 1, "timeout": 5}, {}, "timeout"),  # one or the other
        ({"deadline_s": 5, "max_price": 0.01}, {}, "max_price"),  # a ceiling below every floor
    ],
)
def test_bad_deadline_terms_are_400_naming_the_field(
    env: Env, body: dict[str, Any], headers: dict[str, str], param: str
) -> None:
    client = env.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="dl", messages=USER, extra_body=body, extra_headers=headers)
    assert err.value.status_code == 400
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == param, err.value.body
    # the same through a job and a response
    r = Jobs(env.url, env.auth["authorization"].split()[-1]).submit_raw(
        {"endpoint": "/v1/chat/completions", "body": {"model": "dl", "messages": USER, **body}}, headers
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="dl", input="hi", extra_body=body, extra_headers=headers)
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == param, err.value.body


def test_a_deadline_job_is_raised_and_admitted_before_its_deadline(env: Env) -> None:
    me = caller(env)
    jobs = Jobs(env.url, me.key, me.account)
    with holding_slot(env, "dljob") as holder:
        low = order(env, "dljob", LOW, key=me.key, sim=SHORT)
        wait_waiting(env, "dljob", 1)
        r = jobs.submit_raw(
            {"endpoint": "/v1/chat/completions", "body": {"model": "dljob", "messages": USER, "sim": SHORT}},
            {"X-Max-Price": str(CEILING), "X-Deadline-S": str(DEADLINE_S)},
        )
        assert r.status_code == 202, r.text
        job = r.json()
        queued = jobs.get(job["id"])
        assert queued["status"] == "queued" and FLOOR <= queued["queue"]["bid"] <= CEILING, queued
        raised(env, "dljob")
        assert jobs.get(job["id"])["queue"]["bid"] == CEILING  # the job's view says its bid now
        holder.disconnect()
        done = jobs.wait_status(job["id"], "succeeded", "failed")
        low.join()
    assert done["status"] == "succeeded", done
    xm = done["result"]["usage"]["x_market"]
    check_receipt(xm, start=None, bid=CEILING, price=LOW)  # it beat the fixed bid: paid it
    assert low.x_market()["queued_ms"] > xm["queued_ms"]  # the fixed bid ran after the job
    assert me.usage(job["request_id"])["usage"]["x_market"] == xm


def test_a_deadline_response_is_raised_and_admitted_and_a_background_one_too(env: Env) -> None:
    me = caller(env)
    client = env.gateway.client(api_key=me.key)
    out: dict[str, Any] = {}
    terms = {"max_price": CEILING, "deadline_s": DEADLINE_S, "sim": SHORT}

    def run() -> None:
        try:
            out["response"] = client.responses.create(model="dlresp", input="hi", extra_body=terms)
        except BaseException as exc:  # reported below
            out["error"] = exc

    with holding_slot(env, "dlresp") as holder:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        view = wait_waiting(env, "dlresp", 1)
        assert FLOOR <= view["best_bid"] <= CEILING, view
        raised(env, "dlresp")
        holder.disconnect()
        t.join(20)
    assert not t.is_alive() and "error" not in out, out.get("error")
    resp = out["response"]
    assert resp.status == "completed", resp
    xm = (resp.usage.model_extra or {})["x_market"]
    check_receipt(xm, start=None, bid=CEILING, price=FLOOR)  # nobody else waiting: the floor
    # in the background (a job): a free slot, admitted at once at the floor
    bg = client.responses.create(model="dlresp", input="hi", background=True, extra_body=terms)
    for _ in range(400):
        bg = client.responses.retrieve(bg.id)
        if bg.status in ("completed", "failed", "incomplete", "cancelled"):
            break
        time.sleep(0.05)
    client.close()
    assert bg.status == "completed" and bg.usage is not None, bg
    check_receipt((bg.usage.model_extra or {})["x_market"], start=FLOOR, bid=FLOOR, price=FLOOR)
    assert market(env, "dlresp")["waiting"] == 0
