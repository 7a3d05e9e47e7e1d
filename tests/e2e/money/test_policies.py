"""Each preset's charging rule (SPEC 7, 8, 12), read from the ledger and the usage
records, over SQLite and PostgreSQL:

- default: a disconnect mid-stream charges the tokens generated so far; an error
  after output charges nothing; missing usage settles an estimate;
- openfill: a disconnect drains (the whole answer is charged); an error after
  output charges nothing;
- aigrid: missing usage keeps the hold as ``reconciling``;
- gopuram: an error after output charges the tokens generated;
- hips: the receipt is named ``hips`` (``cost_micros``, ``latency_ms``, ``quote``)
  and the headers are ``x-hips-*``;
- any policy: a disconnect while queued and a book timeout charge nothing; a
  failure before output then a success charges once.

Prices are 1 USD per 1M tokens, so a charge in micro-USD is the token count.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from bourse.domain import policy
from tests.e2e.money.support import As, assert_ledger_balanced, new_caller, read_until
from tests.support.errors import assert_error_envelope
from tests.support.gateway import Gateway, running_gateway

PRESETS = tuple(policy.PRESETS)


def _config() -> str:
    out = []
    for preset in PRESETS:
        out.append(
            f'[products.p-{preset}]\npolicy = "{preset}"\nmax_output_tokens = 512\nsim_overrides = true\n'
            f'[[products.p-{preset}.deployments]]\nengine = "sim"\nslots = 8\nfloor = 1.0\n'
            f"breaker_threshold = 1000\n"
        )
    out.append(
        '[products.p-single]\nsim_overrides = true\n[[products.p-single.deployments]]\nengine = "sim"\nslots = 1\nfloor = 1.0\n'
    )
    return "\n".join(out)


CONFIG = _config()
LONG = 60
"""The full answer's length in the disconnect tests."""
SLOW = {"tokens_per_s": 50, "output_tokens": LONG}


@pytest.fixture(scope="module")
def gw(module_db: str | None) -> Iterator[Gateway]:
    with running_gateway(CONFIG, database=module_db) as g:
        yield g


_n = 0


def caller(gw: Gateway) -> As:
    global _n
    _n += 1
    return new_caller(gw, f"policy-{_n}", 1.0)


def _settled_record(me: As, rid: str) -> dict[str, Any]:
    assert me.wait_settled() == [], "a hold stayed open"
    return me.usage(rid)


def _tokens(rec: dict[str, Any]) -> int:
    u = rec["usage"]
    return int(u["prompt_tokens"]) + int(u["completion_tokens"])


def _disconnect_after(me: As, product: str, chunks: int = 3) -> str:
    with me.open_stream({"model": product, "max_tokens": LONG, "sim": SLOW}) as s:
        assert s.status == 200
        rid = s.headers["x-request-id"]
        read_until(s, data_chunks=chunks)
    return rid


def _full_answer_cost(me: As, product: str) -> int:
    """What the same request costs when it runs to its end (the same prompt, LONG tokens)."""
    r = me.post({"model": product, "max_tokens": LONG, "sim": {"output_tokens": LONG}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == LONG
    return int(r.json()["usage"]["cost_micros"])


def _error_after_output(me: As, product: str) -> str:
    body = {"model": product, "max_tokens": 30, "sim": {"fail_after_tokens": 3}}
    res = me.stream(body)
    assert res.status == 200
    assert "error" in res.kinds(), res.kinds()
    assert res.text(), "the error came after some output"
    rid: str = res.headers["x-request-id"]
    return rid


# -- default -----------------------------------------------------------------------


def test_default_disconnect_mid_stream_charges_the_generated_tokens(gw: Gateway) -> None:
    me = caller(gw)
    full = _full_answer_cost(me, "p-default")
    before = me.balance()
    rid = _disconnect_after(me, "p-default")
    rec = _settled_record(me, rid)
    assert rec["outcome"] == "disconnected", rec
    cost = rec["usage"]["cost_micros"]
    assert 3 <= rec["usage"]["completion_tokens"] < LONG, rec["usage"]
    assert cost == _tokens(rec), rec["usage"]
    assert 0 < cost < full, (cost, full)
    assert before - me.balance() == cost
    me.assert_books()


def test_default_error_after_output_charges_nothing(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    rid = _error_after_output(me, "p-default")
    rec = _settled_record(me, rid)
    assert rec["outcome"] == "error", rec
    assert rec["usage"]["cost_micros"] == 0 and rec["receipt"]["cost_micros"] == 0
    assert me.balance() == before
    assert [h["state"] for h in me.holds()] == ["released"]
    me.assert_books()


def test_default_missing_usage_settles_an_estimate(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    r = me.post({"model": "p-default", "max_tokens": 30, "sim": {"omit_usage": True, "output_tokens": 12}})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage.get("usage_estimated") is True, usage
    assert usage["completion_tokens"] == 12
    cost = usage["cost_micros"]
    assert cost == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    rec = me.usage(r.headers["x-request-id"])
    assert rec["outcome"] == "completed" and rec["usage"]["usage_estimated"] is True
    assert before - me.balance() == cost
    assert me.holds("reconciling") == []
    me.assert_books()


# -- openfill ----------------------------------------------------------------------


def test_openfill_disconnect_drains_and_charges_the_full_answer(gw: Gateway) -> None:
    me = caller(gw)
    full = _full_answer_cost(me, "p-openfill")
    before = me.balance()
    rid = _disconnect_after(me, "p-openfill")
    rec = _settled_record(me, rid)
    assert rec["usage"]["completion_tokens"] == LONG, rec["usage"]
    assert rec["usage"]["cost_micros"] == full, (rec["usage"], full)
    assert before - me.balance() == full
    me.assert_books()


def test_openfill_error_after_output_charges_nothing(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    rid = _error_after_output(me, "p-openfill")
    rec = _settled_record(me, rid)
    assert rec["outcome"] == "error"
    assert rec["usage"]["cost_micros"] == 0
    assert me.balance() == before
    me.assert_books()


# -- aigrid ------------------------------------------------------------------------


def test_aigrid_missing_usage_keeps_the_hold_reconciling(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    res = me.stream({"model": "p-aigrid", "max_tokens": 30, "sim": {"omit_usage": True, "output_tokens": 12}})
    assert res.status == 200
    quote = int(res.headers["x-bourse-quote-micros"])
    rid = res.headers["x-request-id"]
    chunk = res.chunks[-1]  # aigrid: the usage without asking, on the terminal chunk
    assert chunk["choices"][0]["finish_reason"], res.kinds()
    assert chunk["receipt"]["outcome"] == "reconciling", chunk["receipt"]
    assert chunk["usage"]["cost_micros"] == 0
    rec = _settled_record(me, rid)
    assert rec["outcome"] == "reconciling" and rec["receipt"]["outcome"] == "reconciling", rec
    holds = me.holds("reconciling")
    assert [h["request_id"] for h in holds] == [rid], holds
    assert holds[0]["amount_micros"] == quote
    view = me.account_view()
    assert view["reconciling_micros"] == quote, view
    assert [h["request_id"] for h in view["reconciling_holds"]] == [rid], view
    assert me.balance() == before - quote
    assert_ledger_balanced(gw)
    me.assert_books()
    # an operator settles it: at most the hold, the rest given back
    r = gw.admin("POST", f"/admin/holds/{holds[0]['id']}/settle", json={})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "settled"
    charged = r.json()["charged_micros"]
    assert 0 < charged <= quote
    assert me.balance() == before - charged
    assert me.holds("reconciling") == []
    assert_ledger_balanced(gw)
    me.assert_books()


# -- gopuram -----------------------------------------------------------------------


def test_gopuram_error_after_output_charges_the_generated_tokens(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    rid = _error_after_output(me, "p-gopuram")
    rec = _settled_record(me, rid)
    assert rec["outcome"] == "error", rec
    assert rec["usage"]["completion_tokens"] == 3, rec["usage"]
    cost = rec["usage"]["cost_micros"]
    assert cost == _tokens(rec) > 0, rec["usage"]
    assert before - me.balance() == cost
    assert [h["state"] for h in me.holds()] == ["settled"]
    me.assert_books()


# -- hips --------------------------------------------------------------------------


def test_hips_receipt_headers_and_object(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    r = me.post({"model": "p-hips", "max_tokens": 20})
    assert r.status_code == 200, r.text
    cost = int(r.headers["x-hips-cost-micros"])
    assert float(r.headers["x-hips-latency-ms"]) > 0
    quote = int(r.headers["x-hips-quote-micros"])
    assert "x-bourse-cost-micros" not in r.headers and "x-bourse-quote-micros" not in r.headers
    body = r.json()
    assert body["usage"]["cost_micros"] == cost == _tokens(body)
    assert body["hips"]["cost_micros"] == cost and body["hips"]["quote"] == quote, body.get("hips")
    assert before - me.balance() == cost

    res = me.stream({"model": "p-hips", "max_tokens": 20, "stream_options": {"include_usage": True}})
    assert int(res.headers["x-hips-quote-micros"]) == quote
    assert "x-bourse-quote-micros" not in res.headers
    chunk = res.chunks[-1]
    assert chunk["choices"] == [] and "receipt" not in chunk, chunk
    hips = chunk["hips"]
    assert {"cost_micros", "latency_ms", "quote"} <= set(hips), hips
    assert hips["quote"] == quote
    assert hips["cost_micros"] == chunk["usage"]["cost_micros"] == _tokens(chunk) > 0
    assert hips["latency_ms"] > 0
    assert me.wait_settled() == []
    assert before - me.balance() == cost + hips["cost_micros"]
    me.assert_books()


# -- any policy: nothing charged before output; one charge after a requeue ----------


@contextmanager
def _occupied_single(gw: Gateway) -> Iterator[None]:
    """The one slot of p-single, taken by another account's slow stream."""
    blocker = caller(gw)
    body = {"model": "p-single", "max_tokens": 200, "sim": {"tokens_per_s": 5, "output_tokens": 200}}
    with blocker.open_stream(body) as s:
        read_until(s, data_chunks=1)
        yield
    assert blocker.wait_settled() == []


def test_disconnect_while_queued_charges_nothing(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    with _occupied_single(gw):
        with me.open_stream({"model": "p-single", "max_tokens": 20}) as s:
            assert s.status == 200
            read_until(s, comment_prefix="queued")
            assert len(me.holds("open")) == 1
        assert me.wait_settled() == []
        assert me.balance() == before
        assert [h["state"] for h in me.holds()] == ["released"]
    me.assert_books()
    assert_ledger_balanced(gw)


def test_book_timeout_charges_nothing(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    with _occupied_single(gw):
        r = me.post({"model": "p-single", "max_tokens": 20, "timeout": 0.5})
        assert_error_envelope(r, 408, "book_timeout")
        res = me.stream({"model": "p-single", "max_tokens": 20}, headers={"x-book-timeout": "0.5"})
        assert res.status == 200
        err = [c for c in res.chunks if "error" in c]
        assert err and err[0]["error"]["code"] == "book_timeout", res.kinds()
        assert me.wait_settled() == []
        assert me.balance() == before
        assert [h["state"] for h in me.holds()] == ["released", "released"]
    me.assert_books()


def test_failure_before_output_then_success_charges_once(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    r = me.post({"model": "p-default", "max_tokens": 20, "sim": {"fail_before_output": 1}})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["x_market"]["requeues"] == 1, usage
    cost = int(r.headers["x-bourse-cost-micros"])
    assert cost == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    assert before - me.balance() == cost
    holds = me.holds()
    assert [(h["state"], h["charged_micros"]) for h in holds] == [("settled", cost)], holds
    res = me.stream(
        {"model": "p-default", "max_tokens": 20, "sim": {"fail_before_output": 2},
         "stream_options": {"include_usage": True}}
    )  # fmt: skip
    assert res.kinds().count("c:requeued (transient backend failure), waiting") == 2, res.kinds()
    scost = res.chunks[-1]["usage"]["cost_micros"]
    assert me.wait_settled() == []
    assert before - me.balance() == cost + scost
    assert len(me.holds()) == 2
    me.assert_books()
    assert_ledger_balanced(gw)
