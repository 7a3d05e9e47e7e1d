"""The dashboard's management routes: what an operator does to accounts and keys from
the page, each one an admin route (:data:`bourse.http.dashboard.roles.ACTIONS`) under a
session instead of a bearer key.

- ``GET /dashboard/api/accounts/{id}``; ``POST /dashboard/api/accounts`` (create, with
  an optional first credit); ``POST …/accounts/{id}/credit|debit|refund`` (debit and
  refund with a reason); ``POST …/accounts/{id}/suspend|resume|close`` (close answers
  the balance left and the keys revoked);
- ``GET /dashboard/api/keys?account=``; ``POST …/keys`` (the secret in the answer,
  once); ``PATCH …/keys/{id}`` (limits, products, spend cap and period, expiry, name);
  ``POST …/keys/{id}/revoke``; ``POST …/keys/{id}/rotate`` (a new secret, once; the old
  one keeps working ``grace_s``).

Each takes the admin route's own body model (the same bounds: 400 past them), calls the
same :class:`~bourse.services.accounts.AdminService` method with the session's actor
(:meth:`~bourse.services.dashboard.Dashboard.actor`), which audits it in the change's
transaction, and needs the admin route's least role (403 otherwise; every action is
403 to a user session). The guard's action checks come first: same origin, the CSRF
token.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.http.admin import (
    AccountStatusChange,
    Adjustment,
    Credit,
    KeyEdit,
    NewAccount,
    NewKey,
    RevokeKey,
    RotateKey,
    key_expiry,
)
from bourse.http.dashboard.guard import Guard, Handler
from bourse.http.dashboard.roles import BY_NAME, needing
from bourse.http.deps import json_model, page_limit
from bourse.http.responses import JSON
from bourse.services.dashboard import Dashboard
from bourse.services.sessions import Session
from bourse.wire.requests import check_id, optional_id

KEYS_PAGE_MAX = 500


def _secret(doc: dict[str, object], status_code: int = 200) -> Response:
    """An answer carrying a secret shown once: never cached."""
    out = JSON(doc, status_code=status_code)
    out.headers["cache-control"] = "no-store"
    return out


def _account_id(request: Request) -> str:
    return check_id(request.path_params["account_id"], "account_id")


def _key_id(request: Request) -> str:
    return check_id(request.path_params["key_id"], "key_id")


class _Manage:
    """The route bodies (each behind the guard and its role check: :func:`routes`)."""

    def __init__(self, dash: Dashboard, max_depth: int) -> None:
        self.admin = dash.admin
        self.actor = dash.actor
        self.max_depth = max_depth

    async def account(self, request: Request, s: Session) -> Response:
        return JSON(await self.admin.account(_account_id(request)))

    async def create_account(self, request: Request, s: Session) -> Response:
        body = await json_model(request, NewAccount, self.max_depth)
        return JSON(await self.admin.create_account(body.id, body.credit_usd, self.actor(s)), status_code=201)

    async def credit(self, request: Request, s: Session) -> Response:
        acc = _account_id(request)
        body = await json_model(request, Credit, self.max_depth)
        return JSON(await self.admin.credit(acc, body.amount_usd, self.actor(s)))

    async def debit(self, request: Request, s: Session) -> Response:
        acc = _account_id(request)
        body = await json_model(request, Adjustment, self.max_depth)
        return JSON(await self.admin.debit(acc, body.amount_usd, body.reason, self.actor(s)))

    async def refund(self, request: Request, s: Session) -> Response:
        acc = _account_id(request)
        body = await json_model(request, Adjustment, self.max_depth)
        return JSON(await self.admin.refund(acc, body.amount_usd, body.reason, self.actor(s)))

    async def suspend(self, request: Request, s: Session) -> Response:
        acc = _account_id(request)
        body = await json_model(request, AccountStatusChange, self.max_depth)
        return JSON(await self.admin.suspend_account(acc, body.reason, self.actor(s)))

    async def resume(self, request: Request, s: Session) -> Response:
        acc = _account_id(request)
        body = await json_model(request, AccountStatusChange, self.max_depth)
        return JSON(await self.admin.resume_account(acc, body.reason, self.actor(s)))

    async def close(self, request: Request, s: Session) -> Response:
        acc = _account_id(request)
        body = await json_model(request, AccountStatusChange, self.max_depth)
        return JSON(await self.admin.close_account(acc, body.reason, self.actor(s)))

    async def keys(self, request: Request, s: Session) -> Response:
        limit = page_limit(request, default=100, most=KEYS_PAGE_MAX)
        q = request.query_params
        rows = await self.admin.keys(optional_id(q.get("account"), "account"), limit + 1,
                                     optional_id(q.get("after"), "after"))  # fmt: skip
        page, more = rows[:limit], len(rows) > limit
        return JSON({"data": page, "has_more": more, "next_after": page[-1]["id"] if more else None})

    async def create_key(self, request: Request, s: Session) -> Response:
        body = await json_model(request, NewKey, self.max_depth)
        admin = self.admin
        out = await admin.create_key(
            body.account, body.products, body.rpm, body.tpm, body.max_streams,
            name=body.name, expires_at=key_expiry(body, admin.now()), spend_cap_usd=body.spend_cap_usd,
            spend_cap_period=body.spend_cap_period, actor=self.actor(s),
        )  # fmt: skip
        return _secret(out, 201)

    async def update_key(self, request: Request, s: Session) -> Response:
        kid = _key_id(request)
        body = await json_model(request, KeyEdit, self.max_depth)
        return JSON(await self.admin.update_key(kid, body.changes(self.admin.now()), self.actor(s)))

    async def revoke_key(self, request: Request, s: Session) -> Response:
        kid = _key_id(request)
        body = await json_model(request, RevokeKey, self.max_depth)
        return JSON(await self.admin.revoke_key(kid, self.actor(s), body.reason))

    async def rotate_key(self, request: Request, s: Session) -> Response:
        kid = _key_id(request)
        body = await json_model(request, RotateKey, self.max_depth)
        return _secret(await self.admin.rotate_key(kid, body.grace_s, self.actor(s)))


def routes(guard: Guard, dash: Dashboard, max_depth: int) -> list[Route]:
    m = _Manage(dash, max_depth)
    handlers: dict[str, Handler] = {
        "account.read": m.account,
        "account.create": m.create_account,
        "account.credit": m.credit,
        "account.debit": m.debit,
        "account.refund": m.refund,
        "account.suspend": m.suspend,
        "account.resume": m.resume,
        "account.close": m.close,
        "key.list": m.keys,
        "key.create": m.create_key,
        "key.update": m.update_key,
        "key.revoke": m.revoke_key,
        "key.rotate": m.rotate_key,
    }
    out = []
    for name, handler in handlers.items():
        action = BY_NAME[name]
        wrap = guard.read if action.method == "GET" else guard.action
        out.append(Route(action.path, wrap(needing(name, handler)), methods=[action.method]))
    return out
