"""Routes POST /v1/chat/completions and /v1/completions (with idempotency keys).

They are raw ASGI routes (:mod:`bourse.http.edge`): the headers are read once from
the scope, the body straight from ``receive``.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from bourse.http import idempotency
from bourse.http.deps import Services
from bourse.http.edge import HotRoute, read_body, serve
from bourse.http.relay import RunResponse
from bourse.http.responses import JSON
from bourse.ports.engine import Kind
from bourse.ports.stores import StoredResponse
from bourse.wire.requests import parse_body, validate

PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def hot_routes(services: Services) -> dict[str, HotRoute]:
    """The two completion routes, by path, for :class:`~bourse.http.edge.HotRouter`."""
    completions = services.completions
    auth = services.auth
    store = services.store
    limit = services.max_body_bytes

    async def complete(kind: Kind, scope: Scope, receive: Receive, rid: str) -> ASGIApp:
        t0 = time.perf_counter()
        authorization = idem = max_price = book_timeout = None
        length: bytes | None = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"content-length":
                length = value
            elif name == b"idempotency-key":
                idem = value.decode("latin-1")
            elif name == b"x-max-price":
                max_price = value.decode("latin-1")
            elif name == b"x-book-timeout":
                book_timeout = value.decode("latin-1")
        principal = await auth.user(authorization)
        idem = idempotency.scoped(principal, idem)
        raw = await read_body(receive, length, limit)
        body = parse_body(raw)
        req = validate(kind, body)
        account = principal.account_id
        replay = await idempotency.begin(services, account, idem, kind, raw)
        if replay is not None:
            return replay
        if req.detached:
            try:
                job = await services.jobs.submit(
                    principal, PATHS[kind], body, max_price_header=max_price, timeout_header=book_timeout
                )
            except BaseException:
                await idempotency.forget(services, account, idem)
                raise
            return await idempotency.keep(
                services, account, idem, JSON(job, status_code=202, request_id=job["request_id"])
            )
        try:
            run = await completions.open(
                kind,
                body,
                req,
                principal,
                request_id=rid,
                max_price_header=max_price,
                timeout_header=book_timeout,
                t0=t0,
            )
        except BaseException:
            await idempotency.forget(services, account, idem)
            raise
        if not run.stream:
            run.engine_stream = False  # one answer: the engine may ask its upstream for one
        on_done = None
        if idem is not None:
            key = idem

            async def on_done(status: int, hdrs: dict[str, str], payload: bytes | None) -> None:
                if payload is None:
                    await store.idem_complete(account, key, None)
                else:
                    await store.idem_complete(account, key, StoredResponse(status, hdrs, payload))

        return RunResponse(run, on_done=on_done)

    async def chat(scope: Scope, receive: Receive, rid: str) -> ASGIApp:
        return await complete("chat", scope, receive, rid)

    async def legacy(scope: Scope, receive: Receive, rid: str) -> ASGIApp:
        return await complete("completion", scope, receive, rid)

    return {PATHS["chat"]: HotRoute("chat", chat), PATHS["completion"]: HotRoute("completion", legacy)}


class _Endpoint:
    """A hot route as a Starlette endpoint (a raw ASGI app), for the paths the
    :class:`~bourse.http.edge.HotRouter` does not take (e.g. a mounted root path)."""

    def __init__(self, route: HotRoute) -> None:
        self._route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve(self._route, scope, receive, send)


def routes(hot: dict[str, HotRoute]) -> list[Route]:
    """The same routes for Starlette: other methods get its 405 envelope there."""
    out: list[Any] = [Route(path, _Endpoint(route), methods=["POST"]) for path, route in hot.items()]
    return out
