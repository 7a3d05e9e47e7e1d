"""The raw ASGI router in front of Starlette: the hot routes skip its middleware stack.

``POST /v1/chat/completions`` and ``POST /v1/completions`` are the gateway's hot path.
Going through Starlette costs a Request object, two exception-middleware layers
(each wrapping ``send``), a scan of every route and a task group per response. Here
the two routes are a dictionary lookup on ``(method, path)`` away; everything else
(other methods on these paths, 404s, lifespan) goes on to the Starlette app, which
still has its own routes and error handlers.

A hot route is a :class:`HotRoute`: ``open(scope, receive, request_id)`` reads the
request and returns the ASGI response to send. Errors are mapped here exactly as
Starlette's handlers in :mod:`bourse.http.app` map them: a
:class:`~bourse.domain.errors.GatewayError` becomes its JSON envelope, anything else
a logged 500 ``internal_error`` envelope (never a stack trace); every response
carries ``x-request-id``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from bourse.domain.errors import GatewayError, internal_error, invalid_request, no_capacity
from bourse.http.responses import error_response
from bourse.ports.stores import StoreUnavailable
from bourse.services.ids import new_request_id
from bourse.wire.requests import check_size

log = logging.getLogger("bourse.http")

Opener = Callable[[Scope, Receive, str], Awaitable[ASGIApp]]
"""Reads one request (its request id given) and returns the response to send."""


@dataclass(frozen=True, slots=True)
class HotRoute:
    kind: str
    """The request-id kind (``chat``, ``completion``)."""
    open: Opener


class ClientGone(Exception):
    """The client disconnected before its request body arrived: nothing to answer."""


class _Silent:
    """The response to a client that is gone: nothing is sent."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return None


_SILENT = _Silent()


class HotRouter:
    """ASGI app: the hot POST routes directly, everything else to ``app``."""

    __slots__ = ("_app", "_routes")

    def __init__(self, app: ASGIApp, routes: Mapping[str, HotRoute]) -> None:
        self._app = app
        self._routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self._routes.get(scope["path"])
            if route is not None:
                await serve(route, scope, receive, send)
                return
        await self._app(scope, receive, send)


async def serve(route: HotRoute, scope: Scope, receive: Receive, send: Send) -> None:
    rid = new_request_id(route.kind)
    response: ASGIApp
    try:
        response = await route.open(scope, receive, rid)
    except GatewayError as exc:
        response = error_response(exc, rid)
    except ClientGone:
        response = _SILENT
    except StoreUnavailable as exc:
        response = error_response(store_unavailable(exc, rid), rid)
    except Exception as exc:
        log.error("internal error on request %s", rid, exc_info=exc)
        response = error_response(internal_error(rid), rid)
    try:
        await response(scope, receive, send)
    except Exception as exc:
        # a response that has sent its head cannot be replaced: the server closes
        # the connection (as Starlette's ServerErrorMiddleware does)
        if getattr(response, "started", True):
            raise
        log.error("internal error on request %s", rid, exc_info=exc)
        await error_response(internal_error(rid), rid)(scope, receive, send)


def store_unavailable(exc: StoreUnavailable, rid: str) -> GatewayError:
    """The 503 of a request whose database transaction could not run (logged, no trace)."""
    log.warning("request %s: the database is unavailable: %s", rid, exc)
    return no_capacity("The ledger's database is unavailable right now; retry shortly.", retry_after_s=2)


async def read_body(receive: Receive, declared: bytes | None, limit: int) -> bytes:
    """The request body (``declared``: the content-length header), at most ``limit`` bytes."""
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise invalid_request("content-length: not a number") from None
        check_size(n, limit)
    message = await receive()
    if message["type"] != "http.request":
        raise ClientGone
    body: bytes = message.get("body", b"")
    check_size(len(body), limit)
    if not message.get("more_body", False):
        return body
    chunks = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        check_size(size, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
