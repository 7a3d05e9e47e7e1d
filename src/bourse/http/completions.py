"""Routes POST /v1/chat/completions and /v1/completions (with idempotency keys)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import GatewayError, invalid_request
from bourse.http.deps import Services, read_body
from bourse.http.relay import RunResponse
from bourse.http.responses import JSON
from bourse.ports.engine import Kind
from bourse.ports.stores import StoredResponse
from bourse.services.ids import new_request_id
from bourse.wire.requests import parse_body, validate

MAX_IDEMPOTENCY_KEY = 255


def routes(services: Services) -> list[Route]:
    completions = services.completions
    auth = services.auth
    store = services.store
    limit = services.max_body_bytes

    async def complete(request: Request, kind: Kind) -> Any:
        t0 = time.perf_counter()
        rid = new_request_id(kind)
        request.state.request_id = rid
        headers = request.headers
        principal = await auth.user(headers.get("authorization"))
        raw = await read_body(request, limit)
        body = parse_body(raw)
        req = validate(kind, body)
        if req.detached:
            job = await services.jobs.submit(
                principal, "/v1/chat/completions" if kind == "chat" else "/v1/completions", body,
                max_price_header=headers.get("x-max-price"), timeout_header=headers.get("x-book-timeout"),
            )  # fmt: skip
            return JSON(job, status_code=202, request_id=job["request_id"])
        idem = headers.get("idempotency-key")
        account = principal.account_id
        if idem is not None:
            if not idem or len(idem) > MAX_IDEMPOTENCY_KEY:
                raise invalid_request(f"Idempotency-Key: expected 1 to {MAX_IDEMPOTENCY_KEY} characters")
            digest = hashlib.sha256(kind.encode() + b"\0" + raw).hexdigest()
            begun = await store.idem_begin(account, idem, digest, time.time(), services.idempotency_ttl_s)
            if begun.state == "conflict":
                raise GatewayError(
                    409,
                    "idempotency_conflict",
                    "This Idempotency-Key was already used with a different request body.",
                )
            if begun.state == "in_flight":
                raise GatewayError(
                    409,
                    "idempotency_conflict",
                    "A request with this Idempotency-Key is still in flight; retry later.",
                )
            if begun.state == "done" and begun.response is not None:
                r = begun.response
                return Response(
                    r.body, status_code=r.status, headers={**r.headers, "idempotent-replayed": "true"}
                )
        try:
            run = await completions.open(
                kind,
                body,
                req,
                principal,
                request_id=rid,
                max_price_header=headers.get("x-max-price"),
                timeout_header=headers.get("x-book-timeout"),
                t0=t0,
            )
        except BaseException:
            if idem is not None:
                await store.idem_complete(account, idem, None)
            raise
        on_done = None
        if idem is not None:
            key = idem

            async def on_done(status: int, hdrs: dict[str, str], payload: bytes | None) -> None:
                if payload is None:
                    await store.idem_complete(account, key, None)
                else:
                    await store.idem_complete(account, key, StoredResponse(status, hdrs, payload))

        return RunResponse(run, on_done=on_done)

    async def chat_completions(request: Request) -> Any:
        return await complete(request, "chat")

    async def completions_legacy(request: Request) -> Any:
        return await complete(request, "completion")

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions_legacy, methods=["POST"]),
    ]
