"""JSON and error responses for the ASGI edge (orjson, the OpenAI error envelope)."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from bourse.domain.errors import GatewayError


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(err: GatewayError, request_id: str) -> Response:
    headers = {"x-request-id": request_id, **err.headers}
    return JSON({"error": err.envelope()}, status_code=err.status, headers=headers)
