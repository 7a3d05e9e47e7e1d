"""Signing in and out of the dashboard: ``/dashboard/api/session``.

- ``GET``: who is signed in (``{"signed_in": false}`` when nobody is, with 200, so a
  fresh page does not log an error): the ``role`` (``owner`` for the admin key, an
  operator's role, ``user`` for an API key), the ``operator``'s name and id (null for
  the admin key and users), ``staff`` (admin key or operator), the ``actions`` the
  session may take (their names in :data:`~bourse.http.dashboard.roles.ACTIONS`:
  ``hold.settle``, ``key.create``, …), the account and key of a user, and the
  session's CSRF token;
- ``POST``: sign in with a key sent in the body, as JSON ``{"key": …}`` (the page's
  script) or as a form field ``key`` (the form alone; answered with a redirect).
  The key travels in the body only, never in a URL, and is not kept;
- ``POST /dashboard/api/session/end``: sign out (an action: same origin and the
  CSRF token); the cookie is cleared and the session forgotten.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from bourse.domain.errors import GatewayError, invalid_request
from bourse.http.dashboard.guard import Guard, check_same_origin, clear_cookie, secure, set_cookie
from bourse.http.dashboard.roles import allowed
from bourse.http.deps import read_body
from bourse.http.responses import JSON
from bourse.services.sessions import Session, Sessions
from bourse.wire.requests import parse_json

MAX_SIGN_IN_BYTES = 4096


def whoami(sessions: Sessions, s: Session, products: Collection[str]) -> dict[str, Any]:
    return {
        "signed_in": True,
        "role": s.role,
        "operator": s.operator_name,
        "operator_id": s.operator_id,
        "staff": s.operator,
        "actions": allowed(s),
        "account": s.account_id,
        "key_id": s.key_id,
        "expires_at": s.expires_at,
        "csrf": sessions.csrf_token(s),
        "products": list(products),
    }


def _key_from(raw: bytes, form: bool, max_depth: int) -> str:
    if form:
        values = parse_qs(raw.decode("utf-8", "replace")).get("key", [""])
        return values[0]
    doc = parse_json(raw or b"{}", max_depth)
    key = doc.get("key") if isinstance(doc, dict) else None
    if not isinstance(key, str):
        raise invalid_request("key: expected a string", param="key")
    return key


def routes(guard: Guard, products: Collection[str], max_depth: int) -> list[Route]:
    sessions = guard.sessions

    async def current(request: Request) -> Response:
        s = await guard.session(request)
        if s is None:
            return secure(JSON({"signed_in": False}))
        return secure(JSON(whoami(sessions, s, products)))

    async def sign_in(request: Request) -> Response:
        check_same_origin(request)
        form = request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded")
        key = _key_from(await read_body(request, MAX_SIGN_IN_BYTES), form, max_depth)
        try:
            s, token = await sessions.sign_in(key)
        except GatewayError:
            if form:
                return secure(RedirectResponse("/dashboard#signin-failed", status_code=303))
            raise
        out: Response = (
            RedirectResponse("/dashboard", status_code=303) if form else JSON(whoami(sessions, s, products))
        )
        set_cookie(out, request, token, int(s.expires_at - s.issued_at))
        out.headers["cache-control"] = "no-store"
        return secure(out)

    async def sign_out(request: Request, s: Session) -> Response:
        sessions.sign_out(s)
        out = JSON({"signed_in": False})
        clear_cookie(out, request)
        return out

    return [
        Route("/dashboard/api/session", current, methods=["GET"]),
        Route("/dashboard/api/session", sign_in, methods=["POST"]),
        Route("/dashboard/api/session/end", guard.action(sign_out), methods=["POST"]),
    ]
