"""The money errors before the book: 402 insufficient_funds (saying how many tokens
the balance affords), 401, 403, and 429 with ``retry-after`` and ``x-ratelimit-*``
for requests/min, tokens/min and concurrent streams. None of them charges or holds.
Over SQLite and PostgreSQL."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.money.support import (
    As,
    assert_ledger_balanced,
    new_caller,
    quote_tokens,
    read_until,
)
from tests.support.bodies import USER
from tests.support.errors import assert_error_envelope
from tests.support.gateway import Gateway, running_gateway

# 1.0 USD per 1M tokens: one micro-USD per token
CONFIG = """
[products.unit]
sim_overrides = true
max_output_tokens = 512
[[products.unit.deployments]]
engine = "sim"
slots = 8
floor = 1.0

[products.other]
sim_overrides = true
[[products.other.deployments]]
engine = "sim"
slots = 8
floor = 1.0
"""


@pytest.fixture(scope="module")
def gw(module_db: str | None) -> Iterator[Gateway]:
    with running_gateway(CONFIG, database=module_db) as g:
        yield g


_n = 0


def caller(gw: Gateway, credit_usd: float = 1.0, **limits: object) -> As:
    global _n
    _n += 1
    return new_caller(gw, f"errors-{_n}", credit_usd, **limits)


def test_402_when_the_balance_cannot_cover_the_hold(gw: Gateway) -> None:
    me = caller(gw, credit_usd=0.0001)  # 100 micro-USD: 100 tokens at 1 USD/1M
    assert me.balance() == 100
    assert quote_tokens(USER, 100) > 100
    r = me.post({"model": "unit", "max_tokens": 100})
    err = assert_error_envelope(r, 402, "insufficient_funds")
    assert re.search(r"\b100 tokens\b", err["message"]), err["message"]
    # a stream is refused the same way: before the book, an HTTP error, not a stream
    rs = me.post({"model": "unit", "max_tokens": 100, "stream": True})
    assert_error_envelope(rs, 402, "insufficient_funds")
    with (
        openai.OpenAI(base_url=gw.v1, api_key=me.key, max_retries=0) as client,
        pytest.raises(openai.APIStatusError) as exc,
    ):
        client.chat.completions.create(model="unit", messages=USER, max_tokens=100)
    assert exc.value.status_code == 402
    assert me.balance() == 100
    assert me.holds() == []
    # a request the balance covers goes through and is charged
    small = quote_tokens(USER, 5)
    assert small <= 100
    ok = me.post({"model": "unit", "max_tokens": 5})
    assert ok.status_code == 200, ok.text
    cost = int(ok.headers["x-bourse-cost-micros"])
    assert me.balance() == 100 - cost
    # and the next refusal counts what is left
    r2 = me.post({"model": "unit", "max_tokens": 100})
    err2 = assert_error_envelope(r2, 402, "insufficient_funds")
    assert re.search(rf"\b{100 - cost} tokens\b", err2["message"]), err2["message"]
    me.assert_books()
    assert_ledger_balanced(gw)


def test_401_for_a_missing_or_wrong_key(gw: Gateway) -> None:
    before = gw.ledger()
    url = gw.url + "/v1/chat/completions"
    body = {"model": "unit", "messages": USER, "max_tokens": 5}
    assert_error_envelope(httpx.post(url, json=body, timeout=10), 401, "invalid_api_key")
    assert_error_envelope(
        httpx.post(url, json=body, headers={"authorization": "Bearer bk_not_a_key"}, timeout=10),
        401,
        "invalid_api_key",
    )
    assert_error_envelope(
        httpx.post(url, json=body, headers={"authorization": "Basic Zm9vOmJhcg=="}, timeout=10),
        401,
        "invalid_api_key",
    )
    for path in ("/v1/account", "/v1/usage"):
        assert_error_envelope(httpx.get(gw.url + path, timeout=10), 401, "invalid_api_key")
        assert_error_envelope(
            httpx.get(gw.url + path, headers={"authorization": "Bearer bk_not_a_key"}, timeout=10),
            401,
            "invalid_api_key",
        )
    with (
        openai.OpenAI(base_url=gw.v1, api_key="bk_not_a_key", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.chat.completions.create(model="unit", messages=USER)
    assert gw.ledger() == before


def test_403_for_a_product_the_key_may_not_use(gw: Gateway) -> None:
    me = caller(gw, products=["other"])
    before = me.balance()
    r = me.post({"model": "unit", "max_tokens": 5})
    assert_error_envelope(r, 403, "model_not_allowed")
    rs = me.post({"model": "unit", "max_tokens": 5, "stream": True})
    assert_error_envelope(rs, 403, "model_not_allowed")
    assert me.balance() == before and me.holds() == []
    ok = me.post({"model": "other", "max_tokens": 5})
    assert ok.status_code == 200, ok.text


def test_403_for_a_user_key_on_admin_and_the_admin_key_on_v1(gw: Gateway) -> None:
    me = caller(gw)
    user = {"authorization": f"Bearer {me.key}"}
    admin = gw.admin_headers
    assert_error_envelope(httpx.get(gw.url + f"/admin/accounts/{me.account}", headers=user, timeout=10), 403)
    assert_error_envelope(
        httpx.post(gw.url + f"/admin/accounts/{me.account}/credit", json={"amount_usd": 100}, headers=user,
                   timeout=10),
        403,
    )  # fmt: skip
    assert_error_envelope(httpx.get(gw.url + "/admin/holds", headers=user, timeout=10), 403)
    assert_error_envelope(
        httpx.post(gw.url + "/admin/keys", json={"account": me.account}, headers=user, timeout=10), 403
    )
    assert me.account_view()["credited_micros"] == 1_000_000
    before = gw.ledger()
    assert_error_envelope(
        httpx.post(
            gw.url + "/v1/chat/completions",
            json={"model": "unit", "messages": USER, "max_tokens": 5},
            headers=admin,
            timeout=10,
        ),
        403,
    )
    assert_error_envelope(httpx.get(gw.url + "/v1/account", headers=admin, timeout=10), 403)
    assert gw.ledger() == before


def _assert_429(r: httpx.Response, *headers: str) -> dict[str, object]:
    err = assert_error_envelope(r, 429, "rate_limited")
    ra = r.headers.get("retry-after")
    assert ra is not None and ra.isdigit() and int(ra) >= 1, dict(r.headers)
    for h in headers:
        assert h in r.headers, (h, dict(r.headers))
    return err


def test_429_over_requests_per_minute(gw: Gateway) -> None:
    me = caller(gw, rpm=2)
    for _ in range(2):
        ok = me.post({"model": "unit", "max_tokens": 5})
        assert ok.status_code == 200, ok.text
        assert ok.headers.get("x-ratelimit-limit-requests") == "2", dict(ok.headers)
    before = me.balance()
    r = me.post({"model": "unit", "max_tokens": 5})
    _assert_429(
        r, "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"
    )
    assert r.headers["x-ratelimit-limit-requests"] == "2"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    # the refill is 2/min: the next request is about 30 s away
    assert 10 <= int(r.headers["retry-after"]) <= 60, r.headers["retry-after"]
    assert me.balance() == before and me.holds("open") == []
    with (
        openai.OpenAI(base_url=gw.v1, api_key=me.key, max_retries=0) as client,
        pytest.raises(openai.RateLimitError),
    ):
        client.chat.completions.create(model="unit", messages=USER, max_tokens=5)


def test_429_over_tokens_per_minute(gw: Gateway) -> None:
    me = caller(gw, tpm=100)
    ok = me.post({"model": "unit", "max_tokens": 90, "sim": {"output_tokens": 90}})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["total_tokens"] >= 90
    before = me.balance()
    r = me.post({"model": "unit", "max_tokens": 50})
    _assert_429(r, "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")
    assert r.headers["x-ratelimit-limit-tokens"] == "100"
    assert int(r.headers["x-ratelimit-remaining-tokens"]) < quote_tokens(USER, 50)
    assert me.balance() == before and me.holds("open") == []


def test_429_over_concurrent_streams(gw: Gateway) -> None:
    me = caller(gw, max_streams=1)
    slow = {"model": "unit", "max_tokens": 60, "sim": {"tokens_per_s": 20, "output_tokens": 60}}
    with me.open_stream(slow) as s:
        assert s.status == 200
        read_until(s, data_chunks=1)
        balance_while_open = me.balance()
        r = me.post({"model": "unit", "max_tokens": 5})
        _assert_429(r, "x-ratelimit-limit-streams")
        assert r.headers["x-ratelimit-limit-streams"] == "1"
        rs = me.post({"model": "unit", "max_tokens": 5, "stream": True})
        _assert_429(rs)
        assert me.balance() == balance_while_open
        assert len(me.holds("open")) == 1
    # the stream ended (disconnect): its place is given back
    assert me.wait_settled() == []
    ok = me.post({"model": "unit", "max_tokens": 5})
    assert ok.status_code == 200, ok.text
    me.assert_books()
    assert_ledger_balanced(gw)
