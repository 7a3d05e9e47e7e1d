"""Routes for a key's own records: GET /v1/account, /v1/usage, /v1/usage/{request_id}."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import GatewayError, invalid_request
from bourse.domain.money import micros_to_usd
from bourse.http import usage_csv
from bourse.http.deps import Services, page_limit, unix_time
from bourse.http.responses import JSON
from bourse.services.budgets import account_view
from bourse.wire.requests import check_id, optional_id

_CAP_FIELDS = ("spend_cap_micros", "spend_cap_period", "spend_micros", "spend_cap_resets_at")
"""The account's spend cap, as the admin API shows it (what its period has taken, when it ends)."""


def routes(services: Services) -> list[Route]:
    auth = services.auth
    store = services.store
    admin = services.admin

    async def account(request: Request) -> Response:
        p = await auth.user(request.headers.get("authorization"))
        acc = await admin.store.account(p.account_id)
        if acc is None:
            raise GatewayError(404, "not_found", "This key's account no longer exists.")
        holds = await admin.store.holds("reconciling", p.account_id, 100)
        budget = account_view(acc, auth.clock())
        return JSON(
            {
                "object": "bourse.account",
                "id": acc.id,
                "balance_micros": acc.balance_micros,
                "balance_usd": micros_to_usd(acc.balance_micros),
                "open_holds_micros": acc.open_holds_micros,
                "reconciling_micros": acc.reconciling_micros,
                "spent_micros": acc.spent_micros,
                "credited_micros": acc.credited_micros,
                **{k: budget[k] for k in _CAP_FIELDS},
                "reconciling_holds": [
                    {"id": h.id, "request_id": h.request_id, "amount_micros": h.amount_micros, "note": h.note}
                    for h in holds
                ],
                "key": {
                    "id": p.key.id,
                    "products": p.key.products,
                    "rpm": p.key.rpm,
                    "tpm": p.key.tpm,
                    "max_streams": p.key.max_streams,
                },
            }
        )

    async def usage_list(request: Request) -> Response:
        p = await auth.user(request.headers.get("authorization"))
        fmt = request.query_params.get("format", "json")
        if fmt not in ("json", "csv"):
            raise invalid_request("format: expected json or csv", param="format")
        limit = page_limit(request)
        rows = await store.usage_page(
            p.account_id,
            limit=limit + 1,
            before=unix_time(request, "before"),
            since=unix_time(request, "since"),
            until=unix_time(request, "until"),
            after=optional_id(request.query_params.get("after"), "after"),
        )
        page = rows[:limit]
        more = len(rows) > limit
        if fmt == "csv":
            return usage_csv.page_response(page, more, page[-1].request_id if more and page else None)
        return JSON(
            {
                "object": "list",
                "data": [dict(r.record) for r in page],
                "has_more": more,
                "next_after": page[-1].request_id if more and page else None,
            }
        )

    async def usage_one(request: Request) -> Response:
        p = await auth.user(request.headers.get("authorization"))
        rid = check_id(request.path_params["request_id"], "request_id")
        rec = await store.usage(p.account_id, rid)
        if rec is None:
            raise GatewayError(404, "not_found", f"No usage record '{rid}' for this account.")
        return JSON(dict(rec.record))

    return [
        Route("/v1/account", account, methods=["GET"]),
        Route("/v1/usage", usage_list, methods=["GET"]),
        Route("/v1/usage/{request_id}", usage_one, methods=["GET"]),
    ]
