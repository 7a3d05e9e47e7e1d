"""Which dashboard session may take which operator action: each action mirrors one
admin route (:data:`ACTIONS`), and needs that route's least role in
:data:`bourse.http.admin_roles.LEAST_ROLE` (the one table of who may do what), judged
on the session's role (:func:`session_role`: the admin key's ``owner``, an operator's
own role, read again on each request). An action with no admin route (cancelling
another account's job) names its role here (:data:`OWN_ACTIONS`).

A user session (signed in with an API key) has no operator role: every action here is
403 ``admin_only`` to it, but those a user takes on their own account
(:data:`OWN_ACTIONS`: cancelling their own job). An operator session below the
action's role is 403 ``insufficient_role``, as the admin API answers an operator key.
Every dashboard route that changes something is one of these actions or signs in or
out (:func:`check_complete`, when the routes are built).
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import GatewayError
from bourse.http.admin_roles import LEAST_ROLE
from bourse.http.dashboard.guard import Handler
from bourse.ports.operators import Role, role_at_least
from bourse.services.auth import check_role
from bourse.services.sessions import Session

API = "/dashboard/api"


@dataclass(frozen=True)
class Action:
    """A dashboard route that does what an admin route does."""

    name: str
    """Its name for the page (the audit log's action where it writes one)."""
    method: str
    path: str
    """The dashboard route."""
    mirrors: tuple[str, str]
    """The admin route (method, path) it mirrors: its role, its body, its use case."""

    @property
    def need(self) -> Role:
        return LEAST_ROLE[self.mirrors]


@dataclass(frozen=True)
class OwnAction:
    """A dashboard action with no admin route, which a user session takes on its own
    account; an operator session needs the role ``need``."""

    name: str
    method: str
    path: str
    need: Role


def _a(name: str, method: str, path: str, admin_path: str | None = None) -> Action:
    return Action(name, method, API + path, (method, admin_path or "/admin" + path))


ACTIONS: tuple[Action, ...] = (
    _a("account.read", "GET", "/accounts/{account_id}"),
    _a("account.create", "POST", "/accounts"),
    _a("account.credit", "POST", "/accounts/{account_id}/credit"),
    _a("account.debit", "POST", "/accounts/{account_id}/debit"),
    _a("account.refund", "POST", "/accounts/{account_id}/refund"),
    _a("account.suspend", "POST", "/accounts/{account_id}/suspend"),
    _a("account.resume", "POST", "/accounts/{account_id}/resume"),
    _a("account.close", "POST", "/accounts/{account_id}/close"),
    _a("key.list", "GET", "/keys"),
    _a("key.create", "POST", "/keys"),
    _a("key.update", "PATCH", "/keys/{key_id}"),
    _a("key.revoke", "POST", "/keys/{key_id}/revoke"),
    _a("key.rotate", "POST", "/keys/{key_id}/rotate"),
    _a("hold.settle", "POST", "/holds/{hold_id}/settle"),
    _a("hold.release", "POST", "/holds/{hold_id}/release"),
    _a("market.read", "GET", "/market"),
    _a("market.product.put", "PUT", "/products/{product}"),
    _a("market.product.edit", "PATCH", "/products/{product}"),
    _a("market.product.delete", "DELETE", "/products/{product}"),
)
"""Every operator action of the dashboard, by the admin route it mirrors (the
dashboard's path is the admin path under ``/dashboard/api`` instead of ``/admin``)."""

OWN_ACTIONS: tuple[OwnAction, ...] = (
    OwnAction("job.cancel", "POST", API + "/jobs/{job_id}/cancel", "admin"),
)
"""Cancelling a job: its owner's (a user, their own), or another account's by an ``admin``."""

BY_NAME = {a.name: a for a in ACTIONS}
_EVERY: dict[str, Action | OwnAction] = {**BY_NAME, **{a.name: a for a in OWN_ACTIONS}}


def session_role(s: Session) -> Role | None:
    """The operator role a session acts with; ``None`` for a user session (an API key's).
    A session signed in with the admin key is an ``owner``, as the admin key is on the
    admin API; an operator's has the operator's role."""
    return s.staff_role if s.operator else None


def check(s: Session, action: Action | OwnAction) -> None:
    """403 unless the session's role may take ``action``."""
    role = session_role(s)
    if role is None:
        if isinstance(action, OwnAction):
            return  # the use case keeps a user to their own account
        raise GatewayError(403, "admin_only", "Only an operator may do this from the dashboard.")
    check_role(role, action.need, s.who, "dashboard action")


def allowed(s: Session) -> list[str]:
    """The names of the actions the session may take (the page shows those only)."""
    role = session_role(s)
    if role is None:
        return [a.name for a in OWN_ACTIONS]
    return [a.name for a in _EVERY.values() if role_at_least(role, a.need)]


SESSION_ROUTES = {("POST", API + "/session"), ("POST", API + "/session/end")}
"""Signing in and out: the dashboard's changes that are no operator action."""


def check_complete(routes: list[Route]) -> list[Route]:
    """``routes``, once every one that changes something (a method but GET) is an action
    of :data:`ACTIONS` or signs in or out; RuntimeError naming any other."""
    known = {(a.method, a.path) for a in _EVERY.values()} | SESSION_ROUTES
    stray = [
        (m, r.path)
        for r in routes
        for m in sorted(r.methods or ())
        if m not in ("GET", "HEAD") and (m, r.path) not in known
    ]
    if stray:
        raise RuntimeError(f"dashboard routes with no role in bourse.http.dashboard.roles: {stray}")
    return routes


def needing(name: str, handler: Handler) -> Handler:
    """``handler``, after the role check of the action ``name`` (inside the guard)."""
    action = _EVERY[name]

    async def run(request: Request, s: Session) -> Response:
        check(s, action)
        return await handler(request, s)

    return run
