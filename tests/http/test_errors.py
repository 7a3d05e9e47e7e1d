"""HTTP errors before the 200 (SPEC section 11), from the app in process: the OpenAI
envelope with ``x-request-id`` and no trace, for bad bodies and headers (400), keys
(401, 403), money (402), unknown products, routes and records (404), methods (405)
and sizes (413). A streamed request that fails before the book gets the same HTTP
error, not a stream."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from bourse.http.openapi_operations import OPERATIONS
from tests.http.gateway import MAX_BODY
from tests.support.asgi import InProcessGateway
from tests.support.bodies import USER
from tests.support.errors import assert_error_envelope

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


# -- 400 -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw", [b"{not json", b"", b"[1, 2]", b'"a string"', b'{"model": "default", "messages": ['], ids=repr
)
async def test_malformed_json_is_400(gw: InProcessGateway, raw: bytes) -> None:
    assert_error_envelope(await gw.post(CHAT, content=raw), 400, "invalid_request")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "default", "messages": USER, "max_tokens": "x"}, "max_tokens"),
        ({"model": "default", "messages": "hello"}, "messages"),
        ({"model": "default", "messages": []}, "messages"),
        ({"model": "default", "messages": USER, "stream": "yes please"}, "stream"),
        ({"model": "default", "messages": [{"role": "robot", "content": "hi"}]}, "role"),
        ({"model": 42, "messages": USER}, "model"),
        ({"messages": USER}, "model"),
        ({"model": "default", "messages": USER, "max_tokens": -3}, "max_tokens"),
        ({"model": "default", "messages": USER, "max_price": "cheap"}, "max_price"),
        ({"model": "default", "messages": USER, "n": 2}, "n"),
        ({"model": "default", "messages": USER, "max_price": 0.5}, "max_price"),  # below the floor
        ({"model": "default", "messages": USER, "max_tokens": 10_000}, "max_tokens"),  # over the limit
    ],
    ids=[
        "max_tokens-string",
        "messages-string",
        "messages-empty",
        "stream-string",
        "role-unknown",
        "model-int",
        "model-missing",
        "max_tokens-negative",
        "max_price-string",
        "n-two",
        "max_price-below-floor",
        "max_tokens-over-limit",
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_a_bad_field_is_400_naming_it(
    gw: InProcessGateway, body: dict[str, object], field: str, stream: bool
) -> None:
    if stream and "stream" not in body:
        body = {**body, "stream": True}
    r = await gw.post(CHAT, body)
    err = assert_error_envelope(r, 400, "invalid_request")
    assert field in err["message"], err


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "default", "prompt": ["one", "two"]}, "prompt"),
        ({"model": "default", "prompt": "hi", "best_of": 3}, "best_of"),
        ({"model": "default"}, "prompt"),
    ],
    ids=["two-prompts", "best_of", "prompt-missing"],
)
async def test_a_bad_legacy_completion_is_400(
    gw: InProcessGateway, body: dict[str, object], field: str
) -> None:
    err = assert_error_envelope(await gw.post("/v1/completions", body), 400, "invalid_request")
    assert field in err["message"], err


@pytest.mark.parametrize(
    ("header", "value"), [("X-Max-Price", "cheap"), ("X-Book-Timeout", "soon"), ("X-Max-Price", "-1")]
)
async def test_a_bad_header_is_400_naming_it(gw: InProcessGateway, header: str, value: str) -> None:
    r = await gw.post(CHAT, {"model": "default", "messages": USER}, headers={header: value})
    err = assert_error_envelope(r, 400, "invalid_request")
    assert header in err["message"], err


async def test_a_streamed_request_refused_before_the_book_is_an_http_error(gw: InProcessGateway) -> None:
    res = await gw.sse({"model": "default", "max_tokens": "x"})
    assert res.status == 400
    assert res.frames == []
    assert res.headers["content-type"].startswith("application/json")
    assert res.body_json["error"]["code"] == "invalid_request"
    assert res.headers.get("x-request-id")


# -- 401, 403 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": "Bearer bk_wrong_key"}, {"authorization": "Basic dXNlcjpwYXNz"}],
    ids=["none", "wrong", "not-bearer"],
)
async def test_a_missing_or_wrong_key_is_401(
    gw: InProcessGateway, headers: dict[str, str], stream: bool
) -> None:
    r = await gw.post(
        CHAT, {"model": "default", "messages": USER, "stream": stream}, headers=headers, auth=False
    )
    assert_error_envelope(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("path", ["/v1/account", "/v1/usage", "/v1/jobs"])
async def test_the_account_routes_need_a_key(gw: InProcessGateway, path: str) -> None:
    r = await gw.client.get(path)
    assert_error_envelope(r, 401, "invalid_api_key")


async def test_the_admin_api_needs_the_admin_key(gw: InProcessGateway) -> None:
    r = await gw.client.get("/admin/ledger", headers=gw.headers)
    assert_error_envelope(r, 403, "admin_only")
    r = await gw.client.get("/admin/ledger")
    assert_error_envelope(r, 401, "invalid_api_key")


ADMIN_OPERATIONS = sorted((m, p) for m, p in OPERATIONS if p.startswith("/admin"))


@pytest.mark.parametrize(("method", "path"), ADMIN_OPERATIONS, ids=[f"{m} {p}" for m, p in ADMIN_OPERATIONS])
async def test_a_user_key_gets_403_on_every_admin_route(gw: InProcessGateway, method: str, path: str) -> None:
    """Every admin route of the OpenAPI document (key edits, account suspension and
    closing included), its path parameters naming the caller's own key and account."""
    r = await gw.client.get("/admin/keys", params={"account": gw.account}, headers=gw.admin_headers)
    own_key = r.json()["data"][0]["id"]
    filled = (
        path.replace("{key_id}", own_key).replace("{account_id}", gw.account).replace("{hold_id}", "hold_x")
    )
    r = await gw.client.request(method, filled, json={}, headers=gw.headers)
    assert_error_envelope(r, 403, "admin_only")
    r = await gw.client.get(f"/admin/accounts/{gw.account}", headers=gw.admin_headers)
    assert r.json()["status"] == "active"


async def test_a_key_limited_to_other_products_is_403(gw: InProcessGateway) -> None:
    key = await gw.new_key(products=["hips"])
    r = await gw.post(
        CHAT, {"model": "default", "messages": USER}, headers={"authorization": f"Bearer {key}"}
    )
    err = assert_error_envelope(r, 403, "model_not_allowed")
    assert "default" in err["message"]


# -- 402 --------------------------------------------------------------------------------------


@pytest.fixture
async def poor_key(gw: InProcessGateway) -> AsyncIterator[str]:
    """The key of a new account with 100 micro-USD of credit."""
    yield await gw.new_account("poor-" + os.urandom(4).hex(), 0.0001)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_a_hold_the_balance_cannot_cover_is_402(
    gw: InProcessGateway, poor_key: str, stream: bool
) -> None:
    r = await gw.post(
        CHAT,
        {"model": "default", "messages": USER, "max_tokens": 1000, "stream": stream},
        headers={"authorization": f"Bearer {poor_key}"},
    )
    err = assert_error_envelope(r, 402, "insufficient_funds")
    assert "can afford" in err["message"], err


# -- 404, 405, 413 -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"), [(CHAT, {"messages": USER}), ("/v1/completions", {"prompt": "hi"})]
)
@pytest.mark.parametrize(
    "model", ["no-such-model", "default-a", "default/0"], ids=["unknown", "deployment", "index"]
)
async def test_an_unknown_product_is_404(
    gw: InProcessGateway, path: str, body: dict[str, object], model: str
) -> None:
    err = assert_error_envelope(await gw.post(path, {"model": model, **body}), 404, "model_not_found")
    assert model in err["message"]


@pytest.mark.parametrize(
    "path", ["/v1/usage/chatcmpl-000000000000000000000000", "/v1/jobs/job_000000000000000000000000"]
)
async def test_an_unknown_record_is_404(gw: InProcessGateway, path: str) -> None:
    assert_error_envelope(await gw.get(path), 404, "not_found")


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/nothing-here"), ("POST", "/v2/chat/completions")])
async def test_an_unknown_route_is_404(gw: InProcessGateway, method: str, path: str) -> None:
    r = await gw.client.request(method, path, headers=gw.headers)
    assert_error_envelope(r, 404, "not_found")


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
async def test_a_wrong_method_is_405(gw: InProcessGateway, path: str) -> None:
    err = assert_error_envelope(await gw.get(path), 405, "method_not_allowed")
    assert "GET" in err["message"]


async def test_a_body_over_the_limit_is_413(gw: InProcessGateway) -> None:
    big = [{"role": "user", "content": "x" * MAX_BODY}]
    r = await gw.post(CHAT, {"model": "default", "messages": big})
    err = assert_error_envelope(r, 413, "request_too_large")
    assert str(MAX_BODY) in err["message"]


async def test_a_body_over_the_limit_without_content_length_is_413(gw: InProcessGateway) -> None:
    async def pieces() -> AsyncIterator[bytes]:
        yield b'{"model": "default", "messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY // 512 + 1):
            yield b"y" * 512
        yield b'"}]}'

    r = await gw.client.post(
        CHAT, content=pieces(), headers={**gw.headers, "content-type": "application/json"}
    )
    assert "content-length" not in r.request.headers
    assert_error_envelope(r, 413, "request_too_large")
