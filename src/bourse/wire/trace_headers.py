"""The client's correlation headers, checked before they reach a log line or an upstream.

- ``x-request-id``: the client's own id for its request, kept as a correlation id in
  the access line and the usage record (bourse's own id stays the response id).
  Kept only when it is 1 to 128 visible ASCII characters without quotes or
  backslashes, so it can neither break a log line nor smuggle one in.
- ``traceparent`` (W3C Trace Context): kept only in its version-00 shape,
  ``00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>``, not all zeros.
"""

from __future__ import annotations

import re

_CORRELATION = re.compile(r"[!#-\[\]-~]{1,128}")
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


def correlation_id(value: bytes) -> str | None:
    """The client's ``x-request-id``, or None if it is not a safe token."""
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if _CORRELATION.fullmatch(text) else None


def traceparent(value: bytes) -> str | None:
    """The client's ``traceparent`` in its W3C version-00 shape, or None."""
    try:
        text = value.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    m = _TRACEPARENT.fullmatch(text)
    if m is None or m.group(1) == "0" * 32 or m.group(2) == "0" * 16:
        return None
    return text
