"""A hypothesis property over hostile sizes, sent to every route: no 500.

The routes are the app's own (its OpenAPI document, and the dashboard's routes, which
the document leaves out); each example sends one request over real HTTP to a gateway
on a loopback port (the bounded HTTP protocol ``bourse serve`` uses): its headers
padded to a drawn size around and past ``[server] max_header_bytes`` (64 KiB), its
body (on a POST) carrying a JSON value nested to a drawn depth around and past
``[server] max_json_depth`` (64), orjson's 254 levels (what it can write) and 1024
(what it can read), in a drawn field. Whatever the route does with it, the answer is
never a 500 nor an ``internal_error`` (in the body or a stream's frames), every error
is the envelope, a head past the limit is a 431 and one well within it is not; after
the examples the books balance.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bourse.http import dashboard
from tests.faults.ledger import read_books
from tests.support.gateway import Gateway, running_gateway

CONFIG = """
[server]
log_level = "warning"

[products.h]
max_output_tokens = 8
[[products.h.deployments]]
engine = "sim"
slots = 8
floor = 0.1
ttft_ms = 0
tokens_per_s = 5000
"""
HEAD_LIMIT = 64 * 1024
DEPTH_LIMIT = 64
HEAD_SLACK = 2048
"""More than the request line and the client's own headers take."""
USER = [{"role": "user", "content": "hi"}]
FIELDS = ["metadata", "x", "messages", "input", "prompt", "body", "tools", "text", "response_format", "key",
          "amount_micros", "products"]  # fmt: skip
PATH_VALUES = {"product": "h", "model": "h"}


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with running_gateway(CONFIG) as g:
        yield g


@pytest.fixture(scope="module")
def routes(gw: Gateway) -> list[tuple[str, str]]:
    """(method, path) of every route: the OpenAPI document's and the dashboard's."""
    doc = httpx.get(gw.url + "/openapi.json", timeout=30).json()
    out = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    for r in dashboard.routes(gw.container):
        out.update((m, r.path) for m in (r.methods or ()) if m != "HEAD")
    assert ("POST", "/v1/responses") in out and ("POST", "/dashboard/api/session") in out, out
    return sorted(out)


def _concrete(path: str) -> str:
    """A path with each parameter given a value (the product ``h``, else a made-up id)."""
    out = []
    for part in path.split("/"):
        if part.startswith("{") and part.endswith("}"):
            name = part[1:-1].split(":")[0]
            part = PATH_VALUES.get(name, "id_x")
        out.append(part)
    return "/".join(out)


def _nested(depth: int, shape: str) -> str:
    """JSON text nested ``depth`` levels (written by hand: no encoder writes 3000)."""
    if depth <= 0:
        return "1"
    if shape == "list":
        return "[" * depth + "1" + "]" * depth
    if shape == "dict":
        return '{"a":' * depth + "1" + "}" * depth
    opens = "".join('{"a":' if i % 2 else "[" for i in range(depth))
    closes = "".join("}" if i % 2 else "]" for i in reversed(range(depth)))
    return opens + "1" + closes


def _base(path: str, stream: bool) -> dict[str, Any]:
    """A body the route would take, before the drawn field is added."""
    chat: dict[str, Any] = {"model": "h", "messages": USER, "max_tokens": 2, "stream": stream}
    bases: dict[str, dict[str, Any]] = {
        "/v1/chat/completions": chat,
        "/v1/completions": {"model": "h", "prompt": "hi", "max_tokens": 2, "stream": stream},
        "/v1/responses": {"model": "h", "input": "hi", "max_output_tokens": 2, "stream": stream},
        "/v1/jobs": {"endpoint": "/v1/chat/completions", "body": {**chat, "stream": False}},
    }
    return bases.get(path, {})


def _body(path: str, stream: bool, field: str, depth: int, shape: str) -> bytes:
    """The route's base body with ``field`` nested so that the body has ``depth`` levels."""
    base = json.dumps(_base(path, stream))
    value = _nested(depth - 1, shape)
    joined = base[:-1] + (", " if base != "{}" else "") + f'"{field}": {value}' + "}"
    return joined.encode()


def _headers(who: str, gw: Gateway, pad: int, count: int) -> dict[str, str]:
    headers = {"content-type": "application/json"}
    if who == "user":
        headers.update(gw.headers)
    elif who == "admin":
        headers.update(gw.admin_headers)
    each, extra = divmod(pad, count)
    for i in range(count):
        headers[f"x-pad-{i}"] = "p" * (each + (extra if i == 0 else 0))
    return headers


_depths = st.one_of(
    st.integers(1, 80),
    st.sampled_from([DEPTH_LIMIT - 1, DEPTH_LIMIT, DEPTH_LIMIT + 1, 128, 129, 253, 254, 255, 1024, 1025]),
    st.integers(1, 3000),
)
_pads = st.one_of(
    st.integers(0, 2048),
    st.integers(HEAD_LIMIT - 4096, HEAD_LIMIT + 4096),
    st.sampled_from([HEAD_LIMIT - HEAD_SLACK, HEAD_LIMIT, HEAD_LIMIT + 1, 4 * HEAD_LIMIT]),
    st.integers(0, 5 * HEAD_LIMIT),
)


# Threads of the in-process gateway (tenacity's and the webhook back-off's jitter) may
# draw from the global ``random`` while hypothesis draws; the requests draw nothing.
@pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    data=st.data(),
    depth=_depths,
    shape=st.sampled_from(["list", "dict", "mixed"]),
    field=st.sampled_from(FIELDS),
    pad=_pads,
    count=st.integers(1, 8),
    who=st.sampled_from(["user", "admin", "none"]),
    stream=st.booleans(),
)
@example(data=None, depth=130 * 2 + 3, shape="dict", field="text", pad=0, count=1, who="user", stream=False)
def test_no_size_of_head_or_nesting_gets_a_500_on_any_route(
    gw: Gateway,
    routes: list[tuple[str, str]],
    data: Any,
    depth: int,
    shape: str,
    field: str,
    pad: int,
    count: int,
    who: str,
    stream: bool,
) -> None:
    method, path = ("POST", "/v1/responses") if data is None else data.draw(st.sampled_from(routes))
    body = _body(path, stream, field, depth, shape) if method == "POST" else None
    with httpx.Client(timeout=30) as client:
        try:
            r = client.request(
                method, gw.url + _concrete(path), content=body, headers=_headers(who, gw, pad, count)
            )
        except httpx.RemoteProtocolError as exc:
            # a head past the limit: the gateway answers 431 and closes; a client still
            # sending its body may see the close first
            assert pad > HEAD_LIMIT - HEAD_SLACK, (method, path, exc)
            return
    where = (method, path, r.status_code, depth, pad)
    assert r.status_code != 500, (where, r.text[:300])
    assert "internal_error" not in r.text, (where, r.text[:300])
    if pad > HEAD_LIMIT:
        assert r.status_code == 431, where
    elif pad < HEAD_LIMIT - HEAD_SLACK:
        assert r.status_code != 431, where
    if r.status_code >= 400:
        assert "error" in r.json(), (where, r.text[:300])


def test_the_books_balance_after_the_property(gw: Gateway) -> None:
    deadline = time.monotonic() + 10
    while True:
        books = read_books(Path(gw.data_dir), None)
        if not books.ids("open") and books.unfinished_jobs == 0:
            break
        assert time.monotonic() < deadline, books
        time.sleep(0.1)
    books.assert_balanced()
