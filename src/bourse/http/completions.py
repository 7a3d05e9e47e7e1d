"""Routes POST /v1/chat/completions and /v1/completions (with idempotency keys)."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.routing import Route

from bourse.http import idempotency
from bourse.http.deps import Services, read_body
from bourse.http.relay import RunResponse
from bourse.http.responses import JSON
from bourse.ports.engine import Kind
from bourse.ports.stores import StoredResponse
from bourse.services.ids import new_request_id
from bourse.wire.requests import parse_body, validate


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
        idem = headers.get("idempotency-key")
        account = principal.account_id
        replay = await idempotency.begin(services, account, idem, kind, raw)
        if replay is not None:
            return replay
        if req.detached:
            try:
                job = await services.jobs.submit(
                    principal, "/v1/chat/completions" if kind == "chat" else "/v1/completions", body,
                    max_price_header=headers.get("x-max-price"), timeout_header=headers.get("x-book-timeout"),
                )  # fmt: skip
            except BaseException:
                await idempotency.forget(services, account, idem)
                raise
            return await idempotency.keep(
                services, account, idem, JSON(job, status_code=202, request_id=job["request_id"])
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
            await idempotency.forget(services, account, idem)
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
