"""CORS for browser clients (``[server] cors_origins``, off by default).

When origins are configured, Starlette's ``CORSMiddleware`` sits in front of the
whole app, the raw hot routes of :mod:`bourse.http.edge` included; when none are,
nothing is added (the app is the :class:`~bourse.http.edge.HotRouter` itself, so the
hot path pays nothing). Authentication is a bearer header, never a cookie, so
credentials are not allowed and any request header may be sent; every response
header (``x-request-id``, receipts, rate limits, ``retry-after``) is readable.

A preflight from an allowed origin gets 204 with the CORS headers (and an
``x-request-id``); one from any other origin is answered as if CORS were off (405
``method_not_allowed``, no CORS headers), so the browser refuses the request.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from bourse.services.ids import new_request_id

ALLOW_METHODS = ("GET", "POST", "DELETE", "OPTIONS")
MAX_AGE_S = 600
"""How long a browser may cache a preflight's answer."""


class Cors(CORSMiddleware):
    """Starlette's CORS middleware with bourse's preflight answers (204; 405 when refused)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            headers = Headers(scope=scope)
            if "origin" in headers and "access-control-request-method" in headers:
                answer = self.preflight_response(request_headers=headers)
                if answer.status_code != 200:
                    await self.app(scope, receive, send)  # refused: as without CORS
                    return
                kept = {
                    k: v for k, v in answer.headers.items() if k not in ("content-length", "content-type")
                }
                kept["x-request-id"] = new_request_id("req")
                await Response(status_code=204, headers=kept)(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def with_cors(app: ASGIApp, origins: Sequence[str]) -> ASGIApp:
    """``app`` behind CORS for ``origins`` (``"*"``: any); ``app`` itself when there are none."""
    if not origins:
        return app
    return Cors(
        app,
        allow_origins=list(origins),
        allow_methods=ALLOW_METHODS,
        allow_headers=["*"],
        expose_headers=["*"],
        max_age=MAX_AGE_S,
    )
