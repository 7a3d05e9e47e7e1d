"""Idempotency keys at the edge (Stripe's rules): the same key and body replay the
stored answer; another body, or the same key still in flight, is a 409."""

from __future__ import annotations

import hashlib
import time

from starlette.responses import Response

from bourse.domain.errors import GatewayError, invalid_request
from bourse.http.deps import Services
from bourse.ports.stores import StoredResponse

MAX_IDEMPOTENCY_KEY = 255


async def begin(services: Services, account: str, key: str | None, scope: str, raw: bytes) -> Response | None:
    """Claim ``key`` for this request; a stored answer to replay, or None to go ahead."""
    if key is None:
        return None
    if not key or len(key) > MAX_IDEMPOTENCY_KEY:
        raise invalid_request(f"Idempotency-Key: expected 1 to {MAX_IDEMPOTENCY_KEY} characters")
    digest = hashlib.sha256(scope.encode() + b"\0" + raw).hexdigest()
    begun = await services.store.idem_begin(account, key, digest, time.time(), services.idempotency_ttl_s)
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
        return Response(r.body, status_code=r.status, headers={**r.headers, "idempotent-replayed": "true"})
    return None


async def keep(services: Services, account: str, key: str | None, response: Response) -> Response:
    """Store ``response`` as the key's answer and return it."""
    if key is not None:
        headers = {k: v for k, v in response.headers.items() if k != "content-length"}
        await services.store.idem_complete(
            account, key, StoredResponse(response.status_code, headers, bytes(response.body))
        )
    return response


async def forget(services: Services, account: str, key: str | None) -> None:
    if key is not None:
        await services.store.idem_complete(account, key, None)
