"""Which dashboard session may take which operator action: each action mirrors one
admin route (:data:`ACTIONS`), and needs that route's least role in
:data:`bourse.http.admin_roles.LEAST_ROLE` (the one table of who may do what), judged
on the session's role (:func:`session_role`).

A user session (signed in with an API key) has no operator role: every action here is
403 ``admin_only`` to it. An operator session below the action's role is 403
``insufficient_role``, as the admin API answers an operator key.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from bourse.domain.errors import GatewayError
from bourse.http.admin_roles import LEAST_ROLE
from bourse.http.dashboard.guard import Handler
from bourse.ports.operators import Role, role_at_least
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
)
"""Every operator action of the dashboard, by the admin route it mirrors (the
dashboard's path is the admin path under ``/dashboard/api`` instead of ``/admin``)."""

BY_NAME = {a.name: a for a in ACTIONS}


def session_role(s: Session) -> Role | None:
    """The operator role a session acts with; ``None`` for a user session (an API key's:
    no operator action at all). An operator session signed in with the admin key is an
    ``owner``, as the admin key is on the admin API."""
    return "owner" if s.operator else None


def check(s: Session, action: Action) -> None:
    """403 unless the session's role may take ``action``."""
    role = session_role(s)
    if role is None:
        raise GatewayError(403, "admin_only", "Only an operator may do this from the dashboard.")
    if not role_at_least(role, action.need):
        raise GatewayError(
            403,
            "insufficient_role",
            f"This action needs the role '{action.need}' or above; this session has '{role}'.",
        )


def allowed(s: Session) -> list[str]:
    """The names of the actions the session may take (the page shows those only)."""
    role = session_role(s)
    return [] if role is None else [a.name for a in ACTIONS if role_at_least(role, a.need)]


def needing(name: str, handler: Handler) -> Handler:
    """``handler``, after the role check of the action ``name`` (inside the guard)."""
    action = BY_NAME[name]

    async def run(request: Request, s: Session) -> Response:
        check(s, action)
        return await handler(request, s)

    return run
