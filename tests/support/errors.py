"""The error envelope of SPEC section 11, checked on any HTTP response (served or in
process)."""

from __future__ import annotations

from typing import Any

import httpx


def assert_error_envelope(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """The answer is ``status`` with the OpenAI error envelope, an x-request-id, no trace."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers.get("x-request-id"), dict(resp.headers)
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
