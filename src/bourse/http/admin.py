"""The admin API (admin key only): accounts, credit, keys, holds."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import invalid_request
from bourse.http.deps import Services, json_model, page_limit
from bourse.http.responses import JSON
from bourse.wire.requests import INT64_MAX, IdText, check_id, optional_id

INT32_MAX = 2**31 - 1
"""The largest key limit (``rpm``, ``tpm``, ``max_streams``): their columns are INTEGER."""


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class NewAccount(_In):
    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.@:-]+$")
    credit_usd: float = Field(default=0.0, ge=0, le=1e9, allow_inf_nan=False)


class Credit(_In):
    amount_usd: float = Field(gt=0, le=1e9, allow_inf_nan=False)


class NewKey(_In):
    account: IdText
    products: list[IdText] | None = Field(default=None, max_length=10_000)
    rpm: int | None = Field(default=None, ge=1, le=INT32_MAX)
    tpm: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_streams: int | None = Field(default=None, ge=1, le=INT32_MAX)


class SettleHold(_In):
    amount_micros: int | None = Field(default=None, ge=0, le=INT64_MAX)
    """What to charge, at most the hold (default: its usage estimate, else the whole hold)."""


def routes(services: Services) -> list[Route]:
    auth = services.auth
    admin = services.admin

    def guard(request: Request) -> None:
        auth.admin(request.headers.get("authorization"))

    async def create_account(request: Request) -> Response:
        guard(request)
        body = await json_model(request, NewAccount)
        return JSON(await admin.create_account(body.id, body.credit_usd), status_code=201)

    async def get_account(request: Request) -> Response:
        guard(request)
        return JSON(await admin.account(check_id(request.path_params["account_id"], "account_id")))

    async def credit(request: Request) -> Response:
        guard(request)
        account = check_id(request.path_params["account_id"], "account_id")
        body = await json_model(request, Credit)
        return JSON(await admin.credit(account, body.amount_usd))

    async def create_key(request: Request) -> Response:
        guard(request)
        body = await json_model(request, NewKey)
        out = await admin.create_key(body.account, body.products, body.rpm, body.tpm, body.max_streams)
        return JSON(out, status_code=201)

    async def holds(request: Request) -> Response:
        guard(request)
        state = request.query_params.get("state")
        if state not in (None, "open", "settled", "released", "reconciling"):
            raise invalid_request("state: expected open, settled, released or reconciling", param="state")
        account = optional_id(request.query_params.get("account"), "account")
        limit = page_limit(request, default=100, most=1000)
        st: Literal["open", "settled", "released", "reconciling"] | None = state  # type: ignore[assignment]
        return JSON({"object": "list", "data": await admin.holds(st, account, limit)})

    async def settle(request: Request) -> Response:
        guard(request)
        hold_id = check_id(request.path_params["hold_id"], "hold_id")
        body = await json_model(request, SettleHold)
        return JSON(await admin.settle_hold(hold_id, body.amount_micros))

    async def release(request: Request) -> Response:
        guard(request)
        return JSON(await admin.release_hold(check_id(request.path_params["hold_id"], "hold_id")))

    async def totals(request: Request) -> Response:
        guard(request)
        t = await admin.store.totals()
        return JSON(
            {
                "credits_micros": t.credits_micros,
                "balances_micros": t.balances_micros,
                "holds_micros": t.holds_micros,
                "revenue_micros": t.revenue_micros,
                "balanced": t.balanced,
            }
        )

    return [
        Route("/admin/accounts", create_account, methods=["POST"]),
        Route("/admin/accounts/{account_id}", get_account, methods=["GET"]),
        Route("/admin/accounts/{account_id}/credit", credit, methods=["POST"]),
        Route("/admin/keys", create_key, methods=["POST"]),
        Route("/admin/holds", holds, methods=["GET"]),
        Route("/admin/holds/{hold_id}/settle", settle, methods=["POST"]),
        Route("/admin/holds/{hold_id}/release", release, methods=["POST"]),
        Route("/admin/ledger", totals, methods=["GET"]),
    ]
