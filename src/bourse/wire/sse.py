"""Server-sent events framing: bytes out, events in.

The relay writes frames with these helpers so that SSE framing never appears in
business logic. :class:`SSEParser`, the project's one SSE parser, reads a byte stream
back: the HTTP engine takes its upstream's payloads from it (the hot path); the
test-suite's raw reader and the benchmark client take events and comments.
"""

from __future__ import annotations

from dataclasses import dataclass

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
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


def _whole_events(piece: bytes) -> list[bytes] | None:
    """The payloads of ``piece`` when it is whole events of one ``data: `` line each, LF
    ended (how an upstream writes its chunks, most reads holding one or more of them):
    one split and a slice an event, where the line-by-line scan takes two lines an event.
    None for anything else (CR, other fields, comments, several data lines, blank lines
    between events), which the scan reads.

    ``find``, not ``in``: on CPython 3.11, ``sub in some_bytes`` first tries ``sub`` as an
    integer, building and clearing a formatted ``TypeError`` before it searches (~2,000
    instructions a test under callgrind; with one an event, half of what the event loop
    spent a stream over the tree before issue 12). One ``count`` of the piece's newlines
    instead of a ``find`` an event ran more instructions for reads of one or two events
    (8,600 against 7,650 a one-event read) and the same for four."""
    if piece.find(b"\r") >= 0:
        return None
    blocks = piece[:-2].split(b"\n\n")
    out = [block[6:] for block in blocks if block[:6] == b"data: " and block.find(b"\n") < 0]
    return out if len(out) == len(blocks) else None


class SSEParser:
    """The one incremental SSE parser: feed bytes in pieces of any size, get what they complete.

    Lines end in LF or CRLF; the ``data`` lines of one event are joined by LF; an event
    ends at a blank line. Two ways out of one scan:

    - :meth:`payloads` (the HTTP engine's hot path): the ``data`` of each event as
      bytes; comments and other fields are skipped; a read of whole one-line events
      (the usual read of an upstream's stream) is split by events, not scanned by lines;
    - :meth:`feed` (tests and the benchmark client): every :class:`Event`, decoded,
      comments included as events with ``comment`` set (so a test can check the
      keep-alive and queue frames the contract names), with its ``event`` name.

    :meth:`end` marks the end of the stream: an event not yet ended by a blank line counts.
    Use one of the two ways for a given stream.
    """

    __slots__ = ("_buffer", "_data", "_event")

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []
        self._event: bytes | None = None

    def payloads(self, piece: bytes, events: list[Event] | None = None) -> list[bytes]:
        """The ``data`` payloads of the events ``piece`` completes; given ``events``, the
        events are appended there instead, decoded, comments included (see :meth:`feed`)."""
        if events is None and not self._buffer and not self._data and piece[-2:] == b"\n\n":
            whole = _whole_events(piece)
            if whole is not None:
                return whole
        buffer = self._buffer + piece if self._buffer else piece
        lines = buffer.split(b"\n")
        self._buffer = lines.pop()
        out: list[bytes] = []
        data = self._data
        for line in lines:
            if line[-1:] == b"\r":
                line = line[:-1]
            if not line:
                if data:
                    payload = data[0] if len(data) == 1 else b"\n".join(data)
                    data.clear()
                    if events is None:
                        out.append(payload)
                    else:
                        events.append(self._event_of(payload))
                else:
                    self._event = None  # an event without data is not dispatched
            elif line[:5] == b"data:":
                data.append(line[6:] if line[5:6] == b" " else line[5:])
            elif events is not None:
                self._field(line, events)
        return out

    def end(self) -> list[bytes]:
        """The payloads completed by the end of the stream."""
        return self.payloads(b"\n\n")

    def feed(self, piece: bytes) -> list[Event]:
        """Every event and comment ``piece`` completes, in order."""
        events: list[Event] = []
        self.payloads(piece, events)
        return events

    def _field(self, line: bytes, events: list[Event]) -> None:
        """A line other than ``data``: a comment, or the event's name (others are ignored)."""
        if line[:1] == b":":
            events.append(Event(comment=line[1:].strip().decode()))
        elif line[:6] == b"event:":
            self._event = line[7:] if line[6:7] == b" " else line[6:]

    def _event_of(self, payload: bytes) -> Event:
        name, self._event = self._event, None
        return Event(data=payload.decode(), event=None if name is None else name.decode())
