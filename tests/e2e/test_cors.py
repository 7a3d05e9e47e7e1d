"""CORS through a served gateway: off by default (a preflight is 405, no CORS headers,
nothing in front of the hot router); with ``[server] cors_origins`` a preflight from
an allowed origin is 204 with the CORS headers on every route, the hot completion
routes included, and answers (errors too) carry ``access-control-allow-origin``."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator

import httpx
import pytest

from bourse.http.edge import HotRouter
from bourse.settings import ConfigError, parse_config
from tests.support.bodies import USER
from tests.support.errors import assert_error_envelope
from tests.support.gateway import Gateway, running_gateway

PRODUCT = '[products.p]\n[[products.p.deployments]]\nengine = "sim"\nslots = 2\n'
APP = "https://app.example.com"
OTHER = "https://evil.example.net"
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/jobs", "/admin/accounts"]


@pytest.fixture(scope="module")
def cors_gw() -> Iterator[Gateway]:
    with running_gateway(f'[server]\ncors_origins = ["{APP}", "http://localhost:3000"]\n' + PRODUCT) as gw:
        yield gw


@pytest.fixture(scope="module")
def plain_gw() -> Iterator[Gateway]:
    with running_gateway(PRODUCT) as gw:
        yield gw


def _preflight(url: str, origin: str, method: str = "POST") -> httpx.Response:
    headers = {
        "origin": origin,
        "access-control-request-method": method,
        "access-control-request-headers": "authorization, content-type, x-stainless-os, idempotency-key",
    }
    return httpx.options(url, headers=headers, timeout=30)


def _cors_headers(r: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.startswith("access-control-")}


@pytest.mark.parametrize("path", ROUTES)
def test_preflight_from_an_allowed_origin_is_204_with_the_cors_headers(cors_gw: Gateway, path: str) -> None:
    r = _preflight(cors_gw.url + path, APP)
    assert r.status_code == 204, (r.status_code, r.text)
    assert r.headers["access-control-allow-origin"] == APP
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-stainless-os", "idempotency-key"} <= allowed
    assert int(r.headers["access-control-max-age"]) > 0
    assert r.headers.get("x-request-id")
    assert "access-control-allow-credentials" not in r.headers


@pytest.mark.parametrize("path", [*ROUTES[:2], "/v1/models"])
def test_preflight_from_another_origin_is_refused(cors_gw: Gateway, path: str) -> None:
    r = _preflight(cors_gw.url + path, OTHER)
    assert_error_envelope(r, 405, "method_not_allowed")
    assert _cors_headers(r) == {}


@pytest.mark.parametrize("path", ROUTES[:2])
def test_cors_is_off_by_default(plain_gw: Gateway, path: str) -> None:
    r = _preflight(plain_gw.url + path, APP)
    assert_error_envelope(r, 405, "method_not_allowed")
    assert _cors_headers(r) == {}
    assert type(plain_gw.container.app()) is HotRouter  # nothing in front of the hot path


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_from_an_allowed_origin_is_readable(cors_gw: Gateway, stream: bool) -> None:
    body = {"model": "p", "messages": USER, "stream": stream, "max_tokens": 5}
    r = httpx.post(
        cors_gw.url + "/v1/chat/completions",
        json=body,
        headers={**cors_gw.headers, "origin": APP},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == APP
    assert r.headers["access-control-expose-headers"] == "*"
    assert "origin" in r.headers["vary"].lower()
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text


def test_an_error_from_an_allowed_origin_is_readable(cors_gw: Gateway) -> None:
    r = httpx.post(
        cors_gw.url + "/v1/completions",
        json={"model": "p", "prompt": "hi"},
        headers={"origin": APP, "authorization": "Bearer nope"},
        timeout=30,
    )
    assert_error_envelope(r, 401)
    assert r.headers["access-control-allow-origin"] == APP


def test_a_request_from_another_origin_gets_no_cors_headers(cors_gw: Gateway) -> None:
    r = httpx.get(cors_gw.url + "/v1/models", headers={**cors_gw.headers, "origin": OTHER}, timeout=30)
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers


def test_any_origin() -> None:
    with running_gateway('[server]\ncors_origins = ["*"]\n' + PRODUCT) as gw:
        r = _preflight(gw.url + "/v1/chat/completions", OTHER)
        assert r.status_code == 204
        assert r.headers["access-control-allow-origin"] == "*"
        got = httpx.get(gw.url + "/v1/models", headers={"origin": OTHER}, timeout=30)
        assert got.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize(
    "origin", ["https://app.example.com/", "app.example.com", "https://app.example.com/path", "ftp://x", ""]
)
def test_an_origin_with_a_path_or_no_scheme_is_a_config_error(origin: str) -> None:
    with pytest.raises(ConfigError, match=r"server\.cors_origins"):
        parse_config(tomllib.loads(f'[server]\ncors_origins = ["{origin}"]\n' + PRODUCT), "t.toml", env={})
