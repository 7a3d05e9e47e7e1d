"""The Responses API: ``POST /v1/responses`` (a hot route), ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` and ``POST
/v1/responses/{id}/cancel``.

A request is translated to a chat request (:mod:`bourse.wire.responses`) and runs
through the same book, hold and relay as a chat completion: the relay
(:class:`~bourse.http.relay.RunResponse`) writes the book's comments, keep-alives and
requeues, cancels on a disconnect and settles by the product's policy; a
:class:`ResponsesEncoder` writes the output as OpenAI's typed events (streamed) or as
one response object, and keeps the response (``store``) before its last event is
written, so that a ``previous_response_id`` sent at once finds it. ``background: true``
runs as a detached job (:class:`~bourse.services.responses.ResponseService`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from bourse.domain.errors import invalid_request
from bourse.http.deps import Services, page_limit
from bourse.http.edge import HotRoute
from bourse.http.pipeline import Adapter, Incoming, hot_route
from bourse.http.responses import JSON
from bourse.services.auth import Principal
from bourse.services.billing import RESPONSES
from bourse.services.completion import Finished, Run
from bourse.services.market import Market
from bourse.services.responses import ResponseService
from bourse.wire import sse
from bourse.wire.requests import check_id, check_storable, optional_id, parse_body, validate
from bourse.wire.responses import (
    ResponseBuilder,
    ResponsesRequest,
    chat_body,
    event_frames,
    input_items,
    parse_request,
    response_object,
)

log = logging.getLogger("bourse.responses")

PATH = RESPONSES

Keep = Callable[[dict[str, Any]], Awaitable[None]]
"""Stores a finished response."""


class ResponsesEncoder:
    """The relay's :class:`~bourse.http.relay.Encoder` for the Responses API."""

    __slots__ = ("builder", "keep", "receipt_name")

    def __init__(self, builder: ResponseBuilder, receipt_name: str, keep: Keep | None) -> None:
        self.builder = builder
        self.receipt_name = receipt_name
        self.keep = keep

    def frames(self, chunk: dict[str, Any]) -> bytes:
        builder = self.builder
        builder.add(chunk)
        return event_frames(builder.take())

    def add(self, chunk: dict[str, Any]) -> None:
        self.builder.add(chunk)

    async def _final(self, fin: Finished) -> dict[str, Any]:
        err = fin.error
        error = None if err is None else {"code": err.code, "message": err.message}
        response = self.builder.finish(
            fin.usage, error, extra={self.receipt_name: fin.receipt}, completed_at=time.time()
        )
        if self.keep is not None:
            try:
                await self.keep(response)
            except Exception:  # the answer still goes out; only GET and chaining miss it
                log.exception("response %s could not be stored", response["id"])
        return response

    async def tail(self, fin: Finished) -> bytes:
        await self._final(fin)
        return event_frames(self.builder.take())

    async def document(self, fin: Finished) -> dict[str, Any]:
        return await self._final(fin)


class Responses(Adapter[ResponsesRequest]):
    """A Responses request, run as a chat request (or a background job) whose frames
    are the API's typed events (:class:`ResponsesEncoder`)."""

    __slots__ = ("kind", "path", "services")

    def __init__(self, services: Services) -> None:
        self.services = services
        self.kind = "resp"
        self.path = PATH

    def parse(self, raw: bytes, depth: int) -> ResponsesRequest:
        return parse_request(parse_body(raw, depth))

    def product(self, req: ResponsesRequest) -> tuple[str, Market]:
        return req.model, self.services.completions.market(req.model)  # 404 if there is none

    def check(self, req: ResponsesRequest, market: Market) -> None:
        if req.max_output_tokens is not None and req.max_output_tokens > market.max_output_tokens:
            raise invalid_request(
                f"max_output_tokens: {req.max_output_tokens} is over the output limit of '{req.model}' "
                f"({market.max_output_tokens}).",
                param="max_output_tokens",
            )

    def scope(self, req: ResponsesRequest) -> str:
        return "responses"

    async def answer(self, incoming: Incoming, req: ResponsesRequest) -> ASGIApp:
        responses, account, rid, head = (
            self.services.responses,
            incoming.principal.account_id,
            incoming.request_id,
            incoming.head,
        )
        history = await responses.history(req.previous_response_id, account)
        items = await responses.resolve(input_items(req), account)
        chat = chat_body(req, history, items)
        # what the answer echoes and the store keeps, written once before the hold
        check_storable(response_object(rid, req, req.model, 0, "in_progress"), "body")
        check_storable(items, "input")
        if req.background:
            doc = await responses.submit(
                incoming.principal, req, chat, items, history, request_id=rid,
                max_price_header=head.max_price, timeout_header=head.book_timeout,
                deadline_header=head.deadline,
            )  # fmt: skip
            kept = await incoming.keep(JSON(doc, request_id=doc["id"]))
            return follow(responses, doc, None) if req.stream else kept
        run = await incoming.open("chat", chat, validate("chat", chat), engine_stream=req.stream)
        return incoming.relay(run, self._encoder(run, req, items, history))

    def _encoder(
        self, run: Run, req: ResponsesRequest, items: list[dict[str, Any]], history: list[dict[str, Any]]
    ) -> ResponsesEncoder:
        shell = response_object(run.request_id, req, run.product, run.created, "in_progress")
        keep: Keep | None = None
        if req.stored:
            account, responses = run.account_id, self.services.responses

            async def keep(response: dict[str, Any]) -> None:
                await responses.save(account, items, history, response)

        return ResponsesEncoder(ResponseBuilder(shell, events=req.stream), run.policy.receipt_name, keep)


def hot_routes(services: Services) -> dict[str, HotRoute]:
    """``POST /v1/responses``, for :class:`~bourse.http.edge.HotRouter`."""
    return {PATH: hot_route(services, Responses(services))}


async def _resume(responses: ResponseService, request: Request, p: Principal, rid: str) -> Response:
    """``GET /v1/responses/{id}?stream=true&starting_after=N``: a background stream again."""
    after = request.query_params.get("starting_after")
    try:
        starting_after = None if after is None else int(after)
    except ValueError:
        raise invalid_request("starting_after: expected an integer", param="starting_after") from None
    doc = await responses.get(rid, p.account_id)  # owned by the account, else 404
    return follow(responses, doc, starting_after)


def follow(responses: ResponseService, doc: dict[str, Any], starting_after: int | None) -> Response:
    """The typed events of a background stream after ``starting_after``, then those to its
    end as they come (a ``: keep-alive`` comment every quiet interval without one)."""
    rid = doc["id"]
    events = responses.logs.get(rid)
    if events is None:
        raise invalid_request(
            "stream: only a background response created with stream: true can be streamed, on the "
            "gateway that runs it, until a few minutes after its end",
            param="stream",
        )
    market = responses.jobs.completions.markets.get(str(doc.get("model")))
    interval = 2.0 if market is None else market.policy.quiet_interval_s

    async def frames() -> AsyncIterator[bytes]:
        async for batch in events.follow(starting_after, interval):
            yield event_frames(batch) if batch else sse.KEEP_ALIVE

    return StreamingResponse(
        frames(),
        media_type="text/event-stream; charset=utf-8",
        headers={"cache-control": "no-cache, no-transform", "x-accel-buffering": "no", "x-request-id": rid},
    )


def routes(services: Services) -> list[Route]:
    """The routes on stored responses (``POST /v1/responses`` is a hot route)."""
    auth = services.auth
    responses = services.responses

    def _id(request: Request) -> str:
        return check_id(request.path_params["response_id"], "response_id")

    async def get(request: Request) -> Response:
        p = await auth.user(request.headers.get("authorization"))
        rid = _id(request)
        if request.query_params.get("stream") in ("true", "1"):
            return await _resume(responses, request, p, rid)
        return JSON(await responses.get(rid, p.account_id))

    async def delete(request: Request) -> Response:
        p = await auth.user(request.headers.get("authorization"))
        rid = _id(request)
        return JSON(await responses.delete(rid, p.account_id))

    async def cancel(request: Request) -> Response:
        p = await auth.user(request.headers.get("authorization"))
        rid = _id(request)
        return JSON(await responses.cancel(rid, p.account_id))

    async def items(request: Request) -> Response:
        p = await auth.user(request.headers.get("authorization"))
        rid = _id(request)
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise invalid_request("order: expected asc or desc", param="order")
        page = await responses.input_items(
            rid, p.account_id, limit=page_limit(request), after=optional_id(request.query_params.get("after"), "after"),
            order=order,
        )  # fmt: skip
        return JSON(page)

    return [
        Route(PATH + "/{response_id}", get, methods=["GET"]),
        Route(PATH + "/{response_id}", delete, methods=["DELETE"]),
        Route(PATH + "/{response_id}/input_items", items, methods=["GET"]),
        Route(PATH + "/{response_id}/cancel", cancel, methods=["POST"]),
    ]
