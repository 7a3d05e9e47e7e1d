"""A job's submit fails as an ordinary HTTP error, with the OpenAI envelope, before any
job exists or any money is held: 401, 402, 403, 429, 400 (endpoint, body field, ttl_s,
webhook_url), 404 unknown model. Webhook targets in private, loopback or link-local
ranges, or with another scheme than http(s), are refused at submit (nothing is sent)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.jobs.support import Jobs, caller, chat_body, text_body
from tests.e2e.money.support import As, assert_ledger_balanced
from tests.support.errors import assert_error_envelope
from tests.support.gateway import Gateway, running_gateway

CONFIG = """
[products.one]
sim_overrides = true
max_output_tokens = 512
[[products.one.deployments]]
engine = "sim"
slots = 2
floor = 1.0

[products.other]
sim_overrides = true
[[products.other.deployments]]
engine = "sim"
slots = 2
floor = 1.0
"""

# loopback allowed for tests; private ranges still refused
LOOPBACK_OK = (
    CONFIG
    + """
[jobs]
allow_loopback_webhooks = true
"""
)


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with running_gateway(CONFIG) as g:
        yield g


def _nothing_happened(gw: Gateway, me: As, jobs: Jobs, balance: int) -> None:
    assert jobs.list()["data"] == [], "a refused submit must not create a job"
    assert me.balance() == balance
    assert me.holds() == [], me.holds()
    assert_ledger_balanced(gw)


def test_401_without_or_with_a_wrong_key(gw: Gateway) -> None:
    doc = {"endpoint": "/v1/chat/completions", "body": chat_body("one")}
    r = httpx.post(gw.url + "/v1/jobs", json=doc, timeout=30)
    assert_error_envelope(r, 401, "invalid_api_key")
    r = httpx.post(gw.url + "/v1/jobs", json=doc, headers={"authorization": "Bearer bk_wrong"}, timeout=30)
    assert_error_envelope(r, 401, "invalid_api_key")
    r = httpx.post(gw.url + "/v1/chat/completions", json={**chat_body("one"), "detached": True},
                   headers={"authorization": "Bearer bk_wrong"}, timeout=30)  # fmt: skip
    assert_error_envelope(r, 401, "invalid_api_key")
    for path in ("/v1/jobs", "/v1/jobs/job_x"):
        assert_error_envelope(httpx.get(gw.url + path, timeout=30), 401, "invalid_api_key")
    assert_error_envelope(httpx.post(gw.url + "/v1/jobs/job_x/cancel", timeout=30), 401, "invalid_api_key")


def test_402_when_the_balance_cannot_cover_the_hold(gw: Gateway) -> None:
    me, jobs = caller(gw, "poor", credit_usd=0.0001)  # 100 micro-USD
    before = me.balance()
    body = chat_body("one", tokens=500)  # ~550 tokens at 1 USD/M = 550 micro-USD
    err = assert_error_envelope(jobs.submit_raw({"endpoint": "/v1/chat/completions", "body": body}), 402,
                                "insufficient_funds")  # fmt: skip
    assert "afford" in err["message"], err
    r = httpx.post(
        gw.url + "/v1/chat/completions", json={**body, "detached": True}, headers=jobs.auth, timeout=30
    )
    assert_error_envelope(r, 402, "insufficient_funds")
    _nothing_happened(gw, me, jobs, before)


def test_403_when_the_key_may_not_use_the_product(gw: Gateway) -> None:
    me, jobs = caller(gw, "limited", products=["other"])
    before = me.balance()
    r = jobs.submit_raw({"endpoint": "/v1/chat/completions", "body": chat_body("one")})
    assert_error_envelope(r, 403, "model_not_allowed")
    _nothing_happened(gw, me, jobs, before)
    # the allowed product works
    job = jobs.submit(chat_body("other", tokens=3))
    assert jobs.wait_status(job["id"], "succeeded", "failed")["status"] == "succeeded"


def test_429_when_the_key_is_over_its_requests_per_minute(gw: Gateway) -> None:
    _me, jobs = caller(gw, "rpm", rpm=1)
    job = jobs.submit(chat_body("one", tokens=3))
    r = jobs.submit_raw({"endpoint": "/v1/chat/completions", "body": chat_body("one", tokens=3)})
    assert_error_envelope(r, 429, "rate_limited")
    assert r.headers.get("retry-after"), dict(r.headers)
    assert jobs.wait_status(job["id"], "succeeded", "failed")["status"] == "succeeded"
    assert [j["id"] for j in jobs.list()["data"]] == [job["id"]]


@pytest.mark.parametrize(
    ("doc", "param", "words"),
    [
        ({"endpoint": "/v1/embeddings", "body": chat_body("one")}, "endpoint", "endpoint"),
        (
            {"endpoint": "/v1/chat/completions", "body": {**chat_body("one"), "messages": "hi"}},
            "messages",
            "messages",
        ),
        (
            {"endpoint": "/v1/chat/completions", "body": {**chat_body("one"), "max_tokens": "many"}},
            "max_tokens",
            "max_tokens",
        ),
        ({"endpoint": "/v1/completions", "body": {"model": "one", "max_tokens": 3}}, "prompt", "prompt"),
        ({"endpoint": "/v1/chat/completions", "body": chat_body("one"), "ttl_s": 0}, "ttl_s", "ttl_s"),
        ({"endpoint": "/v1/chat/completions", "body": chat_body("one"), "ttl_s": -5}, "ttl_s", "ttl_s"),
        (
            {"endpoint": "/v1/chat/completions", "body": chat_body("one"), "ttl_s": 10 * 365 * 86400},
            "ttl_s",
            "ttl_s",
        ),
        ({"endpoint": "/v1/chat/completions", "body": chat_body("one"), "ttl_s": "soon"}, "ttl_s", "ttl_s"),
        ({"endpoint": "/v1/chat/completions"}, "body", "body"),
        ({"body": chat_body("one")}, "endpoint", "endpoint"),
        ({"endpoint": "/v1/chat/completions", "body": chat_body("one"), "colour": "red"}, "colour", "colour"),
    ],
    ids=[
        "endpoint",
        "messages",
        "max_tokens",
        "prompt-missing",
        "ttl-zero",
        "ttl-negative",
        "ttl-too-long",
        "ttl-string",
        "no-body",
        "no-endpoint",
        "unknown-field",
    ],
)
def test_400_names_the_field(gw: Gateway, doc: dict[str, Any], param: str, words: str) -> None:
    me, jobs = caller(gw, "bad")
    before = me.balance()
    err = assert_error_envelope(jobs.submit_raw(doc), 400)
    assert err["param"] == param, err
    assert words in err["message"], err
    _nothing_happened(gw, me, jobs, before)


def test_400_on_a_body_that_is_not_json(gw: Gateway) -> None:
    _me, jobs = caller(gw, "notjson")
    r = httpx.post(gw.url + "/v1/jobs", content=b"{not json", timeout=30,
                   headers={**jobs.auth, "content-type": "application/json"})  # fmt: skip
    assert_error_envelope(r, 400)
    assert jobs.list()["data"] == []


def test_404_unknown_model(gw: Gateway) -> None:
    me, jobs = caller(gw, "nomodel")
    before = me.balance()
    err = assert_error_envelope(
        jobs.submit_raw({"endpoint": "/v1/chat/completions", "body": chat_body("no-such-model")}), 404,
        "model_not_found",
    )  # fmt: skip
    assert "no-such-model" in err["message"], err
    r = httpx.post(gw.url + "/v1/completions", json={**text_body("no-such-model"), "detached": True},
                   headers=jobs.auth, timeout=30)  # fmt: skip
    assert_error_envelope(r, 404, "model_not_found")
    _nothing_happened(gw, me, jobs, before)


PRIVATE_TARGETS = [
    "http://10.1.2.3/hook",
    "http://192.168.1.20:8080/hook",
    "http://172.16.5.4/hook",
    "http://169.254.169.254/latest/meta-data",
    "https://[fd00::1]/hook",
    "http://[::ffff:10.0.0.1]/hook",
    "http://0.0.0.0/hook",
]
LOOPBACK_TARGETS = ["http://127.0.0.1:9/hook", "http://localhost:9/hook", "http://[::1]:9/hook"]
BAD_SCHEMES = ["ftp://127.0.0.1/hook", "file:///etc/passwd", "gopher://10.1.2.3/", "javascript:alert(1)",
               "127.0.0.1/hook", "http://user:pw@127.0.0.1:9/hook"]  # fmt: skip


def _refused(jobs: Jobs, url: str) -> dict[str, Any]:
    r = jobs.submit_raw({"endpoint": "/v1/chat/completions", "body": chat_body("one"), "webhook_url": url})
    err = assert_error_envelope(r, 400, "invalid_request")
    assert err["param"] == "webhook_url", (url, err)
    assert "webhook_url" in err["message"], (url, err)
    return err


def test_private_link_local_and_loopback_webhook_targets_are_refused_at_submit(gw: Gateway) -> None:
    me, jobs = caller(gw, "hooks")
    before = me.balance()
    for url in PRIVATE_TARGETS + LOOPBACK_TARGETS:
        err = _refused(jobs, url)
        assert "private" in err["message"] or "loopback" in err["message"], (url, err)
    for url in BAD_SCHEMES:
        _refused(jobs, url)
    _nothing_happened(gw, me, jobs, before)


def test_allowing_loopback_does_not_allow_private_ranges() -> None:
    with running_gateway(LOOPBACK_OK) as g:
        me, jobs = caller(g, "hooks-lo")
        before = me.balance()
        for url in PRIVATE_TARGETS:
            _refused(jobs, url)
        for url in BAD_SCHEMES:
            _refused(jobs, url)
        _nothing_happened(g, me, jobs, before)
