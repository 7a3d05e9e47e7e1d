"""The relay: one ASGI response that runs a :class:`~bourse.services.completion.Run`
and writes it to the client, as SSE frames or as one JSON body.

On an ASGI server other than bourse's own (no watch in the scope, below), the relay
and a listener (waiting for ``http.disconnect``) run in one task group, as
Starlette's ``StreamingResponse`` does: the group ends with both, and nothing
outlives the response. A disconnect stops the relay (the listener raises
:class:`_ClientLeft`, which cancels the relay once), and the run, cancelled where
it waits, stops its engine and gives back its slot; under the ``drain`` policy an
admitted run is instead read to its end, with nothing written. (``asyncio.TaskGroup``
rather than an anyio one: its cancellation is delivered once, so the run's own
clean-up, which awaits the engine's close, is not cancelled again.)

On bourse's own server a response needs neither, streamed or not
(:meth:`RunResponse.__call__`): the connection calls the relay back when it is lost
(``extensions["bourse.client_present"]["watch"]``, see :mod:`bourse.http.connections`),
and the relay's own task is cancelled, once, as the listener would have it (the same
stop, the same ``drain``, the same errors, a drain's stop taken back the same way).
The task group cost a task and a second pass of the event loop through the request's
coroutines at its exit (~3 % of the gateway's CPU per request in bench scenario (b)).
Other servers keep the listener and the group (:meth:`RunResponse._in_group`), for
both kinds.

A streamed request also has a timer for the quiet-interval frames of SPEC section 4
(``: queued level=… position=…`` while in the book, ``: waiting`` once admitted,
``: keep-alive`` once output began): it fires once per quiet interval and starts a
short task only to write such a frame: in the group, or, on bourse's own server, a
plain task the relay cancels when it stops and waits for before it returns (as the
group would), so that none outlives the response.

The per-chunk path is: rewrite (done by the run) -> ``orjson.dumps`` -> one
``send``. A policy may shape the chunks first (:meth:`RunResponse._shaped`): the role
and the ``finish_reason`` on chunks of their own, or the terminal chunk (the one with
the ``finish_reason``) held back to carry the usage once settled (the frames after the
last chunk: :mod:`bourse.http.relay_tail`). Nothing waits: chunks that reached the engine together (one upstream read;
the engine marks all but the last with ``more``) go out together in one ``send``,
which saves a write per chunk and delays none. The relay only reads the run's
state; it tells the run that the client left (:meth:`Run.client_gone`). Its own state
is two values that only move forward by their tables (:mod:`bourse.http.relay_state`):
the answer's :class:`Stage` (open, started, closing) and the client's
:class:`Presence` (there, gone).

Another API's shapes (the Responses API) come from an :class:`Encoder`, chosen once per
response: it frames the chunks and writes the end (streamed) or folds the chunks into
the answer (not streamed); everything else (the comments, the timer, disconnects, the
idempotency key) is the relay's, unchanged. A chat or legacy completion has none.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson
from starlette.types import Message, Receive, Scope, Send

from bourse.domain.errors import GatewayError
from bourse.http.relay_state import PRESENCE_MOVES, STAGE_MOVES, Presence, Stage, moved
from bourse.http.relay_tail import tail
from bourse.ports.engine import ChunkEvent
from bourse.services.completion import Finished, Queued, Requeued, Run
from bourse.services.run_state import ADMITTED, QUEUED, STREAMING
from bourse.wire import sse
from bourse.wire.chunks import Aggregator, has_finish, split_role_and_finish

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache, no-transform"),
    (b"x-accel-buffering", b"no"),
]


log = logging.getLogger("bourse.relay")

_OPEN, _STARTED, _CLOSING = Stage.OPEN, Stage.STARTED, Stage.CLOSING
_THERE, _GONE = Presence.THERE, Presence.GONE
"""Plain module names, not a member read off its enum each time (on Python 3.11 that
goes through the enum metaclass's ``__getattr__``: see :data:`bourse.services.run_state.DONE`)."""

OnDone = Callable[[int, dict[str, str], bytes | None], Awaitable[None]]
"""Called once with the final status, headers and body (None: no answer to keep)."""


def _encoded(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in headers.items()]


@functools.cache
def _money_names(prefix: str) -> tuple[bytes, bytes, bytes]:
    """The names of the quote, cost and latency headers under a policy's ``prefix``
    (encoded once, not per response)."""
    return (f"{prefix}quote-micros".encode(), f"{prefix}cost-micros".encode(), f"{prefix}latency-ms".encode())


def _body(data: bytes) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": True}


class Encoder(Protocol):
    """How a run's output is written in another API's shapes (see the module's docstring)."""

    def frames(self, chunk: dict[str, Any]) -> bytes:
        """The frames of one chunk (empty: nothing to write for it yet)."""
        ...

    def add(self, chunk: dict[str, Any]) -> None:
        """Fold one chunk into the answer (not streamed)."""
        ...

    async def tail(self, fin: Finished) -> bytes:
        """The frames after the last chunk (streamed); called even when the client has left."""
        ...

    async def document(self, fin: Finished) -> dict[str, Any]:
        """The answer (not streamed; the relay writes the error envelope when ``fin`` failed)."""
        ...


class _ClientLeft(Exception):
    """Raised by the listener: the client left and the relay stops (cancel policy)."""


Watch = Callable[[Callable[[], None] | None], None]
"""``extensions["bourse.client_present"]["watch"]`` of bourse's own server
(:mod:`bourse.http.connections`): a callback for when the connection is lost."""


def _watch_of(scope: Scope) -> Watch | None:
    ext = scope.get("extensions")
    present = ext.get("bourse.client_present") if ext else None
    if present is None:
        return None
    watch: Watch | None = present.get("watch")
    return watch


def _unless_client_left(group: BaseExceptionGroup[BaseException]) -> None:
    """Re-raise the first failure of the relay's task group other than the client leaving."""
    for exc in group.exceptions:
        if not isinstance(exc, _ClientLeft):
            raise exc


class RunResponse:
    """ASGI response for one run (streamed or not)."""

    __slots__ = (
        "_cancelled",
        "_group",
        "_held",
        "_hold_terminal",
        "_interval",
        "_last",
        "_loop",
        "_send",
        "_sending",
        "_task",
        "_ticking",
        "_timer",
        "encoder",
        "on_done",
        "policy",
        "presence",
        "run",
        "stage",
        "terms",
    )

    def __init__(self, run: Run, on_done: OnDone | None = None, encoder: Encoder | None = None) -> None:
        self.run = run
        # the run's terms and its policy, read here once: the relay reads them all
        # along (a property of the run is a call each time)
        self.terms = terms = run.terms
        self.policy = policy = terms.ask.market.policy
        self.on_done = on_done
        self.encoder = encoder
        self.stage = _OPEN
        self.presence = _THERE
        self._sending = False  # a frame being written: the quiet interval starts after it
        self._last = 0.0
        self._interval = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send: Send | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._ticking: asyncio.Task[None] | None = None
        self._group: asyncio.TaskGroup | None = None
        self._task: asyncio.Task[Any] | None = None
        """The relay's task (on bourse's own server: cancelled when the client leaves)."""
        self._cancelled = False
        """That task was cancelled because the client left (taken back at its end)."""
        self._hold_terminal = terms.ask.include_usage and policy.usage_on_last_choice
        self._held: dict[str, Any] | None = None
        """The terminal chunk, held back to carry the usage (policy ``usage_on_last_choice``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = _watch_of(scope)
        try:
            if watch is None:
                await self._in_group(receive, send)
                return
            # On bourse's own server (written here, not in a coroutine of its own: one
            # frame less an open stream): the connection calls back when it is lost, and
            # the relay's task is cancelled as the listener would have it (no listener,
            # no group: the answer is written by this task, and a stream's quiet-interval
            # frames by a task of its own, waited for here as the group would).
            task = asyncio.current_task()
            assert task is not None
            self._task = task
            watch(self._lost)
            try:
                try:
                    await (self._stream if self.terms.ask.stream else self._unary)(send)
                finally:
                    self._enter(_CLOSING)
                    watch(None)
                    if self._ticking is not None:
                        await self._tick_ended()
            except asyncio.CancelledError:
                if self._cancelled and task.uncancel() == 0:
                    return
                if not self.run.take_back_stop():  # a drain's stop that found the relay writing: abandoned
                    raise
        finally:
            # a run that never reached its end (client gone before the first frame,
            # or a relay failure) gives back its slot and money (abandon() is nothing
            # once the run is done: not awaited then)
            if not self.run.done:
                await self.run.abandon()
            if self.on_done is not None:
                # streamed: the key now points at the receipt; not streamed and no
                # answer (client gone): forget the key so a retry can run
                await self._keep(409, self._stream_replay() if self.terms.ask.stream else None)

    async def _in_group(self, receive: Receive, send: Send) -> None:
        """The relay beside a listener task, in one task group."""
        run = self.run
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                listener = group.create_task(self._listen(receive))
                try:
                    await (self._stream if self.terms.ask.stream else self._unary)(send)
                finally:
                    self._enter(_CLOSING)
                    listener.cancel()
        except BaseExceptionGroup as group_error:
            _unless_client_left(group_error)
        except asyncio.CancelledError:
            if not run.take_back_stop():  # a drain's stop that found the relay writing: the run is abandoned
                raise

    def _lost(self) -> None:
        """The connection's callback when it is lost (bourse's own server, :meth:`__call__`):
        the relay's task is cancelled, once, if the relay is to stop. (A method, not a
        closure made per response: a function and its cells were ~250 bytes a stream.)"""
        if self._client_left() and not self._cancelled:
            self._cancelled = True
            assert self._task is not None
            self._task.cancel()

    async def _keep(self, status: int, payload: tuple[dict[str, str], bytes] | None) -> None:
        assert self.on_done is not None
        try:
            if payload is None:
                await self.on_done(status, {}, None)
            else:
                await self.on_done(status, payload[0], payload[1])
        except Exception:
            log.exception("could not store the idempotent answer of %s", self.terms.request_id)
        self.on_done = None

    def _stream_replay(self) -> tuple[dict[str, str], bytes]:
        rid = self.terms.request_id
        err = GatewayError(
            409,
            "idempotency_conflict",
            f"This Idempotency-Key was used for a streamed request ({rid}); a stream cannot be replayed. "
            f"Its receipt is at GET /v1/usage/{rid}.",
        )
        return {"content-type": "application/json", **self.policy.id_headers(rid)}, orjson.dumps(
            {"error": err.envelope()}
        )

    def _money_headers(self, fin: Finished | None) -> list[tuple[bytes, bytes]]:
        terms = self.terms
        quote, cost, latency = _money_names(self.policy.header_prefix)
        out = [(quote, b"%d" % terms.quote.micros)]
        if fin is not None:
            out.append((cost, b"%d" % fin.cost_micros))
            out.append((latency, str(fin.receipt["latency_ms"]).encode()))
        grant = terms.grant.headers
        if grant:
            out.extend((k.encode(), v.encode()) for k, v in grant.items())
        return out

    # -- client ---------------------------------------------------------------

    def _enter(self, stage: Stage) -> None:
        if (self.stage, stage) not in STAGE_MOVES:  # the table's check, inline: moved() raises
            moved(STAGE_MOVES, self.stage, stage)
        self.stage = stage

    def _leave(self) -> None:
        moved(PRESENCE_MOVES, self.presence, _GONE)
        self.presence = _GONE

    async def _listen(self, receive: Receive) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
        if self._client_left():
            raise _ClientLeft

    def _client_left(self) -> bool:
        """The client disconnected: the run is told; True if the relay is to stop (not
        when the policy drains an admitted run, nor once the answer is being written)."""
        run = self.run
        self._leave()
        run.client_gone()
        if run.phase >= ADMITTED and self.policy.on_disconnect == "drain":
            return False  # keep reading the engine to its end; nothing more is written
        return self.stage is not _CLOSING

    def _arm(self) -> None:
        """Check for a quiet interval when the current one would end (a timer, not a task)."""
        assert self._loop is not None
        self._timer = self._loop.call_at(self._last + self._interval, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.stage is _CLOSING:
            return
        assert self._loop is not None
        now = self._loop.time()
        if self._sending or self.presence is _GONE:
            self._last = now
        if self._last + self._interval > now:
            self._arm()
            return
        run = self.run
        phase = run.phase
        frame: bytes | None
        if phase is QUEUED and run.order is not None:
            frame = None  # the level and position are asked of the book first
        elif phase is ADMITTED:
            frame = sse.comment(self.policy.waiting_comment)  # made when due: rare, not a value a response
        elif phase is STREAMING:
            frame = sse.KEEP_ALIVE
        else:
            return
        self._sending = True
        group = self._group
        tick = self._tick(frame)
        self._ticking = self._loop.create_task(tick) if group is None else group.create_task(tick)

    async def _tick(self, frame: bytes | None) -> None:
        assert self._send is not None and self._loop is not None
        try:
            if frame is None:
                frame = await self._queued_frame()
                if frame is None:
                    return
            await self._send(_body(frame))
        except Exception as exc:  # a frame that cannot be written is not the relay's failure
            log.debug("quiet-interval frame of %s not sent: %s", self.terms.request_id, exc)
        finally:
            self._sending = False
            self._ticking = None
            self._last = self._loop.time()
            if self.stage is not _CLOSING:
                self._arm()

    async def _queued_frame(self) -> bytes | None:
        """``: queued level=… position=… wait_s=…`` from the book (shared books answer
        over the network; ``wait_s``, the expected wait, when the pace is known; ``bid=…``,
        a deadline order's bid now); None if the order was admitted, the client left, or
        the book says the order is not waiting (its timeout or admission took it out in
        the instant the book was asked, before the run saw it)."""
        run = self.run
        assert run.order is not None
        p = await self.terms.ask.market.progress(run.order)  # its last known view if unreachable
        if run.phase is not QUEUED or self.presence is _GONE or self.stage is _CLOSING or p.position < 0:
            return None
        text = f"queued level={sse.fmt_price(p.level)} position={p.position}"
        if p.wait_s is not None:
            text += f" wait_s={p.wait_s:.2f}"
        if run.order.ceiling is not None:  # a deadline order: its bid now, raised as time passes
            text += f" bid={sse.fmt_price(run.order.bid)}"
        return sse.comment(text)

    def _stop_ticking(self) -> None:
        """No more quiet-interval frames: the timer is off and a frame being written is
        cancelled (the task stays in ``_ticking`` until it ends: see :meth:`_tick_ended`)."""
        self._enter(_CLOSING)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        tick = self._ticking
        if tick is not None and not tick.cancelling():
            tick.cancel()

    async def _tick_ended(self) -> None:
        """Wait for the quiet-interval frame's task (cancelled by :meth:`_stop_ticking`;
        it ends at once) to be done, as a task group's exit would; a cancellation of the
        relay meanwhile is raised once it is."""
        tick = self._ticking
        assert tick is not None
        self._stop_ticking()
        cancelled: asyncio.CancelledError | None = None
        while not tick.done():
            try:
                await asyncio.wait((tick,))
            except asyncio.CancelledError as exc:
                cancelled = exc
        self._ticking = None
        if cancelled is not None:
            raise cancelled

    # -- streamed ---------------------------------------------------------------

    async def _stream(self, send: Send) -> None:
        run = self.run
        loop = asyncio.get_running_loop()
        headers = [
            *_SSE_HEADERS,
            *_encoded(self.policy.id_headers(self.terms.request_id)),
            *self._money_headers(None),
        ]
        self._enter(_STARTED)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        del headers  # written: not held for the stream's life (~0.4 KB an open stream)
        self._loop = loop
        self._interval = self.policy.quiet_interval_s
        self._send = send
        self._last = loop.time()
        self._arm()
        events = run.events()
        frame_of = self._framer()  # None: each chunk as it is, one frame, made inline
        dumps = orjson.dumps
        together: list[bytes] = []  # frames of chunks that arrived with the next one
        try:
            async for ev in events:
                if type(ev) is ChunkEvent:
                    if self.presence is _THERE:
                        frame = b"data: %b\n\n" % dumps(ev.chunk) if frame_of is None else frame_of(ev.chunk)
                        if not frame:  # held back
                            continue
                        if ev.more:
                            together.append(frame)
                            continue
                        if together:
                            together.append(frame)
                            frame = b"".join(together)
                            together.clear()
                        self._sending = True
                        await send({"type": "http.response.body", "body": frame, "more_body": True})
                        self._sending = False
                        self._last = loop.time()
                        del frame, ev  # neither held while the stream waits for its next chunk
                    elif self.encoder is not None:  # drained: nothing written, the answer still kept
                        self.encoder.add(ev.chunk)
                elif type(ev) is Finished:
                    await self._end(send, ev, together)
                elif type(ev) is Queued:
                    if self.presence is _THERE:
                        await send(_body(sse.comment(f"queued bid={sse.fmt_price(ev.bid)}")))
                        self._last = loop.time()
                elif type(ev) is Requeued and self.presence is _THERE:
                    await send(_body(sse.REQUEUED))
                    self._last = loop.time()
        finally:
            self._stop_ticking()
            await events.aclose()

    async def _end(self, send: Send, fin: Finished, together: list[bytes]) -> None:
        """The last write: frames still together (not expected: an engine's last chunk
        says no ``more``), then the tail."""
        self._stop_ticking()
        encoded = None if self.encoder is None else await self.encoder.tail(fin)
        if self.presence is _GONE:
            return
        tail = self._tail(fin) if encoded is None else encoded
        if together:
            tail = b"".join(together) + tail
            together.clear()
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    def _framer(self) -> Callable[[dict[str, Any]], bytes] | None:
        """How a chunk becomes its frames: shaped by the policy (:meth:`_shaped`) or
        another API's encoder; None: as it is (``data: <chunk>``, made in the loop)."""
        if self.encoder is not None:
            return self.encoder.frames
        shapes = self._hold_terminal or self.policy.split_role_and_finish
        return self._shaped if shapes else None

    def _shaped(self, chunk: dict[str, Any]) -> bytes:
        """The frames of ``chunk`` under the policy: split (role, content, finish), and
        the terminal chunk held back (a chunk held before is written first)."""
        chunks = split_role_and_finish(chunk) if self.policy.split_role_and_finish else [chunk]
        if self._held is not None:
            chunks.insert(0, self._held)
            self._held = None
        if self._hold_terminal and has_finish(chunks[-1]):
            self._held = chunks.pop()
        return b"".join(sse.data_frame(orjson.dumps(c)) for c in chunks)

    def _tail(self, fin: Finished) -> bytes:
        """The frames after the last chunk (:func:`~bourse.http.relay_tail.tail`); the
        terminal chunk held back goes out with them."""
        held, self._held = self._held, None
        return tail(self.run, fin, held, self._hold_terminal)

    # -- not streamed -------------------------------------------------------------

    async def _unary(self, send: Send) -> None:
        run, terms, policy = self.run, self.terms, self.policy
        agg = Aggregator(terms.ask.kind, policy.reasoning_field)
        add = agg.add if self.encoder is None else self.encoder.add
        fin: Finished | None = None
        events = run.events()
        try:
            async for ev in events:
                if type(ev) is ChunkEvent:
                    add(ev.chunk)
                elif type(ev) is Finished:
                    fin = ev
        finally:
            await events.aclose()
        if fin is None:
            return
        self._enter(_CLOSING)  # the client leaving now changes nothing
        encoded = None if self.encoder is None else await self.encoder.document(fin)
        rid = terms.request_id
        headers = [
            (b"content-type", b"application/json"),
            *_encoded(policy.id_headers(rid)),
            *self._money_headers(fin),
        ]
        if fin.error is not None:
            err: GatewayError = fin.error
            body = orjson.dumps({"error": err.envelope()})
            headers.extend((k.encode(), v.encode()) for k, v in err.headers.items())
            status = err.status
        else:
            if encoded is None:
                encoded = agg.build(rid, terms.ask.market.product, run.created, fin.usage)
                encoded[policy.receipt_name] = fin.receipt
            body = orjson.dumps(encoded)
            status = 200
        if self.on_done is not None:
            if fin.error is None or (fin.error.status < 500 and fin.error.status not in (408, 429)):
                await self._keep(status, ({k.decode(): v.decode() for k, v in headers}, body))
            else:
                await self._keep(status, None)
        if self.presence is _GONE:
            return
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
