"""The error envelope of SPEC section 11, checked on any HTTP response (served or in
process)."""

from __future__ import annotations

from typing import Any

import httpx

SHOULD_RETRY = {429: "true", 500: "true", 502: "true", 503: "true"}
"""``x-should-retry`` by status (docs/errors.md): ``true`` for these, ``false`` for
every other status but 409 (``true`` for a key still in flight, else ``false``)."""


def assert_error_envelope(
    resp: httpx.Response, status: int, code: str | None = None, *, should_retry: str | None = None
) -> dict[str, Any]:
    """The answer is ``status`` with the OpenAI error envelope, an x-request-id, an
    ``x-should-retry`` as the status calls for (or ``should_retry``: a failure after
    output says ``false`` whatever its status), no trace."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers.get("x-request-id"), dict(resp.headers)
    retry = resp.headers.get("x-should-retry")
    if should_retry is not None:
        assert retry == should_retry, dict(resp.headers)
    else:
        assert retry == SHOULD_RETRY.get(status, "false") or (status == 409 and retry == "true"), dict(
            resp.headers
        )
    assert resp.headers.get("content-type", "").startswith("application/json")
    text = resp.text
    assert "Traceback" not in text and 'File "' not in text, text
    body = resp.json()
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if code is not None:
        assert err["code"] == code, err
    return err
