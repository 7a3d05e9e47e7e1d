"""What the edge needs from the composition root, and small request helpers."""

from __future__ import annotations

import math
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from bourse.domain.errors import invalid_request
from bourse.http import edge
from bourse.ports.market import MarketAdmin
from bourse.ports.observer import Observer
from bourse.ports.reports import ReportStore
from bourse.ports.stores import IdempotencyStore, UsageStore
from bourse.services.accounts import AdminService
from bourse.services.auth import Authenticator
from bourse.services.clock import DatabaseClock
from bourse.services.completion import CompletionService
from bourse.services.dashboard import Dashboard
from bourse.services.jobs import JobService
from bourse.services.responses import ResponseService
from bourse.wire.requests import parse_body

M = TypeVar("M", bound=BaseModel)


class ServiceStore(UsageStore, IdempotencyStore, Protocol):
    pass


class Services(Protocol):
    @property
    def completions(self) -> CompletionService: ...
    @property
    def auth(self) -> Authenticator: ...
    @property
    def admin(self) -> AdminService: ...
    @property
    def desk(self) -> MarketAdmin: ...
    @property
    def jobs(self) -> JobService: ...
    @property
    def responses(self) -> ResponseService: ...
    @property
    def store(self) -> ServiceStore: ...
    @property
    def reports(self) -> ReportStore: ...
    @property
    def dashboard(self) -> Dashboard: ...
    @property
    def max_body_bytes(self) -> int: ...
    @property
    def max_json_depth(self) -> int: ...
    @property
    def idempotency_ttl_s(self) -> float: ...
    @property
    def clock(self) -> DatabaseClock:
        """The database's clock: every time another replica judges (an idempotency key's
        expiry, a stored response's, a key's) is taken on it."""
        ...

    @property
    def observer(self) -> Observer: ...

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


async def read_body(request: Request, limit: int) -> bytes:
    """The body of a Starlette route's request, read as the hot routes read theirs
    (:func:`bourse.http.edge.read_body`)."""
    try:
        return await edge.read_body(request.receive, request.headers.get("content-length"), limit)
    except edge.ClientGone:
        raise ClientDisconnect from None


async def json_model(request: Request, model: type[M], max_depth: int, limit: int = 64 * 1024) -> M:
    return parse_model(await read_body(request, limit), model, max_depth)


def parse_model(raw: bytes, model: type[M], max_depth: int) -> M:
    body: dict[str, Any] = parse_body(raw, max_depth) if raw else {}
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise invalid_request(f"{where}: {err['msg']}", param=where) from None


def page_limit(request: Request, default: int = 20, most: int = 100) -> int:
    """The ``limit`` query parameter of a list endpoint, checked."""
    try:
        limit = int(request.query_params.get("limit", str(default)))
    except ValueError:
        raise invalid_request("limit: expected an integer", param="limit") from None
    if not 1 <= limit <= most:
        raise invalid_request(f"limit: expected 1 to {most}", param="limit")
    return limit


def unix_time(request: Request, name: str) -> float | None:
    """A query parameter holding a unix time in seconds (finite), if given."""
    v = request.query_params.get(name)
    if v is None:
        return None
    try:
        t = float(v)
    except ValueError:
        t = math.nan
    if not math.isfinite(t):
        raise invalid_request(f"{name}: expected a unix time in seconds, got {v!r}", param=name)
    return t
