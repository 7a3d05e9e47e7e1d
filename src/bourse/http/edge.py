"""The raw ASGI router in front of Starlette: the hot routes skip its middleware stack.

``POST /v1/chat/completions``, ``POST /v1/completions`` and ``POST /v1/responses``
are the gateway's hot path (one pipeline, :mod:`bourse.http.pipeline`). Going through
Starlette costs a Request object, two exception-middleware layers (each wrapping
``send``), a scan of every route and a task group per response. Here the hot routes
are a dictionary lookup on ``(method, path)`` away; everything else
(other methods on these paths, 404s, lifespan) goes on to the Starlette app, which
still has its own routes and error handlers.

A hot route is a :class:`HotRoute`: ``open(scope, receive, caller)`` reads the
request (its id, route and start in the :class:`~bourse.ports.observer.Caller`, which
the route fills in as it learns who asks for what) and returns the ASGI response to
send. Errors are mapped here exactly as Starlette's handlers in
:mod:`bourse.http.app` map them: a :class:`~bourse.domain.errors.GatewayError`
becomes its JSON envelope, anything else a logged 500 ``internal_error`` envelope
(never a stack trace); every response carries ``x-request-id``.

The observer hears of every response: a run reports its own end (after its
settlement); a hot request answered otherwise is reported here, and every other
request with its route template, status and latency (one wrapped ``send`` on those
routes only).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bourse.domain.errors import GatewayError, internal_error, invalid_request, no_capacity
from bourse.domain.values import immutable
from bourse.http.relay import RunResponse
from bourse.http.responses import error_response
from bourse.ports.observer import NULL_OBSERVER, Caller, Observer
from bourse.ports.stores import StoreUnavailable
from bourse.services.ids import new_request_id
from bourse.wire.requests import check_size

log = logging.getLogger("bourse.http")

Opener = Callable[[Scope, Receive, Caller], Awaitable[ASGIApp]]
"""Reads one request (its id, route and start given) and returns the response to send."""

OTHER_ROUTE = "other"
"""The route label of a request no route matched."""

Templates = Mapping[Any, Sequence[tuple[re.Pattern[str], str]]]
"""A Starlette endpoint -> (path pattern, path template) of each route it serves."""


@immutable
class HotRoute:
    kind: str
    """The request-id kind (``chat``, ``completion``, ``resp``)."""
    open: Opener
    path: str
    """The route template, for the observer (required: every route is counted and logged
    under its own name)."""
    observer: Observer = NULL_OBSERVER


class ClientGone(Exception):
    """The client disconnected before its request body arrived: nothing to answer."""


class _Silent:
    """The response to a client that is gone: nothing is sent."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return None


_SILENT = _Silent()


class HotRouter:
    """ASGI app: the hot POST routes directly, everything else to ``app``.

    ``templates`` maps a Starlette route's endpoint to its path templates, so that the
    observer hears of other requests by route (``/v1/jobs/{job_id}``), never by path."""

    __slots__ = ("_app", "_observer", "_routes", "_templates")

    def __init__(
        self,
        app: ASGIApp,
        routes: Mapping[str, HotRoute],
        observer: Observer = NULL_OBSERVER,
        templates: Templates | None = None,
    ) -> None:
        self._app = app
        self._routes = dict(routes)
        self._observer = observer
        self._templates = dict(templates or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if scope["method"] == "POST":
                route = self._routes.get(scope["path"])
                if route is not None:
                    await serve(route, scope, receive, send)
                    return
            await self._observed(scope, receive, send)
            return
        await self._app(scope, receive, send)

    async def _observed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A request for Starlette, reported with its route template, status and latency."""
        started = time.perf_counter()
        status = 0

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._app(scope, receive, sending)
        except Exception:
            status = status or 500  # the server answers 500 if nothing was sent
            raise
        finally:
            seconds = time.perf_counter() - started
            # nothing sent and no failure: the client left (or the server stopped) first
            self._observer.responded(scope["method"], self._template(scope), status or 499, seconds, None)

    def _template(self, scope: Scope) -> str:
        """The template of the route Starlette matched (it leaves its endpoint in the scope)."""
        found = self._templates.get(scope.get("endpoint"), ())
        if len(found) == 1:
            return found[0][1]
        path: str = scope["path"]
        return next((template for pattern, template in found if pattern.match(path)), OTHER_ROUTE)


async def serve(route: HotRoute, scope: Scope, receive: Receive, send: Send) -> None:
    caller = Caller(new_request_id(route.kind), route.path, time.perf_counter())
    observer = route.observer
    response: ASGIApp
    try:
        response = await route.open(scope, receive, caller)
    except GatewayError as exc:
        rid = caller.request_id  # the route may have renamed it (a product's id prefix)
        response = error_response(exc, rid)
        observer.refused(caller, exc.status, exc.code)
    except ClientGone:
        response = _SILENT
        observer.refused(caller, 499, "client_gone")
    except StoreUnavailable as exc:
        rid = caller.request_id
        unavailable = store_unavailable(exc, rid)
        response = error_response(unavailable, rid)
        observer.refused(caller, unavailable.status, unavailable.code)
    except Exception as exc:
        rid = caller.request_id
        log.error("internal error on request %s", rid, exc_info=exc)
        response = error_response(internal_error(rid), rid)
        observer.refused(caller, 500, "internal_error")
    else:
        if not isinstance(response, RunResponse):  # a run reports its own end
            status: int = getattr(response, "status_code", 200)
            observer.responded("POST", route.path, status, time.perf_counter() - caller.started, caller)
    try:
        await response(scope, receive, send)
    except Exception as exc:
        # a response that has sent its head cannot be replaced: the server closes
        # the connection (as Starlette's ServerErrorMiddleware does)
        if getattr(response, "started", True):
            raise
        rid = caller.request_id
        log.error("internal error on request %s", rid, exc_info=exc)
        await error_response(internal_error(rid), rid)(scope, receive, send)


def store_unavailable(exc: StoreUnavailable, rid: str) -> GatewayError:
    """The 503 of a request whose database transaction could not run (logged, no trace)."""
    log.warning("request %s: the database is unavailable: %s", rid, exc)
    return no_capacity("The ledger's database is unavailable right now; retry shortly.", retry_after_s=2)


async def read_body(receive: Receive, declared: bytes | str | None, limit: int) -> bytes:
    """The request body (``declared``: the content-length header), at most ``limit`` bytes;
    :class:`ClientGone` if the client left first. The one body reader: Starlette routes
    use it too (:func:`bourse.http.deps.read_body`)."""
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
