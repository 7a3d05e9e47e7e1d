"""Which operator role may call which admin route: :data:`LEAST_ROLE`, the one table
(method and route -> the least role), and the guard every admin route runs first.
The dashboard's actions take their roles from this table too
(:mod:`bourse.http.dashboard.roles`).

Roles rank ``viewer`` < ``billing`` < ``admin`` < ``owner``. Every read is
``viewer``; money (credit, debit, refund, settling or releasing a hold) is
``billing``; accounts, keys and webhook secrets are ``admin``; operators and the
admin key are ``owner``. The admin key is an owner. A route missing from the table
cannot be built (:func:`needing` raises), so no admin route goes unguarded.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from bourse.ports.operators import Role
from bourse.services.auth import Authenticator
from bourse.wire.requests import check_id

LEAST_ROLE: dict[tuple[str, str], Role] = {
    ("GET", "/admin/accounts"): "viewer",
    ("GET", "/admin/accounts/{account_id}"): "viewer",
    ("GET", "/admin/keys"): "viewer",
    ("GET", "/admin/audit"): "viewer",
    ("GET", "/admin/holds"): "viewer",
    ("GET", "/admin/ledger"): "viewer",
    ("GET", "/admin/usage.csv"): "viewer",
    ("GET", "/admin/operators"): "viewer",
    ("POST", "/admin/accounts/{account_id}/credit"): "billing",
    ("POST", "/admin/accounts/{account_id}/debit"): "billing",
    ("POST", "/admin/accounts/{account_id}/refund"): "billing",
    ("POST", "/admin/holds/{hold_id}/settle"): "billing",
    ("POST", "/admin/holds/{hold_id}/release"): "billing",
    ("POST", "/admin/accounts"): "admin",
    ("PATCH", "/admin/accounts/{account_id}"): "admin",
    ("POST", "/admin/accounts/{account_id}/suspend"): "admin",
    ("POST", "/admin/accounts/{account_id}/resume"): "admin",
    ("POST", "/admin/accounts/{account_id}/close"): "admin",
    ("POST", "/admin/accounts/{account_id}/webhook_secret"): "admin",
    ("POST", "/admin/webhook_secrets/reseal"): "admin",
    ("POST", "/admin/keys"): "admin",
    ("PATCH", "/admin/keys/{key_id}"): "admin",
    ("POST", "/admin/keys/{key_id}/revoke"): "admin",
    ("POST", "/admin/keys/{key_id}/rotate"): "admin",
    ("GET", "/admin/market"): "viewer",
    ("POST", "/admin/market"): "admin",
    ("PUT", "/admin/products/{product}"): "admin",
    ("PATCH", "/admin/products/{product}"): "admin",
    ("DELETE", "/admin/products/{product}"): "admin",
    ("POST", "/admin/operators"): "owner",
    ("POST", "/admin/operators/{operator_id}/revoke"): "owner",
    ("POST", "/admin/admin_key/rotate"): "owner",
}

_NEED = "bourse.least_role"
Endpoint = Callable[[Request], Awaitable[Response]]


def needing(method: str, path: str, endpoint: Endpoint) -> Endpoint:
    """``endpoint``, told the least role of its route (:func:`guard` reads it)."""
    need = LEAST_ROLE[(method, path)]

    async def run(request: Request) -> Response:
        request.scope[_NEED] = need
        return await endpoint(request)

    return run


async def guard(auth: Authenticator, request: Request) -> str:
    """Check the caller's key and role against the route's; the actor to audit:
    ``operator:<name>``, or for the admin key ``admin`` (``admin:<name>`` when the caller
    names itself in ``x-bourse-actor``, a label, not a credential)."""
    caller = await auth.admin(request.headers.get("authorization"))
    caller.allow(request.scope.get(_NEED, "owner"))
    if caller.operator is not None:
        return "operator:" + caller.operator.name
    name = request.headers.get("x-bourse-actor")
    return "admin" if not name else "admin:" + check_id(name, "x-bourse-actor", most=64)
