"""The gateway's error vocabulary: one exception type, one table of codes.

Every failure a client can see is a :class:`GatewayError` carrying the HTTP status,
the OpenAI ``type`` and ``code``, and a message that stands on its own (SDKs do not
retry in-band errors, so the message must say what happened). The HTTP edge turns
it into the OpenAI envelope before the 200, and into the error frame after it
(SPEC sections 6 and 11)::

    GatewayError
     ├─ 400 invalid_request / context_length_exceeded
     ├─ 401 invalid_api_key
     ├─ 402 insufficient_funds
     ├─ 403 model_not_allowed
     ├─ 404 model_not_found / not_found
     ├─ 408 book_timeout
     ├─ 409 idempotency_conflict
     ├─ 413 request_too_large
     ├─ 431 request_header_fields_too_large
     ├─ 429 rate_limited
     ├─ 500 internal_error
     ├─ 502 upstream_error
     ├─ 503 no_capacity / draining
     └─ 504 upstream_timeout
"""

from __future__ import annotations

_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "insufficient_funds",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}
_RETRIED = frozenset({429, 500, 502, 503})
"""The statuses a client may send again as they are (unless the error says otherwise)."""


class GatewayError(Exception):
    """A failure with a place in the OpenAI error table."""

    __slots__ = ("code", "error_type", "headers", "message", "param", "status")

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
        retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.error_type = error_type or _TYPES.get(status, "server_error")
        should = status in _RETRIED if retry is None else retry
        self.headers = {"x-should-retry": "true" if should else "false", **(headers or {})}
        """The answer's own headers: ``x-should-retry`` always, ``retry-after`` and the like."""

    def envelope(self) -> dict[str, object]:
        """The OpenAI error object (the value of the ``error`` key)."""
        return {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}

    def __repr__(self) -> str:
        return f"GatewayError({self.status}, {self.code!r}, {self.message!r})"


def invalid_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, "invalid_request", message, param=param)


def model_not_found(model: str) -> GatewayError:
    return GatewayError(
        404,
        "model_not_found",
        f"The model '{model}' does not exist on this gateway; GET /v1/models lists the products.",
        param="model",
    )


def book_timeout(waited_s: float) -> GatewayError:
    return GatewayError(
        408,
        "book_timeout",
        f"The order waited {waited_s:.1f} s in the book without being admitted; nothing was charged. "
        "Raise max_price to be admitted sooner, or the timeout to wait longer.",
    )


def no_capacity(message: str, retry_after_s: int = 1) -> GatewayError:
    return GatewayError(503, "no_capacity", message, headers={"retry-after": str(retry_after_s)})


DRAINING_RETRY_AFTER_S = 2
"""What a request refused by a draining gateway is told to wait (another replica, or this
one restarted, takes it)."""


def draining(
    message: str = "The gateway is shutting down and takes no new requests; retry shortly.",
) -> GatewayError:
    """503 ``draining``: the gateway is shutting down (SIGTERM or SIGINT)."""
    return GatewayError(503, "draining", message, headers={"retry-after": str(DRAINING_RETRY_AFTER_S)})


def upstream_error(message: str) -> GatewayError:
    return GatewayError(502, "upstream_error", message)


def internal_error(request_id: str) -> GatewayError:
    return GatewayError(
        500,
        "internal_error",
        f"The gateway failed on this request (request id {request_id}); the failure is logged under that id.",
    )
