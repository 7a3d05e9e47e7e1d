"""Server-sent events framing: bytes out, events in.

The relay writes frames with these helpers so that SSE framing never appears in
business logic. :class:`SSEParser` reads a byte stream back into events (used by the
HTTP engine's tests, the benchmark client and the test-suite's raw reader).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
WAITING = b": waiting\n\n"
REQUEUED = b": requeued (transient backend failure), waiting\n\n"


def data_frame(payload: bytes) -> bytes:
    """``data: <payload>`` followed by the blank line that ends the event."""
    return b"data: " + payload + b"\n\n"


def comment(text: str) -> bytes:
    """A comment frame (``: text``); clients ignore it, proxies see traffic."""
    return b": " + text.encode() + b"\n\n"


def fmt_price(value: float) -> str:
    """A price for a comment frame: up to 6 decimals, no trailing zeros."""
    s = f"{value:.6f}".rstrip("0").rstrip(".")
    return s or "0"


@dataclass(slots=True)
class Event:
    """One parsed SSE event: ``data`` lines joined by newlines, or a comment."""

    data: str | None = None
    comment: str | None = None
    event: str | None = None


class SSEParser:
    """Incremental SSE parser: feed bytes, get complete events.

    Comments are reported as events with ``comment`` set, so a test can check the
    keep-alive and queue frames the contract names.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event: str | None = None

    def feed(self, chunk: bytes) -> Iterator[Event]:
        self._buf += chunk
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                return
            line = self._buf[:nl].rstrip(b"\r").decode()
            self._buf = self._buf[nl + 1 :]
            if not line:
                if self._data or self._event is not None:
                    yield Event(data="\n".join(self._data), event=self._event)
                self._data = []
                self._event = None
            elif line.startswith(":"):
                yield Event(comment=line[1:].strip())
            else:
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "data":
                    self._data.append(value)
                elif name == "event":
                    self._event = value
