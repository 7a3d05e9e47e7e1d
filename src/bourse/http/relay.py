"""The relay: one ASGI response that runs a :class:`~bourse.services.completion.Run`
and writes it to the client, as SSE frames or as one JSON body.

Two tasks per request: the relay itself (reads the run, writes frames) and a
listener (waits for ``http.disconnect``). A streamed request also has a timer for
the quiet-interval frames of SPEC section 4 (``: queued level=… position=…`` while
in the book, ``: waiting`` once admitted, ``: keep-alive`` once output began): it
fires once per quiet interval and starts a short task only to write such a frame. A disconnect
cancels the relay, which stops the engine through the run; under the ``drain``
policy an admitted run is read to its end instead, with nothing written.

The per-chunk path is: rewrite (done by the run) -> ``orjson.dumps`` -> one
``send``. Nothing waits: chunks that reached the engine together (one upstream read;
the engine marks all but the last with ``more``) go out together in one ``send``,
which saves a write per chunk and delays none.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.types import Message, Receive, Scope, Send

from bourse.domain.errors import GatewayError
from bourse.ports.engine import ChunkEvent
from bourse.services.completion import ADMITTED, QUEUED, STREAMING, Finished, Queued, Requeued, Run
from bourse.wire import sse
from bourse.wire.chunks import Aggregator, error_frame, usage_chunk

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache, no-transform"),
    (b"x-accel-buffering", b"no"),
]


log = logging.getLogger("bourse.relay")

OnDone = Callable[[int, dict[str, str], bytes | None], Awaitable[None]]
"""Called once with the final status, headers and body (None: no answer to keep)."""


def _body(data: bytes) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": True}


class RunResponse:
    """ASGI response for one run (streamed or not)."""

    __slots__ = (
        "_closing",
        "_gone",
        "_interval",
        "_last",
        "_loop",
        "_main",
        "_send",
        "_sending",
        "_ticking",
        "_timer",
        "_we_cancelled",
        "on_done",
        "run",
        "started",
    )

    def __init__(self, run: Run, on_done: OnDone | None = None) -> None:
        self.run = run
        self.on_done = on_done
        self._gone = False
        self._sending = False
        self._closing = False
        self._last = 0.0
        self._interval = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._send: Send | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._ticking: asyncio.Task[None] | None = None
        self._main: asyncio.Task[Any] | None = None
        self._we_cancelled = False
        # True once the response head is sent: a failure after it cannot become an error response
        self.started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._main = asyncio.current_task()
        listener = asyncio.create_task(self._listen(receive))
        try:
            if self.run.stream:
                await self._stream(send)
            else:
                await self._unary(send)
        except asyncio.CancelledError:
            if not self._we_cancelled:
                raise
            task = self._main
            if task is not None:
                task.uncancel()
        finally:
            listener.cancel()
            if self.run.finished is None:
                # the run never reached its end (client gone before the first
                # frame, or a relay failure): give back its slot and money
                await self.run.abandon()
            if self.on_done is not None:
                # streamed: the key now points at the receipt; not streamed and no
                # answer (client gone): forget the key so a retry can run
                await self._keep(409, self._stream_replay() if self.run.stream else None)

    async def _keep(self, status: int, payload: tuple[dict[str, str], bytes] | None) -> None:
        assert self.on_done is not None
        try:
            if payload is None:
                await self.on_done(status, {}, None)
            else:
                await self.on_done(status, payload[0], payload[1])
        except Exception:
            log.exception("could not store the idempotent answer of %s", self.run.request_id)
        self.on_done = None

    def _stream_replay(self) -> tuple[dict[str, str], bytes]:
        rid = self.run.request_id
        err = GatewayError(
            409,
            "idempotency_conflict",
            f"This Idempotency-Key was used for a streamed request ({rid}); a stream cannot be replayed. "
            f"Its receipt is at GET /v1/usage/{rid}.",
        )
        return {"content-type": "application/json", "x-request-id": rid}, orjson.dumps(
            {"error": err.envelope()}
        )

    def _money_headers(self, fin: Finished | None) -> list[tuple[bytes, bytes]]:
        run = self.run
        prefix = run.market.policy.header_prefix
        out = [(f"{prefix}quote-micros".encode(), str(run.quote_micros).encode())]
        if fin is not None:
            out.append((f"{prefix}cost-micros".encode(), str(fin.cost_micros).encode()))
            out.append((f"{prefix}latency-ms".encode(), str(fin.receipt["latency_ms"]).encode()))
        if run.ratelimit_headers:
            out.extend((k.encode(), v.encode()) for k, v in run.ratelimit_headers.items())
        return out

    # -- client ---------------------------------------------------------------

    async def _listen(self, receive: Receive) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
        run = self.run
        self._gone = True
        run.client_left = True
        if run.phase >= ADMITTED and run.market.policy.on_disconnect == "drain":
            return  # keep reading the engine to its end; nothing more is written
        if self._main is not None and not self._closing:
            self._we_cancelled = True
            self._main.cancel()

    def _arm(self) -> None:
        """Check for a quiet interval when the current one would end (a timer, not a task)."""
        assert self._loop is not None
        self._timer = self._loop.call_at(self._last + self._interval, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._closing:
            return
        assert self._loop is not None
        now = self._loop.time()
        if self._sending or self._gone:
            self._last = now
        if self._last + self._interval > now:
            self._arm()
            return
        run = self.run
        phase = run.phase
        frame: bytes | None
        if phase == QUEUED and run.order is not None:
            frame = None  # the level and position are asked of the book first
        elif phase == ADMITTED:
            frame = sse.WAITING
        elif phase == STREAMING:
            frame = sse.KEEP_ALIVE
        else:
            return
        self._sending = True
        self._ticking = asyncio.create_task(self._tick(frame))

    async def _tick(self, frame: bytes | None) -> None:
        assert self._send is not None and self._loop is not None
        try:
            if frame is None:
                frame = await self._queued_frame()
                if frame is None:
                    return
            await self._send(_body(frame))
        finally:
            self._sending = False
            self._ticking = None
            self._last = self._loop.time()
            if not self._closing:
                self._arm()

    async def _queued_frame(self) -> bytes | None:
        """``: queued level=… position=…`` from the book (shared books answer over the
        network); None if the order was admitted or the client left meanwhile."""
        run = self.run
        level, pos = await run.market.standing(run.order)  # its last known view if unreachable
        if run.phase != QUEUED or self._gone or self._closing:
            return None
        return sse.comment(f"queued level={sse.fmt_price(level)} position={max(pos, 0)}")

    def _stop_ticking(self) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._ticking is not None:
            self._ticking.cancel()
            self._ticking = None

    # -- streamed ---------------------------------------------------------------

    async def _stream(self, send: Send) -> None:
        run = self.run
        loop = asyncio.get_running_loop()
        headers = [*_SSE_HEADERS, (b"x-request-id", run.request_id.encode()), *self._money_headers(None)]
        self.started = True
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        self._loop = loop
        self._interval = run.market.policy.quiet_interval_s
        self._send = send
        self._last = loop.time()
        self._arm()
        events = run.events()
        dumps = orjson.dumps
        together: list[bytes] = []  # frames of chunks that arrived with the next one
        try:
            async for ev in events:
                if type(ev) is ChunkEvent:
                    if not self._gone:
                        frame = b"data: %b\n\n" % dumps(ev.chunk)
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
                elif type(ev) is Finished:
                    self._stop_ticking()
                    if not self._gone:
                        tail = self._tail(ev)
                        if together:  # not expected: an engine's last chunk says no ``more``
                            tail = b"".join(together) + tail
                            together.clear()
                        await send({"type": "http.response.body", "body": tail, "more_body": False})
                elif type(ev) is Queued:
                    if not self._gone:
                        await send(_body(sse.comment(f"queued bid={sse.fmt_price(ev.bid)}")))
                        self._last = loop.time()
                elif type(ev) is Requeued and not self._gone:
                    await send(_body(sse.REQUEUED))
                    self._last = loop.time()
        finally:
            self._stop_ticking()
            await events.aclose()

    def _tail(self, fin: Finished) -> bytes:
        run = self.run
        policy = run.market.policy
        out = b""
        if fin.error is not None:
            if run.include_usage and fin.text_tokens:
                out += self._usage_frame(fin)
            frame = error_frame(
                run.kind, run.request_id, run.product, run.created, fin.error, policy.error_finish_reason
            )
            out += sse.data_frame(orjson.dumps(frame))
            if policy.done_after_error:
                out += sse.DONE
            return out
        if run.include_usage:
            out += self._usage_frame(fin)
        return out + sse.DONE

    def _usage_frame(self, fin: Finished) -> bytes:
        run = self.run
        chunk = usage_chunk(
            run.kind,
            run.request_id,
            run.product,
            run.created,
            fin.usage,
            run.market.policy.receipt_name,
            fin.receipt,
        )
        return sse.data_frame(orjson.dumps(chunk))

    # -- not streamed -------------------------------------------------------------

    async def _unary(self, send: Send) -> None:
        run = self.run
        agg = Aggregator(run.kind, run.market.policy.reasoning_field)
        fin: Finished | None = None
        events = run.events()
        try:
            async for ev in events:
                if type(ev) is ChunkEvent:
                    agg.add(ev.chunk)
                elif type(ev) is Finished:
                    fin = ev
        finally:
            await events.aclose()
        if fin is None:
            return
        rid = run.request_id
        headers = [
            (b"content-type", b"application/json"),
            (b"x-request-id", rid.encode()),
            *self._money_headers(fin),
        ]
        if fin.error is not None:
            err: GatewayError = fin.error
            body = orjson.dumps({"error": err.envelope()})
            headers.extend((k.encode(), v.encode()) for k, v in err.headers.items())
            status = err.status
        else:
            usage = fin.usage
            doc = agg.build(rid, run.product, run.created, usage)
            doc[run.market.policy.receipt_name] = fin.receipt
            body = orjson.dumps(doc)
            status = 200
        if self.on_done is not None:
            if fin.error is None or (fin.error.status < 500 and fin.error.status not in (408, 429)):
                await self._keep(status, ({k.decode(): v.decode() for k, v in headers}, body))
            else:
                await self._keep(status, None)
        if self._gone:
            return
        headers.append((b"content-length", str(len(body)).encode()))
        self.started = True
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
