"""The ASGI application factory: routes, error mapping, lifespan.

Routes are thin: read and check the body, hand it to a service, return a response.
No middleware sits on the hot path (no ``BaseHTTPMiddleware``): the two completion
routes are served by :class:`~bourse.http.edge.HotRouter` in front of Starlette, which
serves the rest.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import GatewayError, internal_error
from bourse.http import account, admin, completions, jobs, market
from bourse.http.deps import Services
from bourse.http.edge import HotRouter, store_unavailable
from bourse.http.responses import JSON, error_response
from bourse.ports.stores import StoreUnavailable
from bourse.services.ids import new_request_id

log = logging.getLogger("bourse.http")


def _rid(request: Request) -> str:
    rid: str | None = getattr(request.state, "request_id", None)
    if rid is None:
        rid = new_request_id("chat")
        request.state.request_id = rid
    return rid


def create_app(services: Services) -> HotRouter:
    markets = services.completions.markets

    async def healthz(request: Request) -> Response:
        return JSON({"status": "ok"})

    async def readyz(request: Request) -> Response:
        products = {name: m.healthy() for name, m in markets.items()}
        ready = any(products.values())
        return JSON(
            {"status": "ready" if ready else "unready", "products": products},
            status_code=200 if ready else 503,
        )

    async def on_gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return error_response(exc, _rid(request))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            err = GatewayError(404, "not_found", f"No route {request.method} {request.url.path}.")
        elif exc.status_code == 405:
            err = GatewayError(
                405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}.",
                error_type="invalid_request_error",
            )  # fmt: skip
        else:
            err = GatewayError(exc.status_code, "invalid_request", str(exc.detail))
        return error_response(err, _rid(request))

    async def on_store_unavailable(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StoreUnavailable)
        rid = _rid(request)
        return error_response(store_unavailable(exc, rid), rid)

    async def on_crash(request: Request, exc: Exception) -> Response:
        rid = _rid(request)
        log.error("internal error on request %s", rid, exc_info=exc)
        return error_response(internal_error(rid), rid)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await services.start()
        try:
            yield
        finally:
            await services.stop()

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        GatewayError: on_gateway_error,
        HTTPException: on_http_error,
        StoreUnavailable: on_store_unavailable,
        Exception: on_crash,
    }
    hot = completions.hot_routes(services)
    routes = [
        *completions.routes(hot),
        *market.routes(services),
        *account.routes(services),
        *jobs.routes(services),
        *admin.routes(services),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]
    return HotRouter(Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan), hot)
