"""The dashboard's live feeds, as server-sent events.

``GET /dashboard/api/markets/{product}/events``: first ``history`` (the samples and
admissions the market tape keeps), then a ``snapshot`` at every sample (the market
view with its book and deployments, its price-against-wait curve
(:func:`~bourse.http.market.wait_curve`), the new point, the latest admissions).

``GET /dashboard/api/requests/events``: a ``request`` event per finished request of
this process that the session may see and the filters (``key``, ``product``,
``outcome``, ``account``) take.

Each stream lives at most :data:`STREAM_LIFE_S` and then sends ``end``; the page
opens a new one, which checks the session again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from bourse.domain.errors import model_not_found
from bourse.http.dashboard.api import usage_filter
from bourse.http.dashboard.guard import Guard
from bourse.http.dashboard.views import clear_doc, point, request_row
from bourse.http.market import market_doc, wait_curve
from bourse.ports.reports import UsageFilter
from bourse.ports.stores import UsageRecord
from bourse.services.dashboard import Dashboard
from bourse.services.market import Market
from bourse.services.sessions import Session
from bourse.services.tape import Sample
from bourse.wire.requests import check_id
from bourse.wire.sse import KEEP_ALIVE, data_frame

STREAM_LIFE_S = 300.0
KEEP_ALIVE_S = 5.0
RECENT_CLEARS = 30


def event(name: str, doc: Any) -> bytes:
    return b"event: " + name.encode() + b"\n" + data_frame(orjson.dumps(doc))


def sse(body: AsyncIterator[bytes]) -> Response:
    return StreamingResponse(
        body, media_type="text/event-stream", headers={"cache-control": "no-store", "x-accel-buffering": "no"}
    )


def takes(where: UsageFilter, rec: UsageRecord) -> bool:
    """Whether the filter ``where`` takes ``rec`` (the time range is not used)."""
    return (
        (where.account_id is None or rec.account_id == where.account_id)
        and (where.key_id is None or rec.record.get("key_id") == where.key_id)
        and (where.product is None or rec.product == where.product)
        and (where.outcome is None or rec.outcome == where.outcome)
    )


def routes(guard: Guard, dash: Dashboard, markets: Mapping[str, Market]) -> list[Route]:
    tape = dash.tape
    rendered: dict[str, tuple[Sample, bytes]] = {}

    def snapshot(name: str, m: Market, sample: Sample) -> bytes:
        """The ``snapshot`` event of a sample, rendered once for every watcher."""
        last = rendered.get(name)
        if last is not None and last[0] is sample:
            return last[1]
        _, clears = tape.history(name)
        doc = market_doc(name, m, sample.view, depth=True)
        doc.pop("recent_clears", None)
        doc["wait_curve"] = wait_curve(m, sample.view)
        frame = event("snapshot", {**doc, "point": point(sample),
                                   "clears": [clear_doc(c) for c in clears[:RECENT_CLEARS]]})  # fmt: skip
        rendered[name] = (sample, frame)
        return frame

    async def market_events(request: Request, s: Session) -> Response:
        name = check_id(request.path_params["product"], "product")
        m = markets.get(name)
        if m is None:
            raise model_not_found(name)

        async def body() -> AsyncIterator[bytes]:
            samples, clears = tape.history(name)
            yield event("history", {
                "product": name, "interval_s": tape.interval_s, "points": [point(x) for x in samples],
                "clears": [clear_doc(c) for c in clears],
            })  # fmt: skip
            ends = time.monotonic() + STREAM_LIFE_S
            async with contextlib.aclosing(tape.watch(name)) as samples_:
                async for sample in samples_:
                    yield snapshot(name, m, sample)
                    if time.monotonic() >= ends:
                        break
            yield event("end", {})

        return sse(body())

    async def request_events(request: Request, s: Session) -> Response:
        asked = usage_filter(request)
        where = UsageFilter(dash.scope(s, asked.account_id), asked.key_id, asked.product, asked.outcome)

        async def body() -> AsyncIterator[bytes]:
            ends = time.monotonic() + STREAM_LIFE_S
            with dash.feed.subscribe(lambda r: takes(where, r)) as queue:
                yield event("ready", {})  # from here on, nothing that finishes is missed
                while (left := ends - time.monotonic()) > 0:
                    try:
                        rec = await asyncio.wait_for(queue.get(), min(left, KEEP_ALIVE_S))
                    except TimeoutError:
                        yield KEEP_ALIVE
                        continue
                    yield event("request", request_row(rec))
            yield event("end", {})

        return sse(body())

    read = guard.read
    return [
        Route("/dashboard/api/markets/{product}/events", read(market_events), methods=["GET"]),
        Route("/dashboard/api/requests/events", read(request_events), methods=["GET"]),
    ]
