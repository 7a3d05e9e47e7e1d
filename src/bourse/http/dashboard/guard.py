"""Who may call a dashboard route: the session cookie, the origin check, CSRF, and the
security headers every dashboard response carries.

A route body is written as ``async def handler(request, session)``; :class:`Guard`
wraps it. Reads need a valid session cookie (every session reads: a user its own
account, the admin key and every operator role all of them). Actions (POST) also need
a same-origin request (``Sec-Fetch-Site`` and ``Origin``, when the browser sends
them) and the session's CSRF token in the ``x-csrf-token`` header; an operator's
action also the role it needs (:mod:`bourse.http.dashboard.roles`). Without a
session the answer is 401 ``not_signed_in``; the page then shows the sign-in form.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from bourse.domain.errors import GatewayError
from bourse.services.sessions import Session, Sessions

COOKIE = "bourse_session"
COOKIE_PATH = "/dashboard"
CSRF_HEADER = "x-csrf-token"

CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
        "require-trusted-types-for 'script'",
        "trusted-types 'none'",
    )
)
"""Only the gateway's own files run; no inline script or style, no other origin, and
no HTML built from strings (Trusted Types with no policy)."""

SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}

Handler = Callable[[Request, Session], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


def secure(response: Response) -> Response:
    """``response`` with the dashboard's security headers."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


def not_signed_in() -> GatewayError:
    return GatewayError(
        401, "not_signed_in", "Sign in to the dashboard first (the session ended or is missing)."
    )


def check_same_origin(request: Request) -> None:
    """403 for a request another site made (a cross-site form or script): the browser's
    ``Sec-Fetch-Site``, else its ``Origin`` against the ``Host`` the request came to (the
    host only: behind a TLS proxy the page is https and the gateway sees http)."""
    site = request.headers.get("sec-fetch-site")
    origin = request.headers.get("origin")
    host = request.headers.get("host", "")
    if (site is not None and site not in ("same-origin", "none")) or (
        origin is not None and urlsplit(origin).netloc != host
    ):
        raise GatewayError(403, "cross_site", "The dashboard takes actions from its own pages only.")


def _https(request: Request) -> bool:
    """Whether the page is served over HTTPS (here or by a proxy in front)."""
    return request.url.scheme == "https" or request.headers.get("origin", "").startswith("https://")


def set_cookie(response: Response, request: Request, token: str, max_age_s: int) -> None:
    response.set_cookie(
        COOKIE, token, max_age=max_age_s, path=COOKIE_PATH, httponly=True, samesite="strict",
        secure=_https(request),
    )  # fmt: skip


def clear_cookie(response: Response, request: Request) -> None:
    response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict", secure=_https(request))


class Guard:
    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions

    async def session(self, request: Request) -> Session | None:
        return await self.sessions.resume(request.cookies.get(COOKIE))

    def read(self, handler: Handler) -> Endpoint:
        """A route that needs a session."""

        async def endpoint(request: Request) -> Response:
            session = await self.session(request)
            if session is None:
                raise not_signed_in()
            return secure(await handler(request, session))

        return endpoint

    def action(self, handler: Handler) -> Endpoint:
        """A route that changes something: a session, the same origin and the CSRF token."""

        async def endpoint(request: Request) -> Response:
            check_same_origin(request)
            session = await self.session(request)
            if session is None:
                raise not_signed_in()
            self.sessions.check_csrf(session, request.headers.get(CSRF_HEADER))
            return secure(await handler(request, session))

        return endpoint
