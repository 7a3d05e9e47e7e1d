"""The admin API (the admin key or an operator key, each route with its least role:
:mod:`bourse.http.admin_roles`): accounts (their spend cap too), credit, keys (created,
edited, revoked, rotated), webhook secrets, holds, operators, the admin key (rotated
with a grace period), the audit log.

Every action is audited under the actor ``operator:<name>``, or for the admin key
``admin`` (``admin:<name>`` when the caller names itself in the ``x-bourse-actor``
header, a label, not a credential). Lists are paged: ``limit`` and ``after`` (the answer's
``next_after``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import invalid_request
from bourse.domain.periods import CapPeriod
from bourse.http.admin_roles import guard, needing
from bourse.http.deps import Services, json_model, page_limit
from bourse.http.responses import JSON
from bourse.ports.operators import Role
from bourse.services.admin_key import DEFAULT_GRACE_S
from bourse.services.keys import MAX_GRACE_S
from bourse.wire.requests import INT64_MAX, IdText, check_id, optional_id

PAGE_MAX = 500
"""The longest page of a list (the stores answer up to 1000 rows: one more tells ``has_more``)."""
INT32_MAX = 2**31 - 1
"""The largest key limit (``rpm``, ``tpm``, ``max_streams``): their columns are INTEGER."""


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class NewAccount(_In):
    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.@:-]+$")
    credit_usd: float = Field(default=0.0, ge=0, le=1e9, allow_inf_nan=False)
    spend_cap_usd: float | None = Field(default=None, gt=0, le=1e9, allow_inf_nan=False)
    """At most this much held or charged by all the account's keys per ``spend_cap_period`` (402 beyond)."""
    spend_cap_period: CapPeriod = "total"


class AccountEdit(_In):
    """The fields to change: the spend cap (``null`` removes it) and its period (not null)."""

    spend_cap_usd: float | None = Field(default=None, gt=0, le=1e9, allow_inf_nan=False)
    spend_cap_period: CapPeriod | None = None

    def changes(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.model_fields_set}


class Credit(_In):
    amount_usd: float = Field(gt=0, le=1e9, allow_inf_nan=False)


class NewKey(_In):
    account: IdText
    products: list[IdText] | None = Field(default=None, max_length=10_000)
    """The products the key may use (each one configured); default all."""
    rpm: int | None = Field(default=None, ge=1, le=INT32_MAX)
    tpm: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_streams: int | None = Field(default=None, ge=1, le=INT32_MAX)
    name: str | None = Field(default=None, min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
    expires_at: float | None = Field(default=None, gt=0, le=1e11, allow_inf_nan=False)
    """Unix time after which the key is refused (401)."""
    expires_in_s: float | None = Field(default=None, gt=0, le=1e10, allow_inf_nan=False)
    """The same, in seconds from now (one of the two)."""
    spend_cap_usd: float | None = Field(default=None, gt=0, le=1e9, allow_inf_nan=False)
    """At most this much held or charged through the key per ``spend_cap_period`` (402 beyond)."""
    spend_cap_period: CapPeriod = "total"


class KeyEdit(_In):
    """The fields to change (any of them; ``null`` clears a limit, the products list,
    the name, the expiry or the spend cap)."""

    products: list[IdText] | None = Field(default=None, max_length=10_000)
    rpm: int | None = Field(default=None, ge=1, le=INT32_MAX)
    tpm: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_streams: int | None = Field(default=None, ge=1, le=INT32_MAX)
    name: str | None = Field(default=None, min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")
    expires_at: float | None = Field(default=None, gt=0, le=1e11, allow_inf_nan=False)
    expires_in_s: float | None = Field(default=None, gt=0, le=1e10, allow_inf_nan=False)
    spend_cap_usd: float | None = Field(default=None, gt=0, le=1e9, allow_inf_nan=False)
    spend_cap_period: CapPeriod | None = None
    """A new period for the cap (its count starts at zero); not null."""

    def changes(self, now: float) -> dict[str, Any]:
        """The fields given, ``expires_in_s`` turned into ``expires_at`` (from ``now``, the
        database's clock)."""
        out = {name: getattr(self, name) for name in self.model_fields_set}
        if "expires_in_s" in out:
            if "expires_at" in out:
                raise invalid_request("expires_at, expires_in_s: give one of the two", param="expires_in_s")
            seconds = out.pop("expires_in_s")
            out["expires_at"] = None if seconds is None else now + seconds
        return out


class Adjustment(_In):
    amount_usd: float = Field(gt=0, le=1e9, allow_inf_nan=False)
    reason: str = Field(min_length=1, max_length=500)
    """Why (kept on the ledger entry and in the audit log)."""


class AccountStatusChange(_In):
    reason: str | None = Field(default=None, max_length=500)
    """The operator's note (kept on the account and in the audit log; not shown to callers)."""


class RevokeKey(_In):
    reason: str | None = Field(default=None, max_length=500)


class RotateKey(_In):
    grace_s: float = Field(default=0.0, ge=0, le=MAX_GRACE_S, allow_inf_nan=False)
    """How long the old secret keeps working (seconds; 0: it stops at once)."""


class RotateAdminKey(_In):
    grace_s: float = Field(default=DEFAULT_GRACE_S, ge=0, le=MAX_GRACE_S, allow_inf_nan=False)
    """How long the old admin key keeps working (seconds; 0: it stops at once; default an hour)."""


class NewOperator(_In):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$")
    """The operator's name (the audit log's actor is ``operator:<name>``); taken for good."""
    role: Role


class SettleHold(_In):
    amount_micros: int | None = Field(default=None, ge=0, le=INT64_MAX)
    """What to charge, at most the hold (default: its usage estimate, else the whole hold)."""


def _page(data: list[dict[str, Any]], limit: int, cursor: str) -> dict[str, Any]:
    """A list answer from ``limit + 1`` rows: ``data``, ``has_more``, ``next_after``."""
    page = data[:limit]
    more = len(data) > limit
    return {
        "object": "list",
        "data": page,
        "has_more": more,
        "next_after": page[-1][cursor] if more else None,
    }


def _query_id(request: Request, name: str) -> str | None:
    return optional_id(request.query_params.get(name), name)


def key_expiry(body: NewKey, now: float) -> float | None:
    """A new key's expiry: ``expires_at``, or ``expires_in_s`` from ``now`` (one of the two)."""
    if body.expires_at is not None and body.expires_in_s is not None:
        raise invalid_request("expires_at, expires_in_s: give one of the two", param="expires_in_s")
    if body.expires_in_s is not None:
        return now + body.expires_in_s
    return body.expires_at


class _AdminRoutes:
    """The admin API's endpoints (each one checks the caller's key and role first)."""

    def __init__(self, services: Services) -> None:
        self.auth = services.auth
        self.admin = services.admin
        self.max_depth = services.max_json_depth

    async def guard(self, request: Request) -> str:
        """Check the caller's key and role (:mod:`bourse.http.admin_roles`); the actor to audit."""
        return await guard(self.auth, request)

    async def create_account(self, request: Request) -> Response:
        actor = await self.guard(request)
        body = await json_model(request, NewAccount, self.max_depth)
        out = await self.admin.create_account(
            body.id,
            body.credit_usd,
            actor,
            spend_cap_usd=body.spend_cap_usd,
            spend_cap_period=body.spend_cap_period,
        )
        return JSON(out, status_code=201)

    async def update_account(self, request: Request) -> Response:
        actor = await self.guard(request)
        account = check_id(request.path_params["account_id"], "account_id")
        body = await json_model(request, AccountEdit, self.max_depth)
        return JSON(await self.admin.update_account(account, body.changes(), actor))

    async def list_accounts(self, request: Request) -> Response:
        await self.guard(request)
        limit = page_limit(request, default=100, most=PAGE_MAX)
        rows = await self.admin.accounts(limit + 1, _query_id(request, "after"))
        return JSON(_page(rows, limit, "id"))

    async def get_account(self, request: Request) -> Response:
        await self.guard(request)
        return JSON(await self.admin.account(check_id(request.path_params["account_id"], "account_id")))

    async def credit(self, request: Request) -> Response:
        actor = await self.guard(request)
        account = check_id(request.path_params["account_id"], "account_id")
        body = await json_model(request, Credit, self.max_depth)
        return JSON(await self.admin.credit(account, body.amount_usd, actor))

    async def debit(self, request: Request) -> Response:
        actor = await self.guard(request)
        account = check_id(request.path_params["account_id"], "account_id")
        body = await json_model(request, Adjustment, self.max_depth)
        return JSON(await self.admin.debit(account, body.amount_usd, body.reason, actor))

    async def refund(self, request: Request) -> Response:
        actor = await self.guard(request)
        account = check_id(request.path_params["account_id"], "account_id")
        body = await json_model(request, Adjustment, self.max_depth)
        return JSON(await self.admin.refund(account, body.amount_usd, body.reason, actor))

    async def suspend(self, request: Request) -> Response:
        actor = await self.guard(request)
        account = check_id(request.path_params["account_id"], "account_id")
        body = await json_model(request, AccountStatusChange, self.max_depth)
        return JSON(await self.admin.suspend_account(account, body.reason, actor))

    async def resume(self, request: Request) -> Response:
        actor = await self.guard(request)
        account = check_id(request.path_params["account_id"], "account_id")
        body = await json_model(request, AccountStatusChange, self.max_depth)
        return JSON(await self.admin.resume_account(account, body.reason, actor))

    async def close(self, request: Request) -> Response:
        actor = await self.guard(request)
        account = check_id(request.path_params["account_id"], "account_id")
        body = await json_model(request, AccountStatusChange, self.max_depth)
        return JSON(await self.admin.close_account(account, body.reason, actor))

    async def create_key(self, request: Request) -> Response:
        actor = await self.guard(request)
        body = await json_model(request, NewKey, self.max_depth)
        out = await self.admin.create_key(
            body.account, body.products, body.rpm, body.tpm, body.max_streams,
            name=body.name, expires_at=key_expiry(body, self.admin.now()), spend_cap_usd=body.spend_cap_usd,
            spend_cap_period=body.spend_cap_period, actor=actor,
        )  # fmt: skip
        return JSON(out, status_code=201)

    async def list_keys(self, request: Request) -> Response:
        await self.guard(request)
        limit = page_limit(request, default=100, most=PAGE_MAX)
        rows = await self.admin.keys(_query_id(request, "account"), limit + 1, _query_id(request, "after"))
        return JSON(_page(rows, limit, "id"))

    async def revoke_key(self, request: Request) -> Response:
        actor = await self.guard(request)
        key_id = check_id(request.path_params["key_id"], "key_id")
        body = await json_model(request, RevokeKey, self.max_depth)
        return JSON(await self.admin.revoke_key(key_id, actor, body.reason))

    async def update_key(self, request: Request) -> Response:
        actor = await self.guard(request)
        key_id = check_id(request.path_params["key_id"], "key_id")
        body = await json_model(request, KeyEdit, self.max_depth)
        return JSON(await self.admin.update_key(key_id, body.changes(self.admin.now()), actor))

    async def rotate_key(self, request: Request) -> Response:
        actor = await self.guard(request)
        key_id = check_id(request.path_params["key_id"], "key_id")
        body = await json_model(request, RotateKey, self.max_depth)
        return JSON(await self.admin.rotate_key(key_id, body.grace_s, actor))

    async def audit(self, request: Request) -> Response:
        await self.guard(request)
        limit = page_limit(request, default=100, most=PAGE_MAX)
        rows = await self.admin.audit_log(
            _query_id(request, "action"), _query_id(request, "target"), limit + 1, _query_id(request, "after")
        )
        return JSON(_page(rows, limit, "id"))

    async def holds(self, request: Request) -> Response:
        await self.guard(request)
        state = request.query_params.get("state")
        if state not in (None, "open", "settled", "released", "reconciling"):
            raise invalid_request("state: expected open, settled, released or reconciling", param="state")
        account = _query_id(request, "account")
        limit = page_limit(request, default=100, most=1000)
        st: Literal["open", "settled", "released", "reconciling"] | None = state  # type: ignore[assignment]
        return JSON({"object": "list", "data": await self.admin.holds(st, account, limit)})

    async def settle(self, request: Request) -> Response:
        actor = await self.guard(request)
        hold_id = check_id(request.path_params["hold_id"], "hold_id")
        body = await json_model(request, SettleHold, self.max_depth)
        return JSON(await self.admin.settle_hold(hold_id, body.amount_micros, actor))

    async def release(self, request: Request) -> Response:
        actor = await self.guard(request)
        return JSON(await self.admin.release_hold(check_id(request.path_params["hold_id"], "hold_id"), actor))

    async def webhook_secret(self, request: Request) -> Response:
        actor = await self.guard(request)
        account = check_id(request.path_params["account_id"], "account_id")
        return JSON(await self.admin.new_webhook_secret(account, actor))

    async def reseal(self, request: Request) -> Response:
        actor = await self.guard(request)
        return JSON(await self.admin.reseal_webhook_secrets(actor))

    async def create_operator(self, request: Request) -> Response:
        actor = await self.guard(request)
        body = await json_model(request, NewOperator, self.max_depth)
        return JSON(await self.admin.create_operator(body.name, body.role, actor), status_code=201)

    async def list_operators(self, request: Request) -> Response:
        await self.guard(request)
        return JSON({"object": "list", "data": await self.admin.list_operators()})

    async def revoke_operator(self, request: Request) -> Response:
        actor = await self.guard(request)
        operator_id = check_id(request.path_params["operator_id"], "operator_id")
        return JSON(await self.admin.revoke_operator(operator_id, actor))

    async def rotate_admin_key(self, request: Request) -> Response:
        actor = await self.guard(request)
        body = await json_model(request, RotateAdminKey, self.max_depth)
        return JSON(await self.admin.rotate_admin_key(body.grace_s, actor))

    async def totals(self, request: Request) -> Response:
        await self.guard(request)
        t = await self.admin.store.totals()
        return JSON(
            {
                "credits_micros": t.credits_micros,
                "balances_micros": t.balances_micros,
                "holds_micros": t.holds_micros,
                "revenue_micros": t.revenue_micros,
                "balanced": t.balanced,
            }
        )


def routes(services: Services) -> list[Route]:
    a = _AdminRoutes(services)
    plain = [
        Route("/admin/accounts", a.create_account, methods=["POST"]),
        Route("/admin/accounts", a.list_accounts, methods=["GET"]),
        Route("/admin/accounts/{account_id}", a.get_account, methods=["GET"]),
        Route("/admin/accounts/{account_id}", a.update_account, methods=["PATCH"]),
        Route("/admin/accounts/{account_id}/credit", a.credit, methods=["POST"]),
        Route("/admin/accounts/{account_id}/debit", a.debit, methods=["POST"]),
        Route("/admin/accounts/{account_id}/refund", a.refund, methods=["POST"]),
        Route("/admin/accounts/{account_id}/suspend", a.suspend, methods=["POST"]),
        Route("/admin/accounts/{account_id}/resume", a.resume, methods=["POST"]),
        Route("/admin/accounts/{account_id}/close", a.close, methods=["POST"]),
        Route("/admin/accounts/{account_id}/webhook_secret", a.webhook_secret, methods=["POST"]),
        Route("/admin/webhook_secrets/reseal", a.reseal, methods=["POST"]),
        Route("/admin/keys", a.create_key, methods=["POST"]),
        Route("/admin/keys", a.list_keys, methods=["GET"]),
        Route("/admin/keys/{key_id}", a.update_key, methods=["PATCH"]),
        Route("/admin/keys/{key_id}/revoke", a.revoke_key, methods=["POST"]),
        Route("/admin/keys/{key_id}/rotate", a.rotate_key, methods=["POST"]),
        Route("/admin/audit", a.audit, methods=["GET"]),
        Route("/admin/holds", a.holds, methods=["GET"]),
        Route("/admin/holds/{hold_id}/settle", a.settle, methods=["POST"]),
        Route("/admin/holds/{hold_id}/release", a.release, methods=["POST"]),
        Route("/admin/ledger", a.totals, methods=["GET"]),
        Route("/admin/operators", a.create_operator, methods=["POST"]),
        Route("/admin/operators", a.list_operators, methods=["GET"]),
        Route("/admin/operators/{operator_id}/revoke", a.revoke_operator, methods=["POST"]),
        Route("/admin/admin_key/rotate", a.rotate_admin_key, methods=["POST"]),
    ]
    return [
        Route(r.path, needing(m, r.path, r.endpoint), methods=[m])
        for r in plain
        for m in r.methods or ()
        if m != "HEAD"
    ]
