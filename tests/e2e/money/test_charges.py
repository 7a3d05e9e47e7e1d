"""A request's charge: its tokens at the cleared price, rounded up once; the balance
moves by exactly that; the receipt (headers, body, usage chunk) agrees with
GET /v1/usage/{id}; GET /v1/usage pages newest first; GET /v1/account shows
balance, open holds and spend. Over SQLite and PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.e2e.money.support import (
    As,
    assert_ledger_balanced,
    expected_cost,
    new_caller,
    quote_tokens,
    read_until,
    usage_of,
)
from tests.support.bodies import USER
from tests.support.gateway import Gateway, running_gateway

FLOOR = 0.37  # 370_000 micro-USD per 1M tokens: most token counts end in a fraction
BID = 0.9

CONFIG = f"""
[products.priced]
sim_overrides = true
max_output_tokens = 512
[[products.priced.deployments]]
engine = "sim"
slots = 8
floor = {FLOOR}
"""


@pytest.fixture(scope="module")
def gw(module_db: str | None) -> Iterator[Gateway]:
    with running_gateway(CONFIG, database=module_db) as g:
        yield g


_n = 0


def caller(gw: Gateway, credit_usd: float = 10.0) -> As:
    global _n
    _n += 1
    return new_caller(gw, f"charges-{_n}", credit_usd)


def test_non_streamed_charge_is_tokens_times_cleared_price_rounded_up_once(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    r = me.post({"model": "priced", "max_tokens": 30, "max_price": BID, "sim": {"output_tokens": 20}})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt, completion, price = usage_of(body)
    assert completion == 20, body["usage"]
    # an empty book: the order pays the floor (second price), not its bid
    assert price == pytest.approx(FLOOR), body["usage"]["x_market"]
    cost = expected_cost(prompt + completion, price)
    per_part = expected_cost(prompt, price) + expected_cost(completion, price)
    assert per_part != cost, "precondition: rounding per part must differ from rounding once here"
    assert body["usage"]["cost_micros"] == cost, (body["usage"], cost)
    assert body["usage"]["cost"] == pytest.approx(cost / 1e6, abs=1e-12), body["usage"]
    assert int(r.headers["x-bourse-cost-micros"]) == cost, dict(r.headers)
    assert body["receipt"]["cost_micros"] == cost, body["receipt"]
    # the hold was the quote: prompt bytes + overheads + max_tokens, at the bid
    quote = expected_cost(quote_tokens(USER, 30), BID)
    assert int(r.headers["x-bourse-quote-micros"]) == quote, dict(r.headers)
    assert body["receipt"]["quote_micros"] == quote, body["receipt"]
    assert cost <= quote
    assert before - me.balance() == cost
    assert me.holds("open") == []
    assert_ledger_balanced(gw)
    me.assert_books()


def test_streamed_charge_is_tokens_times_cleared_price_rounded_up_once(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    res = me.stream(
        {
            "model": "priced",
            "max_tokens": 40,
            "sim": {"output_tokens": 33},
            "stream_options": {"include_usage": True},
        }
    )
    assert res.status == 200, res.raw
    assert res.kinds()[-2:] == ["usage", "DONE"], res.kinds()
    chunk = res.chunks[-1]
    prompt, completion, price = usage_of(chunk)
    assert completion == 33
    cost = expected_cost(prompt + completion, price)
    assert chunk["usage"]["cost_micros"] == cost, chunk["usage"]
    assert chunk["usage"]["cost"] == pytest.approx(cost / 1e6, abs=1e-12)
    assert chunk["receipt"]["cost_micros"] == cost, chunk["receipt"]
    head_quote = int(res.headers["x-bourse-quote-micros"])
    assert chunk["receipt"]["quote_micros"] == head_quote
    assert head_quote == expected_cost(quote_tokens(USER, 40), FLOOR)  # no bid: the default bid, the floor
    assert "x-bourse-cost-micros" not in res.headers  # cost is never in a stream's head
    assert chunk["receipt"]["outcome"] == "completed"
    assert before - me.balance() == cost
    assert me.holds("open") == []
    assert_ledger_balanced(gw)
    me.assert_books()


def test_charges_over_many_requests_add_up_exactly(gw: Gateway) -> None:
    me = caller(gw)
    before = me.balance()
    total = 0
    for n in (1, 2, 3, 7, 11, 19):
        r = me.post({"model": "priced", "max_tokens": 30, "sim": {"output_tokens": n}})
        assert r.status_code == 200, r.text
        prompt, completion, price = usage_of(r.json())
        cost = expected_cost(prompt + completion, price)
        assert int(r.headers["x-bourse-cost-micros"]) == cost
        total += cost
    assert before - me.balance() == total
    assert me.account_view()["spent_micros"] == total
    assert_ledger_balanced(gw)


def test_receipt_agrees_with_usage_record(gw: Gateway) -> None:
    me = caller(gw)
    r = me.post({"model": "priced", "max_tokens": 25})
    assert r.status_code == 200, r.text
    body = r.json()
    rid = r.headers["x-request-id"]
    assert body["id"] == rid
    rec = me.usage(rid)
    assert rec["id"] == rid and rec["model"] == "priced", rec
    assert rec["outcome"] == "completed"
    assert rec["usage"] == body["usage"], (rec["usage"], body["usage"])
    assert rec["receipt"] == body["receipt"], (rec["receipt"], body["receipt"])
    assert (
        int(r.headers["x-bourse-cost-micros"]) == rec["receipt"]["cost_micros"] == rec["usage"]["cost_micros"]
    )
    assert int(r.headers["x-bourse-quote-micros"]) == rec["receipt"]["quote_micros"]
    assert float(r.headers["x-bourse-latency-ms"]) == pytest.approx(rec["receipt"]["latency_ms"])
    assert rec["receipt"]["latency_ms"] > 0

    res = me.stream({"model": "priced", "max_tokens": 25, "stream_options": {"include_usage": True}})
    chunk = res.chunks[-1]
    srid = res.headers["x-request-id"]
    assert chunk["id"] == srid
    srec = me.usage(srid)
    assert srec["usage"] == chunk["usage"], (srec["usage"], chunk["usage"])
    assert srec["receipt"] == chunk["receipt"], (srec["receipt"], chunk["receipt"])
    assert (
        srec["receipt"]["ttft_ms"] is not None and srec["receipt"]["ttft_ms"] <= srec["receipt"]["latency_ms"]
    )

    # another account cannot read it
    other = caller(gw)
    assert other.get(f"/v1/usage/{rid}").status_code == 404
    assert me.get("/v1/usage/chatcmpl-does-not-exist").status_code == 404


def _five_requests(me: As) -> list[str]:
    rids = []
    for _ in range(5):
        r = me.post({"model": "priced", "max_tokens": 5})
        assert r.status_code == 200, r.text
        rids.append(r.headers["x-request-id"])
    return rids


def test_usage_list_is_newest_first(gw: Gateway) -> None:
    me = caller(gw)
    rids = _five_requests(me)
    r = me.get("/v1/usage", params={"limit": 100})
    assert r.status_code == 200, r.text
    page = r.json()
    assert page["object"] == "list" and page["has_more"] is False, page
    assert [d["id"] for d in page["data"]] == rids[::-1], "GET /v1/usage must list the newest request first"


def test_usage_pages_cover_every_record_once(gw: Gateway) -> None:
    me = caller(gw)
    rids = _five_requests(me)
    seen: list[str] = []
    params: dict[str, object] = {"limit": 2}
    for _ in range(10):
        r = me.get("/v1/usage", params=params)
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page["data"]) <= 2
        seen.extend(d["id"] for d in page["data"])
        if not page["has_more"]:
            break
        assert page["next_after"] is not None, page
        params = {"limit": 2, "after": page["next_after"]}
    assert sorted(seen) == sorted(rids), f"paging with next_after lost or repeated records: {seen} vs {rids}"
    assert len(seen) == len(set(seen))


def test_usage_time_filter(gw: Gateway) -> None:
    me = caller(gw)
    t0 = time.time()
    rids = _five_requests(me)
    assert {d["id"] for d in me.get("/v1/usage", params={"since": t0 - 5}).json()["data"]} == set(rids)
    assert me.get("/v1/usage", params={"since": t0 + 3600}).json()["data"] == []
    assert me.get("/v1/usage", params={"until": t0 - 3600}).json()["data"] == []
    assert me.get("/v1/usage", params={"since": "yesterday"}).status_code == 400


def test_account_shows_balance_open_holds_and_spend(gw: Gateway) -> None:
    me = caller(gw, credit_usd=2.0)
    a0 = me.account_view()
    assert a0["balance_micros"] == 2_000_000 and a0["spent_micros"] == 0 and a0["open_holds_micros"] == 0, a0
    r = me.post({"model": "priced", "max_tokens": 30})
    cost = int(r.headers["x-bourse-cost-micros"])
    a1 = me.account_view()
    assert a1["spent_micros"] == cost, a1
    assert a1["balance_micros"] == 2_000_000 - cost == me.balance(), a1
    # while a slow stream runs, its hold shows as an open hold, out of the balance
    with me.open_stream(
        {"model": "priced", "max_tokens": 60, "sim": {"tokens_per_s": 20, "output_tokens": 60}}
    ) as s:
        quote = int(s.headers["x-bourse-quote-micros"])
        read_until(s, data_chunks=1)
        a2 = me.account_view()
        assert a2["open_holds_micros"] == quote, (a2, quote)
        assert a2["balance_micros"] == a1["balance_micros"] - quote, a2
    assert me.wait_settled() == []
    a3 = me.account_view()
    assert a3["open_holds_micros"] == 0
    assert a3["balance_micros"] + a3["spent_micros"] == 2_000_000, a3
    assert 0 < a3["spent_micros"] - cost < quote, a3
    me.assert_books()
    assert_ledger_balanced(gw)
