"""The ASGI application factory: routes, error mapping, lifespan.

Routes are thin: read and check the body, hand it to a service, return a response.
No middleware sits on the hot path (no ``BaseHTTPMiddleware``): the hot routes
(:mod:`bourse.http.pipeline`) are served by :class:`~bourse.http.edge.HotRouter` in front of Starlette, which
serves the rest.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Mount, Route
from starlette.types import ASGIApp, Scope

from bourse.domain.errors import GatewayError, internal_error
from bourse.http import (
    account,
    admin,
    admin_market,
    completions,
    dashboard,
    jobs,
    market,
    market_quote,
    openapi,
    pipeline,
    responses_api,
    usage_csv,
)
from bourse.http.cors import with_cors
from bourse.http.deps import Services
from bourse.http.edge import HotRouter, Templates, store_unavailable
from bourse.http.responses import JSON, error_response
from bourse.ports.stores import StoreUnavailable
from bourse.services.ids import new_request_id
from bourse.services.market import Market

log = logging.getLogger("bourse.http")


def _rid(request: Request) -> str:
    rid: str | None = getattr(request.state, "request_id", None)
    if rid is None:
        rid = new_request_id("chat")
        request.state.request_id = rid
    return rid


def _allowed(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The methods a path takes over every route that matches it: a 405's ``Allow`` (RFC 9110)."""
    methods: set[str] = set()
    for route in routes:
        if isinstance(route, Route) and route.methods and route.matches(scope)[0] is not Match.NONE:
            methods |= route.methods
    return ", ".join(sorted(methods))


def readiness(markets: Mapping[str, Market]) -> tuple[dict[str, bool], list[dict[str, str]]]:
    """``/readyz`` but for the drain: whether each product can serve, and each deployment
    that cannot, with why (its probes, its engine). Ready: some product can serve."""
    products = {name: m.healthy() for name, m in markets.items()}
    unavailable = [
        {"product": name, "deployment": dep, "reason": why}
        for name, m in markets.items()
        for dep, why in m.unavailable_deployments()
    ]
    return products, unavailable


def create_app(services: Services, *, cors_origins: Sequence[str] = ()) -> ASGIApp:
    """The gateway's ASGI app; behind CORS when ``cors_origins`` are given."""
    markets = services.completions.markets

    async def healthz(request: Request) -> Response:
        return JSON({"status": "ok"})

    async def readyz(request: Request) -> Response:
        products, unavailable = readiness(markets)
        ready = any(products.values())
        status = "draining" if services.completions.draining else "ready" if ready else "unready"
        doc = {"status": status, "products": products, "unavailable": unavailable}
        return JSON(doc, status_code=200 if status == "ready" else 503)

    async def metrics(request: Request) -> Response:
        scraped = await services.observer.scrape(request.headers.get("accept"))
        if scraped is None:
            raise GatewayError(404, "not_found", "Metrics are off here ([server] metrics = false).")
        body, content_type = scraped
        return Response(body, headers={"content-type": content_type, "cache-control": "no-store"})

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
                error_type="invalid_request_error", headers={"allow": _allowed(routes, request.scope)},
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
    hot = {**completions.hot_routes(services), **responses_api.hot_routes(services)}
    routes = [
        *pipeline.routes(hot),
        *responses_api.routes(services),
        *market.routes(services),
        *market_quote.routes(services),
        *account.routes(services),
        *jobs.routes(services),
        *admin.routes(services),
        *admin_market.routes(services),
        *usage_csv.routes(services),
        *dashboard.routes(services),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    routes.append(openapi.route(routes))
    starlette = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app = HotRouter(starlette, hot, services.observer, route_templates(routes))
    return with_cors(app, cors_origins)


def route_templates(routes: Sequence[BaseRoute]) -> Templates:
    """Each route's endpoint -> (pattern, path template) of the routes it serves: what the
    observer labels requests with."""
    out: dict[Any, list[tuple[re.Pattern[str], str]]] = {}
    for r in routes:
        if isinstance(r, Route):
            out.setdefault(r.endpoint, []).append((r.path_regex, r.path))
        elif isinstance(r, Mount):
            out.setdefault(r.app, []).append((r.path_regex, r.path + "/*"))
    return out
