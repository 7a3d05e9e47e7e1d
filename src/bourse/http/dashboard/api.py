"""The dashboard's data routes (``/dashboard/api/…``), each behind the session guard.

Reads: ``markets``, ``accounts`` (with the operator actions the session may take,
``allowed``), ``holds``, ``spend``, ``requests`` (and one request; a first page has
the refusals this process keeps beside it, ``refused``), ``jobs``,
``usage.csv``. Actions (same origin and CSRF token): ``holds/{id}/settle``,
``holds/{id}/release`` (an operator with the admin route's role, audited) and
``jobs/{id}/cancel`` (the job's owner or an operator). The management of accounts and
keys is :mod:`.manage`. What a session may see is
decided by :class:`~bourse.services.dashboard.Dashboard`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import invalid_request
from bourse.http import usage_csv
from bourse.http.dashboard.guard import Guard
from bourse.http.dashboard.roles import API, allowed, needing
from bourse.http.dashboard.views import account_doc, request_detail, request_row, spend_doc
from bourse.http.deps import json_model, page_limit, unix_time
from bourse.http.market import market_view
from bourse.http.responses import JSON
from bourse.ports.reports import UsageFilter
from bourse.ports.stores import HoldState, JobStatus
from bourse.services.dashboard import Dashboard
from bourse.services.market import Market
from bourse.services.sessions import Session
from bourse.wire.requests import INT64_MAX, check_id, optional_id

HOLD_STATES = ("open", "reconciling", "settled", "released")
JOB_STATES = ("queued", "running", "succeeded", "failed", "canceled", "expired")
SPEND_BUCKETS_S = (60, 300, 900, 3600, 7200, 86_400)
REFUSALS_LISTED = 500
"""At most this many refusals (this process's, newest first) with a first page of requests."""


class SettleBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    amount_micros: int | None = Field(default=None, ge=0, le=INT64_MAX)


def _choice(request: Request, name: str, allowed: tuple[str, ...], default: str | None) -> str | None:
    value = request.query_params.get(name, default)
    if value is not None and value not in allowed:
        raise invalid_request(f"{name}: expected one of {', '.join(allowed)}", param=name)
    return value


def usage_filter(request: Request) -> UsageFilter:
    """The requests table's filters: ``account`` (operator), ``key``, ``product``, ``outcome``."""
    q = request.query_params
    return UsageFilter(
        account_id=optional_id(q.get("account"), "account"),
        key_id=optional_id(q.get("key"), "key"),
        product=optional_id(q.get("product"), "product"),
        outcome=optional_id(q.get("outcome"), "outcome"),
        since=unix_time(request, "since"),
        until=unix_time(request, "until"),
    )


def routes(guard: Guard, dash: Dashboard, markets: Mapping[str, Market], max_depth: int) -> list[Route]:
    return [*_market_routes(guard, markets), *_money_routes(guard, dash, max_depth), *_request_routes(guard, dash),
            *_job_routes(guard, dash)]  # fmt: skip


def _market_routes(guard: Guard, markets: Mapping[str, Market]) -> list[Route]:
    async def market_list(request: Request, s: Session) -> Response:
        return JSON({"data": [await market_view(n, m, depth=False) for n, m in markets.items()]})

    return [Route(f"{API}/markets", guard.read(market_list), methods=["GET"])]


def _money_routes(guard: Guard, dash: Dashboard, max_depth: int) -> list[Route]:
    async def accounts(request: Request, s: Session) -> Response:
        return JSON({"data": [account_doc(a) for a in await dash.accounts(s)], "operator": s.operator,
                     "allowed": allowed(s)})  # fmt: skip

    async def holds(request: Request, s: Session) -> Response:
        state: Any = _choice(request, "state", HOLD_STATES, "reconciling")
        hs: HoldState = state
        return JSON({"data": await dash.holds(s, hs)})

    async def settle(request: Request, s: Session) -> Response:
        body = await json_model(request, SettleBody, max_depth)
        return JSON(
            await dash.settle(s, check_id(request.path_params["hold_id"], "hold_id"), body.amount_micros)
        )

    async def release(request: Request, s: Session) -> Response:
        return JSON(await dash.release(s, check_id(request.path_params["hold_id"], "hold_id")))

    async def spend(request: Request, s: Session) -> Response:
        bucket = request.query_params.get("bucket_s", "60")
        if bucket not in {str(b) for b in SPEND_BUCKETS_S}:
            raise invalid_request(f"bucket_s: expected one of {SPEND_BUCKETS_S}", param="bucket_s")
        since = unix_time(request, "since")
        if since is None:
            since = time.time() - 3600
        points = await dash.spend(s, since, int(bucket))
        return JSON({"bucket_s": int(bucket), "since": since, "data": [spend_doc(p) for p in points]})

    async def export(request: Request, s: Session) -> Response:
        account = optional_id(request.query_params.get("account"), "account")
        where = usage_csv.export_filter(request, dash.scope(s, account))
        name = "usage-all.csv" if where.account_id is None else f"usage-{where.account_id}.csv"
        return usage_csv.export_response(dash.reports, where, name)

    read, act = guard.read, guard.action
    return [
        Route(f"{API}/accounts", read(accounts), methods=["GET"]),
        Route(f"{API}/holds", read(holds), methods=["GET"]),
        Route(API + "/holds/{hold_id}/settle", act(needing("hold.settle", settle)), methods=["POST"]),
        Route(API + "/holds/{hold_id}/release", act(needing("hold.release", release)), methods=["POST"]),
        Route(f"{API}/spend", read(spend), methods=["GET"]),
        Route(f"{API}/usage.csv", read(export), methods=["GET"]),
    ]


def _request_routes(guard: Guard, dash: Dashboard) -> list[Route]:
    async def request_list(request: Request, s: Session) -> Response:
        limit = page_limit(request, default=50, most=200)
        after = optional_id(request.query_params.get("after"), "after")
        where = usage_filter(request)
        rows = await dash.requests(s, where, limit + 1, after)
        page = rows[:limit]
        more = len(rows) > limit
        doc = {"data": [request_row(r) for r in page], "has_more": more,
               "next_after": page[-1].request_id if more and page else None}  # fmt: skip
        if after is None:  # the first page: the refusals too, for the page to place
            doc["refused"] = [request_row(r) for r in await dash.refusals(s, where, REFUSALS_LISTED)]
        return JSON(doc)

    async def request_one(request: Request, s: Session) -> Response:
        rid = check_id(request.path_params["request_id"], "request_id")
        account = optional_id(request.query_params.get("account"), "account")
        return JSON(request_detail(await dash.request(s, rid, account)))

    return [
        Route(f"{API}/requests", guard.read(request_list), methods=["GET"]),
        Route(API + "/requests/{request_id}", guard.read(request_one), methods=["GET"]),
    ]


def _job_routes(guard: Guard, dash: Dashboard) -> list[Route]:
    async def jobs(request: Request, s: Session) -> Response:
        status: Any = _choice(request, "status", JOB_STATES, None)
        js: JobStatus | None = status
        return JSON({"data": await dash.job_list(s, js)})

    async def cancel(request: Request, s: Session) -> Response:
        return JSON(await dash.cancel_job(s, check_id(request.path_params["job_id"], "job_id")))

    return [
        Route(f"{API}/jobs", guard.read(jobs), methods=["GET"]),
        Route(API + "/jobs/{job_id}/cancel", guard.action(needing("job.cancel", cancel)), methods=["POST"]),
    ]
