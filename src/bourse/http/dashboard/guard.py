"""Who may call a dashboard route: the session cookie, the origin check, CSRF, and the
security headers every dashboard response carries.

A route body is written as ``async def handler(request, session)``; :class:`Guard`
wraps it. Reads need a valid session cookie (every session reads: a user its own
account, the admin key and every operator role all of them). Actions (POST) also need
a same-origin request (``Sec-Fetch-Site`` and ``Origin``, when the browser sends
them), the session's CSRF token in the ``x-csrf-token`` header, and the role the
action needs (:func:`bourse.http.admin_roles.dashboard_rule`: the least role of the
admin route doing the same work; 403 ``insufficient_role`` below it, 403
``admin_only`` for a user session on an operator's action). Without a session the
answer is 401 ``not_signed_in``; the page then shows the sign-in form.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from bourse.domain.errors import GatewayError
from bourse.http.admin_roles import DASHBOARD_ACTIONS, dashboard_rule
from bourse.ports.operators import Role
from bourse.services.auth import check_role
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

SIGN_IN = ("POST", "/dashboard/api/session")
"""The one POST route that is no action (it makes the session)."""
_RULE = "bourse.dashboard_rule"


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


def needing(method: str, path: str, endpoint: Endpoint) -> Endpoint:
    """``endpoint``, told the role rule of its action (``Guard.action`` checks it);
    KeyError for an action missing from :data:`~bourse.http.admin_roles.DASHBOARD_ACTIONS`."""
    rule = dashboard_rule(method, path)

    async def run(request: Request) -> Response:
        request.scope[_RULE] = rule
        return await endpoint(request)

    return run


def allow_action(session: Session, rule: tuple[Role, bool] | None) -> None:
    """403 unless ``session`` may take an action of ``rule`` (None: the owner's only)."""
    need, users = rule if rule is not None else ("owner", False)
    if session.operator:
        check_role(session.staff_role, need, session.who, "dashboard action")
    elif not users:
        raise GatewayError(
            403, "admin_only", "This dashboard action is for the admin key and operators, not an API key."
        )


def allowed_actions(session: Session) -> list[str]:
    """The actions ``session`` may take, as ``"POST /dashboard/api/…"`` (the page shows those)."""
    out = []
    for method, path in DASHBOARD_ACTIONS:
        try:
            allow_action(session, dashboard_rule(method, path))
        except GatewayError:
            continue
        out.append(f"{method} {path}")
    return out


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
            allow_action(session, request.scope.get(_RULE))
            return secure(await handler(request, session))

        return endpoint
