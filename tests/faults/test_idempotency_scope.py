"""An Idempotency-Key belongs to the API key that sent it, over SQLite and PostgreSQL:
a key limited to one product never receives the stored answer that a sibling key of
the same account got for another product (it gets its own 403), on the completion
routes and on jobs; each key still replays its own answers."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.faults.databases import DATABASES, database
from tests.support.errors import assert_error_envelope
from tests.support.gateway import Gateway, running_gateway

CONFIG = """
[server]
log_level = "warning"

[products.sim-fast]
[[products.sim-fast.deployments]]
engine = "sim"
slots = 4
floor = 0.1

[products.sim-load]
[[products.sim-load.deployments]]
engine = "sim"
slots = 4
floor = 0.1
"""
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module", params=DATABASES)
def gw(request: pytest.FixtureRequest) -> Iterator[Gateway]:
    with database(request.param) as dsn, running_gateway(CONFIG, database=dsn) as g:
        yield g


_n = 0


def _siblings(gw: Gateway) -> tuple[dict[str, str], dict[str, str]]:
    """Two keys of one new account: (any product, only sim-fast), as auth headers."""
    global _n
    _n += 1
    account = f"idem-scope-{_n}"
    wide = gw.new_account(account, 5.0)
    narrow = gw.new_key(account, products=["sim-fast"])
    return {"authorization": f"Bearer {wide}"}, {"authorization": f"Bearer {narrow}"}


def _post(gw: Gateway, path: str, body: object, auth: dict[str, str], key: str) -> httpx.Response:
    return httpx.post(gw.url + path, json=body, headers={**auth, "idempotency-key": key}, timeout=30)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": "sim-load", "messages": USER, "max_tokens": 5}),
        ("/v1/completions", {"model": "sim-load", "prompt": "hello", "max_tokens": 5}),
        (
            "/v1/jobs",
            {
                "endpoint": "/v1/chat/completions",
                "body": {"model": "sim-load", "messages": USER, "max_tokens": 5},
            },
        ),
    ],
    ids=["chat", "completions", "jobs"],
)
def test_a_sibling_keys_stored_answer_is_not_replayed_past_the_keys_products(
    gw: Gateway, path: str, body: dict[str, object]
) -> None:
    wide, narrow = _siblings(gw)
    first = _post(gw, path, body, wide, "order-1")
    assert first.status_code in (200, 202), first.text
    again = _post(gw, path, body, wide, "order-1")
    assert again.headers.get("idempotent-replayed") == "true" and again.content == first.content
    # the same Idempotency-Key and body from the key limited to sim-fast: its own request
    r = _post(gw, path, body, narrow, "order-1")
    assert "idempotent-replayed" not in r.headers, (r.status_code, r.text)
    assert_error_envelope(r, 403, "model_not_allowed")


def test_each_key_replays_its_own_answer(gw: Gateway) -> None:
    wide, narrow = _siblings(gw)
    body = {"model": "sim-fast", "messages": USER, "max_tokens": 5}
    a = _post(gw, "/v1/chat/completions", body, narrow, "mine")
    b = _post(gw, "/v1/chat/completions", body, wide, "mine")
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.headers["x-request-id"] != b.headers["x-request-id"]
    for auth, first in ((narrow, a), (wide, b)):
        again = _post(gw, "/v1/chat/completions", body, auth, "mine")
        assert again.headers.get("idempotent-replayed") == "true", again.headers
        assert again.headers["x-request-id"] == first.headers["x-request-id"]


@pytest.mark.parametrize("bad", ["", "x" * 256])
def test_a_malformed_idempotency_key_is_400(gw: Gateway, bad: str) -> None:
    wide, _ = _siblings(gw)
    body = {"model": "sim-fast", "messages": USER, "max_tokens": 5}
    r = httpx.post(
        gw.url + "/v1/chat/completions", json=body, headers={**wide, "idempotency-key": bad}, timeout=30
    )
    assert_error_envelope(r, 400, "invalid_request")
