"""Idempotency keys at the edge (Stripe's rules): the same key and body replay the
stored answer; another body, or the same key still in flight, is a 409.

A key belongs to the API key that sent it (:func:`scoped`): a sibling key of the same
account, which may be limited to other products, never replays its answers.
"""

from __future__ import annotations

import hashlib

from starlette.responses import Response

from bourse.domain.errors import GatewayError
from bourse.http.deps import Services
from bourse.ports.stores import StoredResponse
from bourse.services.auth import Principal
from bourse.wire.requests import check_id

MAX_IDEMPOTENCY_KEY = 255


def scoped(principal: Principal, header: str | None) -> str | None:
    """The stored name of the ``Idempotency-Key`` header of a request made with
    ``principal``'s API key (the name :func:`begin`, :func:`keep` and :func:`forget`
    take); None without the header, a 400 when it is not 1 to 255 characters without
    control characters."""
    if header is None:
        return None
    check_id(header, "Idempotency-Key", MAX_IDEMPOTENCY_KEY)
    return f"{principal.key.id}/{header}"


async def begin(services: Services, account: str, key: str | None, scope: str, raw: bytes) -> Response | None:
    """Claim ``key`` (a :func:`scoped` name) for this request; a stored answer to replay,
    or None to go ahead."""
    if key is None:
        return None
    digest = hashlib.sha256(scope.encode() + b"\0" + raw).hexdigest()
    begun = await services.store.idem_begin(
        account, key, digest, services.clock.now(), services.idempotency_ttl_s
    )
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
            retry=True,
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
