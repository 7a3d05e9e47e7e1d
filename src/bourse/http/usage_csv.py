"""Usage records as CSV: the columns, one row per record, and the download routes.

One table for every export: ``GET /v1/usage?format=csv`` (a key's own page, with the
JSON list's filters and paging; see :mod:`bourse.http.account`), ``GET
/admin/usage.csv`` (every account over a time range, streamed page by page) and the
dashboard's download buttons. Each column is a field of the usage record as
``GET /v1/usage/{request_id}`` returns it (:data:`COLUMNS` names its path), so a row
and the JSON record say the same thing; a field a preset renames in its receipt (the
quote) has one path per name, taken from the presets (:data:`QUOTE_FIELDS`). USD
is written with six decimals (:data:`USD_COLUMNS`), other numbers without an exponent.
Two columns say how an operator closed a reconciling hold (the
``reconciliation`` that the admin settle or release writes into the record); the
last two, a deadline order's start bid and deadline (issue 38: the receipt's
``start_bid``, its ``bid`` the last it bid; a fixed order's ``start_bid`` is its bid,
its ``deadline_s`` empty). Text
cells that a spreadsheet would run as a formula (``=``, ``+``, ``-``, ``@`` first)
are prefixed with ``'``. New columns go at the end, so that a reader of the old ones
finds them where they were.
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from bourse.domain.errors import invalid_request
from bourse.domain.money import usd_text, usd_to_micros
from bourse.domain.policy import PRESETS
from bourse.http.admin_roles import guard, needing
from bourse.http.deps import Services, unix_time
from bourse.ports.reports import ReportStore, UsageFilter
from bourse.ports.stores import UsageRecord
from bourse.services.ids import new_request_id
from bourse.wire.requests import optional_id

QUOTE_FIELDS: tuple[str, ...] = tuple(dict.fromkeys(p.receipt_quote_field for p in PRESETS.values()))
"""The quote's name in a receipt, under each preset (``quote_micros``; ``quote`` under
``hips``): the usage record keeps the receipt its client saw."""

Paths = tuple[tuple[str, ...], ...]


def _at(*path: str) -> Paths:
    return (path,)


COLUMNS: tuple[tuple[str, Paths], ...] = (
    ("request_id", _at("id")),
    ("created", _at("created")),
    ("account", ()),
    ("key_id", _at("key_id")),
    ("model", _at("model")),
    ("endpoint", _at("endpoint")),
    ("outcome", _at("outcome")),
    ("prompt_tokens", _at("usage", "prompt_tokens")),
    ("completion_tokens", _at("usage", "completion_tokens")),
    ("total_tokens", _at("usage", "total_tokens")),
    ("usage_estimated", _at("usage", "usage_estimated")),
    ("cost_micros", _at("usage", "cost_micros")),
    ("cost_usd", _at("usage", "cost")),
    ("bid", _at("usage", "x_market", "bid")),
    ("cleared_price", _at("usage", "x_market", "cleared_price")),
    ("level", _at("usage", "x_market", "level")),
    ("queued_ms", _at("usage", "x_market", "queued_ms")),
    ("deployment", _at("usage", "x_market", "deployment")),
    ("ttft_ms", _at("receipt", "ttft_ms")),
    ("latency_ms", _at("receipt", "latency_ms")),
    ("quote_micros", tuple(("receipt", name) for name in QUOTE_FIELDS)),
    ("reconciled", _at("reconciliation", "action")),
    ("reconciled_at", _at("reconciliation", "at")),
    ("start_bid", _at("usage", "x_market", "start_bid")),
    ("deadline_s", _at("usage", "x_market", "deadline_s")),
)
"""(column, its paths in the usage record: the first one present gives the cell);
``account`` is the record's account."""

USD_COLUMNS: Mapping[str, Paths] = {
    "cost_usd": _at("usage", "cost_micros"),
    "bid": (),
    "cleared_price": (),
    "start_bid": (),
}
"""The columns in USD (a cost; a price in USD per 1M tokens, which the book rounds to
the micro-USD), each with the paths of the integer micro-USD the record keeps beside
it (none for the prices). The cell is that integer with six decimals when the record
has it, else the float rounded to the micro-USD: a float's repr would say ``3e-06``,
and formatting the float itself would carry its rounding error."""

MEDIA_TYPE = "text/csv; charset=utf-8"
EXPORT_PAGE = 1000
DEFAULT_RANGE_S = 86_400.0
"""``/admin/usage.csv`` without ``since``: the last day."""
_FORMULA = ("=", "+", "-", "@", "\t", "\r")


def header() -> list[str]:
    return [name for name, _ in COLUMNS]


def _cell(value: Any) -> str:
    if value is None or isinstance(value, dict | list):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        # the shortest digits that read back as the float, never with an exponent
        return format(Decimal(repr(value)), "f") if math.isfinite(value) else ""
    text = str(value)
    return "'" + text if text.startswith(_FORMULA) else text


def _get(doc: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = doc
    for part in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def _first(doc: Mapping[str, Any], paths: Paths) -> Any:
    for path in paths:
        value = _get(doc, path)
        if value is not None:
            return value
    return None


def _usd(micros: Any, usd: Any) -> str:
    if isinstance(micros, int) and not isinstance(micros, bool):
        return usd_text(micros)
    if isinstance(usd, int | float) and not isinstance(usd, bool) and math.isfinite(usd):
        return usd_text(usd_to_micros(usd))
    return _cell(usd)


def _column(doc: Mapping[str, Any], name: str, paths: Paths) -> str:
    value = _first(doc, paths)
    if name in USD_COLUMNS:
        return _usd(_first(doc, USD_COLUMNS[name]), value)
    return _cell(value)


def row(record: UsageRecord) -> list[str]:
    doc = record.record
    return [_column(doc, name, paths) if paths else _cell(record.account_id) for name, paths in COLUMNS]


def render(records: Iterable[UsageRecord], *, with_header: bool = True) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\r\n")
    if with_header:
        w.writerow(header())
    for r in records:
        w.writerow(row(r))
    return out.getvalue()


def attachment(name: str) -> dict[str, str]:
    return {"content-disposition": f'attachment; filename="{name}"', "cache-control": "no-store"}


def page_response(records: Sequence[UsageRecord], more: bool, next_after: str | None) -> Response:
    """One page of a key's records (``GET /v1/usage?format=csv``); the paging is in
    the headers ``x-has-more`` and ``x-next-after``."""
    headers = {
        **attachment("usage.csv"),
        "x-request-id": new_request_id("req"),
        "x-has-more": str(more).lower(),
    }
    if next_after is not None:
        headers["x-next-after"] = next_after
    return Response(render(records), media_type=MEDIA_TYPE, headers=headers)


async def _pages(reports: ReportStore, where: UsageFilter) -> AsyncIterator[str]:
    yield render((), with_header=True)
    after: str | None = None
    while True:
        page = await reports.usage_rows(where, limit=EXPORT_PAGE, after=after)
        if page:
            yield render(page, with_header=False)
        if len(page) < EXPORT_PAGE:
            return
        after = page[-1].request_id


def export_response(reports: ReportStore, where: UsageFilter, filename: str) -> Response:
    """Every record matching ``where``, newest first, streamed a page at a time."""
    headers = {**attachment(filename), "x-request-id": new_request_id("req")}
    return StreamingResponse(_pages(reports, where), media_type=MEDIA_TYPE, headers=headers)


def export_filter(request: Request, account_id: str | None) -> UsageFilter:
    """The filter of an export from its query (``since``, ``until``, ``key``, ``product``,
    ``outcome``); ``account_id`` when the caller sees one account only."""
    q = request.query_params
    until = unix_time(request, "until")
    since = unix_time(request, "since")
    if since is None:
        since = (until if until is not None else time.time()) - DEFAULT_RANGE_S
    if until is not None and until < since:
        raise invalid_request("until: must not be before since", param="until")
    return UsageFilter(
        account_id=account_id,
        key_id=optional_id(q.get("key"), "key"),
        product=optional_id(q.get("product"), "product"),
        outcome=optional_id(q.get("outcome"), "outcome"),
        since=since,
        until=until,
    )


def routes(services: Services) -> list[Route]:
    auth = services.auth
    reports = services.reports

    async def admin_usage_csv(request: Request) -> Response:
        await guard(auth, request)
        account = optional_id(request.query_params.get("account"), "account")
        return export_response(reports, export_filter(request, account), "usage-all.csv")

    return [Route("/admin/usage.csv", needing("GET", "/admin/usage.csv", admin_usage_csv), methods=["GET"])]
