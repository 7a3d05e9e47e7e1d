"""Connection limits of the HTTP server: what uvicorn does not bound by itself.

uvicorn closes a connection idle between two requests (``timeout_keep_alive``) but
not one idle before its first request, and has no limit on how long a client may
take to send its headers or its body, nor on the number of open connections
(``limit_concurrency`` answers 503 to requests over the limit, yet keeps every
connection open). :func:`bounded_protocol` makes its httptools protocol class with
those limits (:class:`ConnectionLimits`, from ``[server]``):

- a new connection gets ``keep_alive_timeout_s`` to send its first byte, as between
  two requests;
- from the first byte of a request, its line and headers must arrive within
  ``header_timeout_s``; then its body within ``body_timeout_s`` (time the application
  is not reading, with reading paused, does not count). A late client gets 408 in the
  error envelope (unless a response has begun) and the connection is closed; the
  application reading the body sees a disconnect;
- a connection over ``max_connections`` gets 503 with ``retry-after`` and is closed
  at once;
- a request's head (its line and headers) may take at most ``max_header_bytes``, and
  so may what a chunked body carries besides its data (chunk lines, trailers): past
  that, 431 in the error envelope (unless a response has begun) and the connection is
  closed. httptools keeps a header until its end (a 64 MB header was 64 MB, and more,
  of memory), so the bytes are counted as they arrive, before the parser sees them,
  and those past the limit are never handed to it (see :meth:`data_received`).

Each request's scope also carries ``extensions["bourse.client_present"]``:

- ``probe``: asks the socket itself whether the client is still connected (a
  disconnect the event loop has not processed yet, e.g. after a stall, counts as
  gone); the book asks it when a slot comes to the order;
- ``watch``: ``watch(on_lost)`` has the connection call ``on_lost`` when it is lost
  (``watch(None)``: no more). The relay, streamed or not, hears of a disconnect
  this way, without a listener task (:mod:`bourse.http.relay`).
"""

from __future__ import annotations

import asyncio
import collections
import select
from collections.abc import Callable
from typing import Any, cast

import orjson
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from bourse.domain.errors import GatewayError
from bourse.domain.values import immutable
from bourse.services.ids import new_request_id


@immutable
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 2048
    max_header_bytes: int = 64 * 1024


def canned_response(err: GatewayError) -> bytes:
    """A whole HTTP/1.1 response carrying ``err`` in the error envelope, then close."""
    body = orjson.dumps({"error": err.envelope()})
    headers = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close",
               "x-request-id": new_request_id("req"), **err.headers}  # fmt: skip
    head = f"HTTP/1.1 {err.status} {_REASONS.get(err.status, '')}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode("latin-1") + b"\r\n" + body


_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}

_IDLE, _HEAD, _BODY = 0, 1, 2
"""Where the parser is in the connection's current request: between two (or before the
first), in its line and headers, in its body."""


def head_too_large(limit: int) -> GatewayError:
    return GatewayError(
        431, "request_header_fields_too_large",
        f"The request's line and headers are over {limit} bytes, the limit ([server] max_header_bytes).",
    )  # fmt: skip


def _lean_event(event: asyncio.Event) -> asyncio.Event:
    """``event`` with its waiters in a list, not a deque: an empty deque is 760 bytes, an
    empty list 56 (``asyncio.Event`` only appends to, removes from and iterates over its
    waiters, which a list does alike). Two events a connection (uvicorn's flow control's
    and its request's), so ~1.4 KB less a connection (an open stream) in bench (e)."""
    waiters = getattr(event, "_waiters", None)
    if type(waiters) is collections.deque and not waiters:
        event._waiters = []  # type: ignore[assignment]
    return event


class _Pipeline(list[Any]):
    """uvicorn's queue of pipelined requests (``appendleft``, ``pop``, truth), as a list:
    almost always empty, and an empty deque is 760 bytes to a list's 56."""

    __slots__ = ()

    def appendleft(self, item: Any) -> None:
        self.insert(0, item)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of :class:`ConnectionLimits`.

    Its own state is in slots, not in the instance's ``__dict__``: uvicorn's protocol
    keeps 28 attributes there, and CPython shares one key table between instances only up
    to ~30 keys; nine more of ours made each connection's dict a table of its own (1,584
    bytes against ~300), ~1.3 KB more an open connection (bench scenario (e))."""

    __slots__ = (
        "_begun",
        "_body_bytes",
        "_deadline",
        "_due",
        "_feeding",
        "_lost",
        "_on_lost",
        "_phase",
        "_present",
        "_room",
    )

    limits = ConnectionLimits()

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.pipeline = _Pipeline()  # type: ignore[assignment]
        # uvicorn types it as int; the timer takes any number of seconds
        self.timeout_keep_alive = cast(int, self.limits.keep_alive_timeout_s)
        self._deadline: asyncio.TimerHandle | None = None
        self._feeding = False
        self._due: tuple[float, Callable[[], None]] | None = None
        """The deadline to arm once the bytes being parsed are done (see ``data_received``)."""
        self._present: dict[object, object] | None = None
        """``extensions["bourse.client_present"]`` of this connection's requests (made once)."""
        self._on_lost: Callable[[], None] | None = None
        """Called once when the connection is lost (see :meth:`watch`)."""
        self._lost = False
        self._phase = _IDLE
        self._begun = 0
        """Requests begun on this connection: tells a head open from the one open before."""
        self._room = self.limits.max_header_bytes
        """Bytes the open (or next) head may still take; in a body, what its framing may."""
        self._body_bytes = 0
        """Body bytes the parser gave so far (what a body's read is, besides its framing)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _lean_event(self.flow._is_writable_event)
        if len(self.connections) > self.limits.max_connections:
            err = GatewayError(503, "no_capacity", "Too many open connections; retry shortly.",
                               headers={"retry-after": "1"})  # fmt: skip
            transport.write(canned_response(err))
            transport.close()
            return
        # idle until its first byte, as between two requests (data_received disarms it)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.limits.keep_alive_timeout_s, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        self._lost = True
        on_lost, self._on_lost = self._on_lost, None
        if on_lost is not None:
            on_lost()

    def watch(self, on_lost: Callable[[], None] | None) -> None:
        """Call ``on_lost`` (once) when this connection is lost, at once if it already
        is; None stops watching."""
        if on_lost is not None and self._lost:
            on_lost()
            return
        self._on_lost = on_lost

    def data_received(self, data: bytes) -> None:
        # The head's bytes are counted here, before the parser keeps them. A read that
        # starts in a head, or between two requests (the next head then starts it), is
        # counted whole while that head stays open after it; a head that begins inside a
        # read, after another request's bytes (pipelined), is counted from its next read
        # on, so it may take one read (256 KiB) more. A read that would pass the limit is
        # parsed only up to it: if the head has not ended there, the rest is never
        # parsed. In a body, what a read has besides body bytes (a chunked body's chunk
        # lines and trailers, which httptools keeps) is counted once it is parsed, from
        # the last read with body bytes in it.
        view: bytes | memoryview = data
        while True:
            phase, begun, n = self._phase, self._begun, len(view)
            if phase == _BODY:
                body = self._body_bytes
                self._feed(view)
                if self._phase == _BODY and self._begun == begun:  # the same body goes on
                    got = self._body_bytes - body
                    self._room = (self._room if got == 0 else self.limits.max_header_bytes) - (n - got)
                    if self._room < 0:
                        self._too_large()
                return
            head = begun + (phase == _IDLE)  # the head this read starts in (idle: the next one)
            room = self._room
            if n <= room:
                self._feed(view)
                if self._phase == _HEAD and self._begun == head:
                    self._room = room - n
                return
            if not isinstance(view, memoryview):
                view = memoryview(view)  # the slices below are not copies
            self._feed(view[:room])
            if self._phase == _HEAD and self._begun == head:  # that head did not end within the limit
                self._too_large()
                return
            if self.transport.is_closing():  # the parser refused the request (400)
                return
            view = view[room:]

    def _feed(self, data: bytes | memoryview) -> None:
        # A request's line, headers and body usually come in one read: the parser
        # callbacks below then only note the deadline due, armed here once the read is
        # parsed (at the same instant), not armed and cancelled within the read.
        self._feeding = True
        try:
            super().data_received(data)  # type: ignore[arg-type]  # httptools takes any buffer
        finally:
            self._feeding = False
            due, self._due = self._due, None
            if due is not None:
                self._arm(*due)

    def _too_large(self) -> None:
        """The head (or a body's framing) passed ``max_header_bytes``: 431, unless a
        response has begun, and the connection is closed."""
        self._disarm()
        cycle = self.cycle
        if self._phase == _BODY and cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the application's receive() says disconnect
            cycle.message_event.set()
        if self._phase == _BODY:
            can_answer = cycle is not None and not cycle.response_started
        else:
            can_answer = cycle is None or cycle.response_complete
        self._give_up(head_too_large(self.limits.max_header_bytes), can_answer)

    # parser callbacks: a request begins, its headers end, its body ends

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = _HEAD
        self._begun += 1
        present = self._present
        if present is None:  # the connection's first request: made once, shared by the next ones
            present = self._present = {"probe": self.client_present, "watch": self.watch}
        self.scope["extensions"] = {"bourse.client_present": present}
        self._arm(self.limits.header_timeout_s, self._headers_late)

    def client_present(self) -> bool:
        """False once the client has closed its side or the connection failed, read
        from the socket now (one poll, no wait)."""
        transport = self.transport
        if transport.is_closing():
            return False
        sock = transport.get_extra_info("socket")
        if sock is None or not _RDHUP:
            return True
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | _RDHUP)
        return not any(ev & (_RDHUP | select.POLLHUP | select.POLLERR) for _, ev in poller.poll(0))

    def on_headers_complete(self) -> None:
        self._phase = _BODY
        self._room = self.limits.max_header_bytes  # now for the body's framing and trailers
        super().on_headers_complete()  # starts the application's task; it runs later
        if self.cycle is not None:
            _lean_event(self.cycle.message_event)
        # the headers' deadline gives way to the body's; a request without a body
        # completes at once (on_message_complete disarms)
        self._arm(self.limits.body_timeout_s, self._body_late)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        self._room = self.limits.max_header_bytes  # the next request's head
        self._disarm()
        super().on_message_complete()

    # deadlines

    def _arm(self, seconds: float, late: Callable[[], None]) -> None:
        """The deadline ``late`` in ``seconds``, in place of any other (called twice per
        request: one disarm of its own, not a call to :meth:`_disarm`)."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._feeding:
            self._due = (seconds, late)
            return
        self._due = None
        self._deadline = self.loop.call_later(seconds, late)

    def _disarm(self) -> None:
        self._due = None
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        cycle = self.cycle  # the previous request's, if any
        idle = cycle is None or cycle.response_complete
        message = f"The request headers did not arrive within {self.limits.header_timeout_s:g} s."
        self._give_up(GatewayError(408, "request_timeout", message), idle)

    def _body_late(self) -> None:
        self._deadline = None
        if self.flow.read_paused:  # the application is not reading: not the client's delay
            self._arm(self.limits.body_timeout_s, self._body_late)
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the application's receive() says disconnect
            cycle.message_event.set()
        idle = cycle is None or not cycle.response_started
        message = f"The request body did not arrive within {self.limits.body_timeout_s:g} s."
        self._give_up(GatewayError(408, "request_timeout", message), idle)

    def _give_up(self, err: GatewayError, can_answer: bool) -> None:
        if self.transport.is_closing():
            return
        if can_answer:
            self.transport.write(canned_response(err))
        self.transport.close()


_RDHUP: int = getattr(select, "POLLRDHUP", 0)
"""Linux: the peer closed its side (elsewhere 0: the probe says present)."""


def bounded_protocol(limits: ConnectionLimits) -> type[BoundedHttpToolsProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"limits": limits})
