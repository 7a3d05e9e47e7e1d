"""The raw router in front of Starlette: dispatch, error envelopes, body reading."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bourse.domain.errors import GatewayError
from bourse.http.app import route_templates
from bourse.http.edge import HotRoute, HotRouter, read_body
from bourse.http.responses import JSON
from bourse.ports.observer import Caller, NullObserver

pytestmark = pytest.mark.anyio


def _scope(method: str, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "scheme": "http",
        "query_string": b"",
        "headers": headers or [],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }


def _receiver(*bodies: bytes, disconnect: bool = False) -> Receive:
    messages: list[Message] = [
        {"type": "http.request", "body": b, "more_body": i < len(bodies) - 1} for i, b in enumerate(bodies)
    ]
    if disconnect:
        messages = (
            [*messages[:-1], {"type": "http.disconnect"}] if messages else [{"type": "http.disconnect"}]
        )

    async def receive() -> Message:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return receive


async def _call(
    app: ASGIApp, method: str, path: str, body: bytes = b"{}"
) -> tuple[int, dict[str, str], bytes]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await app(_scope(method, path), _receiver(body), send)
    if not sent:
        return 0, {}, b""
    start = sent[0]
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def _starlette() -> Starlette:
    async def other(request: Request) -> Response:
        return JSON({"route": "starlette"})

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSON({"starlette_error": exc.status_code}, status_code=exc.status_code)

    return Starlette(
        routes=[Route("/other", other, methods=["GET"]), Route("/v1/hot", other, methods=["POST"])],
        exception_handlers={HTTPException: on_http_error},
    )


Opener = Callable[[Scope, Receive, Caller], Awaitable[ASGIApp]]


def _router(open_: Opener) -> HotRouter:
    return HotRouter(_starlette(), {"/v1/hot": HotRoute("chat", open_, "/v1/hot")})


async def _ok(scope: Scope, receive: Receive, caller: Caller) -> ASGIApp:
    body = await read_body(receive, None, 1024)
    rid = caller.request_id
    return JSON({"rid": rid, "echo": orjson.loads(body)}, request_id=rid)


async def test_the_hot_route_is_served_without_starlette() -> None:
    status, headers, body = await _call(_router(_ok), "POST", "/v1/hot", b'{"a": 1}')
    doc = orjson.loads(body)
    assert status == 200
    assert doc["echo"] == {"a": 1}
    assert doc["rid"].startswith("chatcmpl-")
    assert headers["x-request-id"] == doc["rid"]


@pytest.mark.parametrize(
    ("method", "path", "expected"), [("GET", "/other", 200), ("GET", "/v1/hot", 405), ("POST", "/nope", 404)]
)
async def test_other_requests_go_to_starlette(method: str, path: str, expected: int) -> None:
    status, _, body = await _call(_router(_ok), method, path)
    assert status == expected
    assert b"rid" not in body


async def test_lifespan_and_other_scopes_go_to_starlette() -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    router = HotRouter(app, {"/v1/hot": HotRoute("chat", _ok, "/v1/hot")})

    async def nothing() -> Message:
        return {"type": "lifespan.startup"}

    async def drop(message: Message) -> None:
        pass

    await router({"type": "lifespan"}, nothing, drop)
    assert seen == ["lifespan"]


async def test_a_gateway_error_is_its_envelope_with_the_request_id() -> None:
    async def refuse(scope: Scope, receive: Receive, caller: Caller) -> ASGIApp:
        raise GatewayError(402, "insufficient_funds", "no money", headers={"x-extra": "1"})

    status, headers, body = await _call(_router(refuse), "POST", "/v1/hot")
    assert status == 402
    assert headers["x-request-id"].startswith("chatcmpl-")
    assert headers["x-extra"] == "1"
    assert headers["content-type"] == "application/json"
    assert orjson.loads(body)["error"]["code"] == "insufficient_funds"


async def test_a_crash_is_a_logged_500_envelope_without_a_trace(caplog: pytest.LogCaptureFixture) -> None:
    async def crash(scope: Scope, receive: Receive, caller: Caller) -> ASGIApp:
        raise RuntimeError("secret internals")

    with caplog.at_level(logging.ERROR, logger="bourse.http"):
        status, headers, body = await _call(_router(crash), "POST", "/v1/hot")
    assert status == 500
    err = orjson.loads(body)["error"]
    assert err["code"] == "internal_error"
    assert headers["x-request-id"] in err["message"]
    assert b"secret internals" not in body and b"Traceback" not in body
    assert any("secret internals" in str(r.exc_info) for r in caplog.records)


class _Failing:
    def __init__(self, after_start: bool) -> None:
        self.started = False
        self.after_start = after_start

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.after_start:
            self.started = True
            await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("relay failed")


async def test_a_response_failing_before_its_head_becomes_a_500_envelope() -> None:
    async def opener(scope: Scope, receive: Receive, caller: Caller) -> ASGIApp:
        return _Failing(after_start=False)

    status, headers, body = await _call(_router(opener), "POST", "/v1/hot")
    assert status == 500
    assert orjson.loads(body)["error"]["code"] == "internal_error"
    assert headers["x-request-id"]


async def test_a_response_failing_after_its_head_propagates_to_the_server() -> None:
    async def opener(scope: Scope, receive: Receive, caller: Caller) -> ASGIApp:
        return _Failing(after_start=True)

    with pytest.raises(RuntimeError, match="relay failed"):
        await _call(_router(opener), "POST", "/v1/hot")


async def test_a_client_gone_before_its_body_gets_no_answer() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await _router(_ok)(_scope("POST", "/v1/hot"), _receiver(disconnect=True), send)
    assert sent == []


async def test_read_body_joins_pieces() -> None:
    assert await read_body(_receiver(b"ab", b"", b"cd"), None, 10) == b"abcd"
    assert await read_body(_receiver(b"abcd"), b"4", 10) == b"abcd"


@pytest.mark.parametrize(
    ("declared", "pieces", "status"),
    [(b"11", [b"x"], 413), (None, [b"123456", b"78901"], 413), (b"ten", [b"x"], 400)],
)
async def test_read_body_limits(declared: bytes | None, pieces: list[bytes], status: int) -> None:
    with pytest.raises(GatewayError) as info:
        await read_body(_receiver(*pieces), declared, 10)
    assert info.value.status == status


# -- the observer ------------------------------------------------------------------------


class _Recorder(NullObserver):
    """Keeps what the edge reports."""

    def __init__(self) -> None:
        self.refusals: list[tuple[str, str, int, str]] = []
        self.responses: list[tuple[str, str, int]] = []

    def refused(self, caller: Caller, status: int, code: str) -> None:
        self.refusals.append((caller.route, caller.request_id, status, code))

    def responded(self, method: str, route: str, status: int, seconds: float, caller: Caller | None) -> None:
        assert seconds >= 0
        self.responses.append((method, route, status))


def _observed(open_: Opener, observer: _Recorder) -> HotRouter:
    app = _starlette()
    return HotRouter(
        app, {"/v1/hot": HotRoute("chat", open_, "/v1/hot", observer)}, observer, route_templates(app.routes)
    )


async def test_the_observer_hears_a_refusal_with_its_route_and_request_id() -> None:
    async def refuse(scope: Scope, receive: Receive, caller: Caller) -> ASGIApp:
        raise GatewayError(402, "insufficient_funds", "no money")

    seen = _Recorder()
    _, headers, _ = await _call(_observed(refuse, seen), "POST", "/v1/hot")
    assert seen.refusals == [("/v1/hot", headers["x-request-id"], 402, "insufficient_funds")]
    assert seen.responses == []


async def test_a_request_id_the_route_renamed_is_the_one_answered_and_heard() -> None:
    """A product's policy renames the request id (``gen-…``) once the route knows the
    product: its refusals carry that id, to the client and to the observer alike."""

    async def renamed(scope: Scope, receive: Receive, caller: Caller) -> ASGIApp:
        caller.request_id = "gen-" + caller.request_id.partition("-")[2]
        raise GatewayError(429, "rate_limited", "slow down", headers={"x-gen-request-id": caller.request_id})

    seen = _Recorder()
    status, headers, _ = await _call(_observed(renamed, seen), "POST", "/v1/hot")
    assert status == 429
    rid = headers["x-request-id"]
    assert rid.startswith("gen-") and headers["x-gen-request-id"] == rid
    assert seen.refusals == [("/v1/hot", rid, 429, "rate_limited")]


async def test_the_observer_hears_a_hot_answer_that_is_not_a_run() -> None:
    seen = _Recorder()
    status, _, _ = await _call(_observed(_ok, seen), "POST", "/v1/hot", b"{}")
    assert status == 200
    assert seen.responses == [("POST", "/v1/hot", 200)] and seen.refusals == []


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("GET", "/other", ("GET", "/other", 200)),
        ("POST", "/nope", ("POST", "other", 404)),
        ("GET", "/v1/hot", ("GET", "/v1/hot", 405)),
    ],
)
async def test_the_observer_hears_other_requests_by_route_template(
    method: str, path: str, expected: tuple[str, str, int]
) -> None:
    seen = _Recorder()
    await _call(_observed(_ok, seen), method, path)
    assert seen.responses == [expected]
