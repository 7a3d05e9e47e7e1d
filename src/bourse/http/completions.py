"""Routes POST /v1/chat/completions and /v1/completions (with idempotency keys).

They are raw ASGI routes (:mod:`bourse.http.edge`): the headers are read once from
the scope, the body straight from ``receive``. The client's ``x-request-id`` and
``traceparent`` (checked by :mod:`bourse.wire.trace_headers`) and, once known, the
key id and the product go into the request's :class:`~bourse.ports.observer.Caller`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from bourse.domain.errors import GatewayError
from bourse.http import idempotency
from bourse.http.deps import Services, ServiceStore
from bourse.http.edge import HotRoute, read_body, serve
from bourse.http.relay import OnDone, RunResponse
from bourse.http.responses import JSON
from bourse.ports.engine import Kind
from bourse.ports.observer import Caller
from bourse.ports.stores import StoredResponse
from bourse.services.auth import Principal
from bourse.wire.requests import ChatCompletionRequest, CompletionRequest, parse_body, validate
from bourse.wire.trace_headers import correlation_id, traceparent

PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@dataclass(slots=True)
class Head:
    """The request headers a completion route reads (once, from the scope), and the
    server's probe of the client's connection."""

    authorization: str | None = None
    length: bytes | None = None
    idempotency_key: str | None = None
    max_price: str | None = None
    book_timeout: str | None = None
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


def keeper(store: ServiceStore, account: str, key: str | None) -> OnDone | None:
    """What keeps a relayed answer under its Idempotency-Key (None: no key)."""
    if key is None:
        return None

    async def on_done(status: int, hdrs: dict[str, str], payload: bytes | None) -> None:
        if payload is None:
            await store.idem_complete(account, key, None)
        else:
            await store.idem_complete(account, key, StoredResponse(status, hdrs, payload))

    return on_done


def hot_routes(services: Services) -> dict[str, HotRoute]:
    """The two completion routes, by path, for :class:`~bourse.http.edge.HotRouter`."""
    completions = services.completions
    auth = services.auth
    limit = services.max_body_bytes
    depth = services.max_json_depth

    async def detached(kind: Kind, head: Head, principal: Principal, body: dict[str, Any]) -> ASGIApp:
        account, idem = principal.account_id, head.idempotency_key
        try:
            job = await services.jobs.submit(
                principal,
                PATHS[kind],
                body,
                max_price_header=head.max_price,
                timeout_header=head.book_timeout,
            )
        except BaseException:
            await idempotency.forget(services, account, idem)
            raise
        return await idempotency.keep(
            services, account, idem, JSON(job, status_code=202, request_id=job["request_id"])
        )

    async def complete(kind: Kind, scope: Scope, receive: Receive, caller: Caller) -> ASGIApp:
        t0 = caller.started
        rid = caller.request_id
        head = read_head(scope, caller)
        principal = await auth.user(head.authorization)
        caller.key_id = principal.key.id
        head.idempotency_key = idempotency.scoped(principal, head.idempotency_key)
        raw = await read_body(receive, head.length, limit)
        body = parse_body(raw, depth)
        req = validate(kind, body)
        market = completions.markets.get(req.model)
        if market is None:
            return await answer(kind, head, principal, body, raw, req, rid, t0, caller)
        caller.product = req.model
        # the product's policy names the request id from here on, errors included (the
        # edge answers them with the caller's id; the policy's id headers go with them)
        policy = market.policy
        rid = caller.request_id = policy.request_id(rid)
        try:
            return await answer(kind, head, principal, body, raw, req, rid, t0, caller)
        except GatewayError as exc:
            exc.headers = {**policy.id_headers(rid), **exc.headers}
            raise

    async def answer(
        kind: Kind,
        head: Head,
        principal: Principal,
        body: dict[str, Any],
        raw: bytes,
        req: ChatCompletionRequest | CompletionRequest,
        rid: str,
        t0: float,
        caller: Caller,
    ) -> ASGIApp:
        """Idempotency, then the job or the run's response."""
        account, idem = principal.account_id, head.idempotency_key
        replay = await idempotency.begin(services, account, idem, kind, raw)
        if replay is not None:
            return replay
        if req.detached:
            return await detached(kind, head, principal, body)
        try:
            run = await completions.open(
                kind,
                body,
                req,
                principal,
                request_id=rid,
                max_price_header=head.max_price,
                timeout_header=head.book_timeout,
                t0=t0,
                engine_stream=req.stream,  # one answer: the engine may ask its upstream for one
                caller=caller,
                present=head.present,
            )
        except BaseException:
            await idempotency.forget(services, account, idem)
            raise
        return RunResponse(run, on_done=keeper(services.store, account, idem))

    async def chat(scope: Scope, receive: Receive, caller: Caller) -> ASGIApp:
        return await complete("chat", scope, receive, caller)

    async def legacy(scope: Scope, receive: Receive, caller: Caller) -> ASGIApp:
        return await complete("completion", scope, receive, caller)

    observer = services.observer
    return {
        PATHS["chat"]: HotRoute("chat", chat, PATHS["chat"], observer),
        PATHS["completion"]: HotRoute("completion", legacy, PATHS["completion"], observer),
    }


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
