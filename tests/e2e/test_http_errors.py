"""HTTP errors before the 200 (SPEC section 11) and the service endpoints, through the
served gateway: the OpenAI envelope, an ``x-request-id`` on every response, no trace."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.bodies import USER
from tests.support.config import Dep, Product
from tests.support.env import Env, start_env
from tests.support.errors import assert_error_envelope
from tests.support.gateway import running_gateway
from tests.support.sse import collect_sse, open_sse

MAX_BODY = 2048


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    products = [
        Product("alpha", [Dep("alpha-a", floor=0.05), Dep("alpha-b", floor=0.07)]),
        Product("beta", [Dep("beta-secret-deployment", floor=0.1)], {"policy": "gopuram"}),
    ]
    with start_env("openai", products, server={"max_body_bytes": MAX_BODY}) as e:
        yield e


def _post(
    env: Env, body: object = None, *, path: str = "/v1/chat/completions", content: bytes | None = None
) -> httpx.Response:
    return env.post(path, body, content=content)


# -- 12. errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_product_is_404_model_not_found(env: Env, stream: bool) -> None:
    r = _post(env, {"model": "no-such-model", "messages": USER, "stream": stream})
    err = assert_error_envelope(r, 404, "model_not_found")
    assert "no-such-model" in err["message"]


def test_unknown_product_legacy_completions_is_404(env: Env) -> None:
    r = _post(env, {"model": "no-such-model", "prompt": "hi"}, path="/v1/completions")
    assert_error_envelope(r, 404, "model_not_found")


def test_unknown_product_sdk_raises_not_found(env: Env) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        env.client().chat.completions.create(model="no-such-model", messages=USER)
    assert info.value.status_code == 404
    assert info.value.code == "model_not_found"


def test_deployment_or_internal_name_is_not_a_product(env: Env) -> None:
    for name in ("alpha-a", "alpha/0", "internal-name"):
        assert_error_envelope(_post(env, {"model": name, "messages": USER}), 404, "model_not_found")


@pytest.mark.parametrize(
    "raw", [b"{not json", b"", b"[1, 2]", b'"a string"', b'{"model": "alpha", "messages": [']
)
def test_malformed_json_is_400(env: Env, raw: bytes) -> None:
    assert_error_envelope(_post(env, content=raw), 400, "invalid_request")


def test_wrong_type_is_400_naming_the_field(env: Env) -> None:
    r = _post(env, {"model": "alpha", "messages": USER, "max_tokens": "x"})
    err = assert_error_envelope(r, 400, "invalid_request")
    assert "max_tokens" in err["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "alpha", "messages": "hello"}, "messages"),
        ({"model": "alpha", "messages": USER, "stream": "yes please"}, "stream"),
        ({"model": "alpha", "messages": [{"role": "robot", "content": "hi"}]}, "role"),
        ({"model": 42, "messages": USER}, "model"),
        ({"messages": USER}, "model"),
        ({"model": "alpha", "messages": USER, "temperature": 0.5, "max_tokens": -3}, "max_tokens"),
    ],
    ids=[
        "messages-string",
        "stream-string",
        "role-unknown",
        "model-int",
        "model-missing",
        "max_tokens-negative",
    ],
)
def test_other_bad_fields_are_400_naming_the_field(env: Env, body: dict[str, object], field: str) -> None:
    err = assert_error_envelope(_post(env, body), 400, "invalid_request")
    assert field in err["message"], err


def test_wrong_type_with_sdk_raises_bad_request(env: Env) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        env.client().chat.completions.create(model="alpha", messages=USER, extra_body={"max_tokens": "x"})
    assert "max_tokens" in info.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_n_other_than_one_is_400(env: Env, stream: bool) -> None:
    r = _post(env, {"model": "alpha", "messages": USER, "n": 2, "stream": stream})
    err = assert_error_envelope(r, 400, "invalid_request")
    assert "n" in err["message"].split(":")[0] or "n=" in err["message"], err


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/jobs"])
def test_body_over_the_limit_is_413_naming_the_limit(env: Env, path: str) -> None:
    big = [{"role": "user", "content": "x" * (MAX_BODY * 2)}]
    err = assert_error_envelope(
        _post(env, {"model": "alpha", "messages": big}, path=path), 413, "request_too_large"
    )
    assert f"the limit is {MAX_BODY} bytes" in err["message"], err


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/jobs"])
def test_body_over_the_limit_without_content_length_is_413(env: Env, path: str) -> None:
    def gen() -> Iterator[bytes]:
        yield b'{"model": "alpha", "messages": [{"role": "user", "content": "'
        for _ in range(8):
            yield b"y" * 512
        yield b'"}]}'

    r = env.post(path, content=gen())
    err = assert_error_envelope(r, 413, "request_too_large")
    assert f"the limit is {MAX_BODY} bytes" in err["message"], err


@pytest.mark.parametrize(
    ("path", "body", "headers"),
    [
        ("/v1/chat/completions", {"max_price": 7.9e201}, {}),
        ("/v1/completions", {"max_price": 1e7, "prompt": "hi"}, {}),
        ("/v1/chat/completions", {}, {"x-max-price": "1e300"}),
        ("/v1/completions", {"detached": True, "max_price": 3.9e195, "prompt": "hi"}, {}),
    ],
    ids=["chat-body", "legacy-body", "header", "detached"],
)
def test_a_bid_over_the_highest_price_is_400(
    env: Env, path: str, body: dict[str, object], headers: dict[str, str]
) -> None:
    """Found by schemathesis: a huge bid made a hold too large for the ledger (a 500)."""
    full = {"model": "alpha", **({"messages": USER} if "prompt" not in body else {}), **body}
    r = env.post(path, full, headers=headers)
    err = assert_error_envelope(r, 400, "invalid_request")
    assert err["param"] in ("max_price", "X-Max-Price"), err
    assert "1000000" in err["message"] or "1e+06" in err["message"], err


def test_unknown_route_is_404_envelope(env: Env) -> None:
    r = env.get("/v1/nothing-here")
    assert_error_envelope(r, 404)
    r = env.post("/v2/chat/completions", {})
    assert_error_envelope(r, 404)


def test_wrong_method_is_an_envelope(env: Env) -> None:
    r = env.get("/v1/chat/completions")
    assert r.status_code in (404, 405)
    assert_error_envelope(r, r.status_code)


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/chat/completions", {"POST"}),
        ("TRACE", "/v1/completions", {"POST"}),
        ("DELETE", "/v1/models", {"GET", "HEAD"}),
        ("PUT", "/admin/accounts", {"GET", "HEAD", "POST"}),  # GET lists the accounts
        ("DELETE", "/v1/jobs", {"GET", "HEAD", "POST"}),
    ],
)
def test_wrong_method_is_405_with_allow(env: Env, method: str, path: str, allowed: set[str]) -> None:
    """RFC 9110: a 405 lists the methods the route takes (found by schemathesis)."""
    r = httpx.request(method, env.url + path, headers=env.auth, timeout=30)
    assert_error_envelope(r, 405, "method_not_allowed")
    assert {m.strip() for m in r.headers["allow"].split(",")} == allowed, r.headers


def test_settling_a_hold_for_more_than_any_amount_is_400() -> None:
    """Found by schemathesis: a huge amount_micros overflowed the database driver (a 500)."""
    slow = '[products.slow]\n[[products.slow.deployments]]\nengine = "sim"\nfloor = 1.0\nttft_ms = 20000\n'
    with running_gateway(slow) as gw, open_sse(gw, {"model": "slow", "max_tokens": 5}, timeout=60):
        # the stream has its 200: its hold is open while the engine thinks
        holds = gw.admin("GET", "/admin/holds", params={"state": "open"}).json()["data"]
        assert len(holds) == 1, holds
        r = gw.admin("POST", f"/admin/holds/{holds[0]['id']}/settle", json={"amount_micros": 2**63})
        err = assert_error_envelope(r, 400, "invalid_request")
        assert err["param"] == "amount_micros", err
        assert gw.admin("GET", "/admin/holds", params={"state": "open"}).json()["data"] == holds


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/chat/completions", {"stream": 0}, "stream"),
        ("/v1/chat/completions", {"max_tokens": "3"}, "max_tokens"),
        ("/v1/chat/completions", {"seed": 1.0}, "seed"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ("/v1/completions", {"echo": "yes"}, "echo"),
    ],
)
def test_a_value_of_another_type_is_400_not_coerced(
    env: Env, path: str, extra: dict[str, object], field: str
) -> None:
    """Found by schemathesis (a schema-invalid body accepted): ``"max_tokens": "3"`` was
    read as 3 for the quote while the raw string went on to the engine."""
    body = {
        "model": "alpha",
        **({"prompt": "hi"} if path == "/v1/completions" else {"messages": USER}),
        **extra,
    }
    err = assert_error_envelope(env.post(path, body), 400, "invalid_request")
    assert err["param"] == field, err


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/admin/accounts", {"id": "typed", "credit_usd": "5"}, "credit_usd"),
        ("/admin/keys", {"account": "test", "rpm": "5"}, "rpm"),
        ("/admin/keys", {"account": "test", "rpm": 5.0}, "rpm"),
    ],
)
def test_an_admin_value_of_another_type_is_400(
    env: Env, path: str, body: dict[str, object], field: str
) -> None:
    err = assert_error_envelope(env.gateway.admin("POST", path, json=body), 400, "invalid_request")
    assert err["param"] == field, err


def test_a_job_value_of_another_type_is_400(env: Env) -> None:
    job = {"endpoint": "/v1/chat/completions", "body": {"model": "alpha", "messages": USER}, "ttl_s": "60"}
    err = assert_error_envelope(env.post("/v1/jobs", job), 400, "invalid_request")
    assert err["param"] == "ttl_s", err


@pytest.mark.parametrize("field", ["rpm", "tpm", "max_streams"])
def test_a_key_limit_over_any_sensible_value_is_400(env: Env, field: str) -> None:
    """Found by probing what schemathesis found: a huge limit overflowed the database driver (a 500)."""
    r = env.gateway.admin("POST", "/admin/keys", json={"account": env.gateway.account, field: 2**63})
    err = assert_error_envelope(r, 400, "invalid_request")
    assert err["param"] == field, err


@pytest.mark.parametrize("limit", ["0", "-1", "1001", "100000000000000000000000000000", "x"])
def test_admin_holds_limit_out_of_range_is_400(env: Env, limit: str) -> None:
    """Found by schemathesis: a huge limit overflowed the database driver (a 500)."""
    r = env.gateway.admin("GET", "/admin/holds", params={"limit": limit})
    err = assert_error_envelope(r, 400, "invalid_request")
    assert err["param"] == "limit", err


def test_bad_headers_are_400(env: Env) -> None:
    r = env.post(
        "/v1/chat/completions", {"model": "alpha", "messages": USER}, headers={"X-Max-Price": "cheap"}
    )
    err = assert_error_envelope(r, 400)
    assert "X-Max-Price" in err["message"]
    r = env.post(
        "/v1/chat/completions", {"model": "alpha", "messages": USER}, headers={"X-Book-Timeout": "soon"}
    )
    err = assert_error_envelope(r, 400)
    assert "X-Book-Timeout" in err["message"]


def test_stream_error_before_the_book_is_http_not_sse(env: Env) -> None:
    res = collect_sse(env, {"model": "alpha", "max_tokens": "x"})
    assert res.status == 400
    assert res.frames == []
    assert res.body_json["error"]["code"] == "invalid_request"
    assert res.headers.get("x-request-id")


# -- 14. models and health -------------------------------------------------------------------------


def test_models_lists_products_only(env: Env) -> None:
    r = env.get("/v1/models")
    assert r.status_code == 200
    ids = [m["id"] for m in r.json()["data"]]
    assert sorted(ids) == ["alpha", "beta"]
    text = r.text
    for hidden in ("alpha-a", "alpha-b", "beta-secret-deployment", "internal-name", "127.0.0.1"):
        assert hidden not in text, hidden


def test_models_with_sdk(env: Env) -> None:
    models = {m.id: m for m in env.client().models.list()}
    assert set(models) == {"alpha", "beta"}
    extra = models["alpha"].model_extra or {}
    assert extra.get("context_length")
    assert extra.get("pricing", {}).get("floor") == 0.05


def test_healthz_and_readyz(env: Env) -> None:
    for path in ("/healthz", "/readyz"):
        r = env.get(path)
        assert r.status_code == 200, (path, r.text)


@pytest.mark.parametrize("path", ["/v1/models", "/healthz", "/readyz"])
def test_service_endpoints_carry_x_request_id(env: Env, path: str) -> None:
    # SPEC section 2: every response carries x-request-id
    r = env.get(path)
    assert r.status_code == 200
    assert r.headers.get("x-request-id"), dict(r.headers)


def test_every_success_carries_x_request_id(env: Env) -> None:
    raw = env.client().chat.completions.with_raw_response.create(model="alpha", messages=USER)
    assert raw.headers.get("x-request-id") == raw.parse().id
    res = collect_sse(env, {"model": "beta"})
    assert res.status == 200 and res.headers.get("x-request-id")
