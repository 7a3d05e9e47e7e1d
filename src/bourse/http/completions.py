"""The adapters of POST /v1/chat/completions and /v1/completions (the hot pipeline,
:mod:`bourse.http.pipeline`, runs them).

The body is an OpenAI chat or legacy completion request (:mod:`bourse.wire.requests`);
the run's frames are the relay's own (chunks and ``[DONE]``), and a ``detached``
request is a job (:class:`~bourse.services.jobs.JobService`), answered 202 at once.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp

from bourse.http.deps import Services
from bourse.http.edge import HotRoute
from bourse.http.pipeline import Adapter, Incoming, hot_route
from bourse.http.responses import JSON
from bourse.ports.engine import Kind
from bourse.services.billing import ENDPOINTS
from bourse.services.market import Market
from bourse.wire.requests import ChatCompletionRequest, CompletionRequest, parse_body, validate

Parsed = tuple[dict[str, Any], ChatCompletionRequest | CompletionRequest]
"""The request body and its checked form."""


class Completions(Adapter[Parsed]):
    """A chat or legacy completion request (``kind``)."""

    __slots__ = ("api", "kind", "path", "services")

    def __init__(self, services: Services, kind: Kind) -> None:
        self.services = services
        self.api: Kind = kind
        self.kind = kind
        self.path = ENDPOINTS[kind]

    def parse(self, raw: bytes, depth: int) -> Parsed:
        body = parse_body(raw, depth)
        return body, validate(self.api, body)

    def product(self, req: Parsed) -> tuple[str, Market] | None:
        model = req[1].model
        market = self.services.completions.markets.get(model)
        return None if market is None else (model, market)

    def scope(self, req: Parsed) -> str:
        return self.api

    async def answer(self, incoming: Incoming, req: Parsed) -> ASGIApp:
        body, checked = req
        if checked.detached:
            head = incoming.head
            job = await self.services.jobs.submit(
                incoming.principal,
                self.path,
                body,
                max_price_header=head.max_price,
                timeout_header=head.book_timeout,
                deadline_header=head.deadline,
            )
            return await incoming.keep(JSON(job, status_code=202, request_id=job["request_id"]))
        # one answer: the engine may ask its upstream for one
        return incoming.relay(await incoming.open(self.api, body, checked, engine_stream=checked.stream))


def hot_routes(services: Services) -> dict[str, HotRoute]:
    """The two completion routes, by path, for :class:`~bourse.http.edge.HotRouter`."""
    kinds: tuple[Kind, ...] = ("chat", "completion")
    return {ENDPOINTS[kind]: hot_route(services, Completions(services, kind)) for kind in kinds}
