"""The ASGI application factory: routes, error mapping, lifespan.

Routes are thin: read and check the body, hand it to a service, return a response.
No middleware sits on the hot path (no ``BaseHTTPMiddleware``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import GatewayError, internal_error, invalid_request
from bourse.http.relay import RunResponse
from bourse.http.responses import JSON, error_response
from bourse.ports.engine import Kind
from bourse.services.completion import CompletionService
from bourse.services.ids import new_request_id
from bourse.wire.requests import check_size, parse_body, validate

log = logging.getLogger("bourse.http")


class Services(Protocol):
    """What the edge needs from the composition root."""

    completions: CompletionService
    max_body_bytes: int

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            check_size(int(declared), limit)
        except ValueError:
            raise invalid_request("content-length: not a number") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        check_size(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _rid(request: Request) -> str:
    rid: str | None = getattr(request.state, "request_id", None)
    if rid is None:
        rid = new_request_id("chat")
        request.state.request_id = rid
    return rid


def create_app(services: Services) -> Starlette:
    completions = services.completions
    limit = services.max_body_bytes

    async def complete(request: Request, kind: Kind) -> Response | RunResponse:
        t0 = time.perf_counter()
        rid = new_request_id(kind)
        request.state.request_id = rid
        raw = await read_body(request, limit)
        body = parse_body(raw)
        req = validate(kind, body)
        headers = request.headers
        run = completions.prepare(
            kind,
            body,
            req,
            max_price_header=headers.get("x-max-price"),
            timeout_header=headers.get("x-book-timeout"),
            t0=t0,
        )
        run.request_id = rid
        run.submit()
        return RunResponse(run)

    async def chat_completions(request: Request) -> Any:
        return await complete(request, "chat")

    async def completions_legacy(request: Request) -> Any:
        return await complete(request, "completion")

    async def models(request: Request) -> Response:
        data = []
        for name, m in completions.markets.items():
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "bourse",
                    "description": m.description,
                    "context_length": m.context_length,
                    "max_output_tokens": m.max_output_tokens,
                    "pricing": {
                        "unit": "USD per 1M tokens",
                        "floor": m.book.min_floor,
                        "level": m.level(),
                        "default_bid": m.default_bid,
                    },
                    "policy": m.policy.name,
                }
            )
        return JSON({"object": "list", "data": data})

    async def healthz(request: Request) -> Response:
        return JSON({"status": "ok"})

    async def readyz(request: Request) -> Response:
        products = {name: m.healthy() for name, m in completions.markets.items()}
        ready = any(products.values())
        return JSON({"status": "ready" if ready else "unready", "products": products}, status_code=200 if ready else 503)

    async def on_gateway_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return error_response(exc, _rid(request))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            err = GatewayError(404, "not_found", f"No route {request.method} {request.url.path}.")
        elif exc.status_code == 405:
            err = GatewayError(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}.",
                               error_type="invalid_request_error")
        else:
            err = GatewayError(exc.status_code, "invalid_request", str(exc.detail))
        return error_response(err, _rid(request))

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
        Exception: on_crash,
    }
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions_legacy, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
