"""The one pipeline of the hot POST routes, and what an API adapter gives it.

Every hot route (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``)
runs the same steps here, once: the head (read once from the scope), the API key,
the body, the product and its policy (which names the request id from then on,
errors included), the ``Idempotency-Key``, and the answer: a relayed run
(:class:`~bourse.http.relay.RunResponse`, which meters and settles it), a job, or a
replay. The edge (:func:`bourse.http.edge.serve`) observes each request under the
route's own name, refusals included.

An :class:`Adapter` is what differs between the APIs: it parses its body, finds its
product (with the API's own checks), and answers inside the idempotency claim,
shaping its frames (the relay's encoder) and choosing a job or a run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from bourse.domain.errors import GatewayError
from bourse.http import idempotency
from bourse.http.deps import Services, ServiceStore
from bourse.http.edge import HotRoute, read_body, serve
from bourse.http.relay import Encoder, OnDone, RunResponse
from bourse.ports.engine import Kind
from bourse.ports.observer import Caller
from bourse.ports.stores import StoredResponse
from bourse.services.auth import Principal
from bourse.services.completion import Run
from bourse.services.market import Market
from bourse.wire.requests import ChatCompletionRequest, CompletionRequest
from bourse.wire.trace_headers import correlation_id, traceparent

R = TypeVar("R")
"""An adapter's parsed request."""


@dataclass(slots=True)
class Head:
    """The request headers a hot route reads (once, from the scope), and the
    server's probe of the client's connection."""

    authorization: str | None = None
    length: bytes | None = None
    idempotency_key: str | None = None
    max_price: str | None = None
    book_timeout: str | None = None
    deadline: str | None = None
    """``X-Deadline-S``: a deadline order's deadline (seconds)."""
    present: Callable[[], bool] | None = None
    """Asks whether the client is still connected (None: the server has no probe)."""


def read_head(scope: Scope, caller: Caller) -> Head:
    head = Head(present=_client_probe(scope))
    for name, value in scope["headers"]:
        if name == b"authorization":
            head.authorization = value.decode("latin-1")
        elif name == b"content-length":
            head.length = value
        elif name == b"idempotency-key":
            head.idempotency_key = value.decode("latin-1")
        elif name == b"x-max-price":
            head.max_price = value.decode("latin-1")
        elif name == b"x-book-timeout":
            head.book_timeout = value.decode("latin-1")
        elif name == b"x-deadline-s":
            head.deadline = value.decode("latin-1")
        elif name == b"x-request-id":
            caller.correlation_id = correlation_id(value)
        elif name == b"traceparent":
            caller.traceparent = traceparent(value)
    return head


def _client_probe(scope: Scope) -> Callable[[], bool] | None:
    """The server's check that the client is still connected (see ``http/connections.py``)."""
    ext = scope.get("extensions") or {}
    probe = ext.get("bourse.client_present", {}).get("probe")
    return probe if callable(probe) else None


def keeper(store: ServiceStore, account: str, key: str) -> OnDone:
    """What keeps a relayed answer under its Idempotency-Key."""

    async def on_done(status: int, hdrs: dict[str, str], payload: bytes | None) -> None:
        if payload is None:
            await store.idem_complete(account, key, None)
        else:
            await store.idem_complete(account, key, StoredResponse(status, hdrs, payload))

    return on_done


@dataclass(slots=True)
class Incoming:
    """One request as the pipeline has read it, handed to its adapter's answer."""

    services: Services
    head: Head
    principal: Principal
    caller: Caller
    request_id: str
    """The product's name for the request (its policy's id)."""

    async def open(
        self,
        kind: Kind,
        body: dict[str, Any],
        req: ChatCompletionRequest | CompletionRequest,
        engine_stream: bool,
    ) -> Run:
        """The run of ``body`` (held and in the book), with what the head and caller say."""
        head, caller = self.head, self.caller
        return await self.services.completions.open(
            kind, body, req, self.principal, request_id=self.request_id,
            max_price_header=head.max_price, timeout_header=head.book_timeout, deadline_header=head.deadline,
            t0=caller.started,
            engine_stream=engine_stream, caller=caller, present=head.present,
        )  # fmt: skip

    def relay(self, run: Run, encoder: Encoder | None = None) -> RunResponse:
        """The run's response, kept under the Idempotency-Key when it is done."""
        key = self.head.idempotency_key
        on_done = None if key is None else keeper(self.services.store, self.principal.account_id, key)
        return RunResponse(run, on_done=on_done, encoder=encoder)

    async def keep(self, response: Response) -> Response:
        """``response`` (a job's document) kept as the Idempotency-Key's answer."""
        return await idempotency.keep(
            self.services, self.principal.account_id, self.head.idempotency_key, response
        )


class Adapter(ABC, Generic[R]):
    """What one API gives the pipeline (subclassed per API)."""

    __slots__ = ()

    kind: str
    """The request-id kind (``chat``, ``completion``, ``resp``)."""
    path: str
    """The route, as the observer names it."""

    @abstractmethod
    def parse(self, raw: bytes, depth: int) -> R:
        """The request in ``raw`` (JSON nested at most ``depth``), checked; 400 if not."""

    @abstractmethod
    def product(self, req: R) -> tuple[str, Market] | None:
        """The product ``req`` names and its market (None: no such product, left for the
        run to refuse after the idempotency claim)."""

    def check(self, req: R, market: Market) -> None:
        """The API's own checks of ``req`` against its product (before the idempotency
        claim; a refusal here names the product and carries its policy's id headers).
        None by default: the run's own checks are the API's."""

    @abstractmethod
    def scope(self, req: R) -> str:
        """What the Idempotency-Key's body digest is scoped to."""

    @abstractmethod
    async def answer(self, incoming: Incoming, req: R) -> ASGIApp:
        """The answer to ``req`` (a run's response or a job's), inside the idempotency claim."""


class Pipeline(Generic[R]):
    """The steps every hot route takes, around one :class:`Adapter`."""

    __slots__ = ("adapter", "max_body_bytes", "max_json_depth", "services")

    def __init__(self, services: Services, adapter: Adapter[R]) -> None:
        self.services = services
        self.adapter = adapter
        # the server's limits, read once (the container's properties are a call each)
        self.max_body_bytes = services.max_body_bytes
        self.max_json_depth = services.max_json_depth

    async def open(self, scope: Scope, receive: Receive, caller: Caller) -> ASGIApp:
        """The :data:`~bourse.http.edge.Opener` of the adapter's route."""
        services, adapter = self.services, self.adapter
        head = read_head(scope, caller)
        principal = await services.auth.user(head.authorization)
        caller.key_id, caller.account_id = principal.key.id, principal.account_id
        head.idempotency_key = idempotency.scoped(principal, head.idempotency_key)
        raw = await read_body(receive, head.length, self.max_body_bytes)
        req = adapter.parse(raw, self.max_json_depth)
        found = adapter.product(req)
        if found is None:
            return await self._answer(
                Incoming(services, head, principal, caller, caller.request_id), req, raw
            )
        caller.product, market = found
        # the product's policy names the request id from here on, errors included (the
        # edge answers them with the caller's id; the policy's id headers go with them)
        policy = market.policy
        rid = caller.request_id = policy.request_id(caller.request_id)
        try:
            adapter.check(req, market)
            return await self._answer(Incoming(services, head, principal, caller, rid), req, raw)
        except GatewayError as exc:
            exc.headers = {**policy.id_headers(rid), **exc.headers}
            raise

    async def _answer(self, incoming: Incoming, req: R, raw: bytes) -> ASGIApp:
        """Idempotency, then the adapter's answer (the key let go if it fails)."""
        services, account, idem = self.services, incoming.principal.account_id, incoming.head.idempotency_key
        replay = await idempotency.begin(services, account, idem, self.adapter.scope(req), raw)
        if replay is not None:
            return replay
        try:
            return await self.adapter.answer(incoming, req)
        except BaseException:
            await idempotency.forget(services, account, idem)
            raise


def hot_route(services: Services, adapter: Adapter[Any]) -> HotRoute:
    """The adapter's route for :class:`~bourse.http.edge.HotRouter`, observed under its path."""
    return HotRoute(adapter.kind, Pipeline(services, adapter).open, adapter.path, services.observer)


class _Endpoint:
    """A hot route as a Starlette endpoint (a raw ASGI app), for the paths the
    :class:`~bourse.http.edge.HotRouter` does not take (e.g. a mounted root path)."""

    def __init__(self, route: HotRoute) -> None:
        self._route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve(self._route, scope, receive, send)


def routes(hot: dict[str, HotRoute]) -> list[Route]:
    """The same routes for Starlette: other methods get its 405 envelope there."""
    out: list[Any] = [Route(path, _Endpoint(route), methods=["POST"]) for path, route in hot.items()]
    return out
