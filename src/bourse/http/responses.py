"""JSON and error responses for the ASGI edge (orjson, the OpenAI error envelope)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from bourse.domain.errors import GatewayError
from bourse.services.ids import new_request_id


class JSON(Response):
    """A JSON response that always carries ``x-request-id`` (SPEC section 2)."""

    media_type = "application/json"

    def __init__(
        self,
        content: Any,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
        request_id: str | None = None,
    ) -> None:
        headers = dict(headers) if headers else {}
        headers.setdefault("x-request-id", request_id or new_request_id("req"))
        super().__init__(content, status_code=status_code, headers=headers)

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(err: GatewayError, request_id: str, id_headers: dict[str, str] | None = None) -> Response:
    """The error envelope with its headers; ``id_headers``: those that carry the request
    id (default ``x-request-id`` alone)."""
    headers = {**(id_headers or {"x-request-id": request_id}), **err.headers}
    return JSON({"error": err.envelope()}, status_code=err.status, headers=headers)
