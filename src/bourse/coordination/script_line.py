"""The scripts' own line to Redis (issue 40 item 4: replicas near one process): one
connection, every call pipelined on it, read by hiredis straight from the socket.

redis-py's asyncio client costs a script call far more than its round trip: a pool
checkout under a lock, a probe of the connection for stray data (a zero-timeout read
that takes a turn of the loop), a timeout context and a stream reader per answer.
A :class:`ScriptLine` is an :class:`asyncio.Protocol` on one connection: a call packs
its ``EVALSHA`` (the book's keys and terms encoded once by the caller), queues its
future and its bytes; the calls made in one turn of the loop go out in one write at
its end; the answers come back in the order sent (Redis answers a connection's
commands in order) and each resolves its caller's future, or raises its own error.
A caller that stops waiting (cancelled) leaves its call sent; its answer is dropped.

Failures, as the redis-py client of :class:`~bourse.coordination.redis_hub.RedisHub`
had them: a connection that fails (Redis restarted) fails the calls on it with
:class:`redis.exceptions.ConnectionError`, and a call that fails so (or that finds Redis
still loading its data after a restart) is made again on a new connection (four
attempts in all, 40, 80 and 160 ms apart, as the hub's redis-py client retried); a
call after :meth:`ScriptLine.aclose` fails at once. An answer hiredis cannot decode
as UTF-8 fails its own call only (a :class:`redis.exceptions.ResponseError`), not the
connection, so nothing sent with it is made again. A call without an
answer within ``timeout_s`` fails with :class:`redis.exceptions.TimeoutError` (not
made again: it may have run) and the connection is dropped, so a half-dead one does
not outlive it. A script Redis does not know (a restart emptied its cache) is loaded
again by its script object and the call made once more. ``rediss://`` (TLS) is not
spoken here: the hub keeps redis-py's path for it (:func:`usable`).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any, cast

import hiredis
from redis.asyncio.connection import ConnectionPool, UnixDomainSocketConnection
from redis.commands.core import AsyncScript
from redis.exceptions import BusyLoadingError, NoScriptError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

ATTEMPTS = 4
"""A call that finds its connection failed is made this many times at most (redis-py's
``Retry(ExponentialBackoff(cap=0.5, base=0.02), 3)`` of the hub's client: 3 retries)."""
BACKOFF_S = 0.04
"""The wait before the second attempt (doubled before each next one: 40, 80, 160 ms)."""
BACKOFF_CAP_S = 0.5
"""No wait between attempts is longer."""


def usable(url: str) -> bool:
    """Whether a :class:`ScriptLine` speaks to ``url`` (plain TCP or a Unix socket)."""
    return url.startswith(("redis://", "unix://"))


def _encode(v: Any) -> bytes:
    t = type(v)
    if t is bytes:
        return cast(bytes, v)
    if t is str:
        return cast(str, v).encode()
    if t is int or t is float:
        return repr(v).encode()
    # subclasses, as redis-py's encoder takes them (a boolean it refuses, and so here)
    if isinstance(v, bytes):
        return bytes(v)
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return repr(v).encode()
    raise TypeError(f"not a Redis argument: {t.__name__}")


def _body(args: Sequence[Any]) -> bytes:
    """``args`` as the bulk strings of a RESP command (without its count)."""
    parts = []
    for a in args:
        b = _encode(a)
        parts.append(b"$%d\r\n%b\r\n" % (len(b), b))
    return b"".join(parts)


def pack(args: Sequence[Any]) -> bytes:
    """``args`` as one RESP command."""
    return b"*%d\r\n" % len(args) + _body(args)


PREFIXES_MAX = 256
"""Packed script prefixes kept (one per script and book: a few dozen)."""


def _error(reply: Exception) -> RedisError:
    """An error reply as redis-py raises it: a script Redis does not know, Redis still
    loading its data (a connection error to redis-py: made again), or the script's own."""
    msg = str(reply)
    if msg.startswith("NOSCRIPT"):
        return NoScriptError(msg)
    if msg.startswith("LOADING"):
        return BusyLoadingError(msg)
    return ResponseError(msg)


class _Connection(asyncio.Protocol):
    """One connection: the futures of the calls sent on it, in order."""

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeout_s = timeout_s
        self._reader = hiredis.Reader(encoding="utf-8")
        self._waiting: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self._out: list[bytes] = []
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.writes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        """Queue one command; it goes at the end of this turn of the loop."""
        if self.closed:
            raise RedisConnectionError("the connection to Redis is closed")
        loop = self._loop
        fut = loop.create_future()
        now = loop.time()
        self._waiting.append((fut, now))
        if not self._out:
            loop.call_soon(self._flush)
        self._out.append(packed)
        if self._timer is None:
            self._timer = loop.call_at(now + self._timeout_s, self._check)
        return fut

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and self._transport is not None and not self.closed:
            self.writes += 1
            self._transport.write(b"".join(out))

    def _check(self) -> None:
        """The oldest call past its timeout drops the connection; else look again then."""
        self._timer = None
        if not self._waiting:
            return
        due = self._waiting[0][1] + self._timeout_s
        if due <= self._loop.time():
            self._fail(RedisTimeoutError(f"no answer from Redis within {self._timeout_s:g} s"))
            return
        self._timer = self._loop.call_at(due, self._check)

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiting = self._waiting
        while True:
            bad: RedisError | None = None
            try:
                reply = reader.gets()
            except hiredis.ProtocolError as exc:
                self._fail(RedisConnectionError(f"Redis protocol error: {exc}"))
                return
            except UnicodeDecodeError as exc:  # read, not decoded: only its caller fails
                reply, bad = (
                    None,
                    ResponseError(f"an answer from Redis that is not UTF-8 text ({exc.reason})"),
                )
            if reply is False:
                return
            if not waiting:  # an answer nobody asked for: the stream is out of step
                self._fail(RedisConnectionError("an answer from Redis with no call waiting"))
                return
            fut = waiting.popleft()[0]
            if fut.done():  # its caller stopped waiting
                continue
            if bad is not None:
                fut.set_exception(bad)
            elif isinstance(reply, hiredis.ReplyError):
                fut.set_exception(_error(reply))
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(
            RedisConnectionError(f"the connection to Redis was lost ({exc or 'closed by the server'})")
        )

    def _fail(self, exc: Exception) -> None:
        """Close, and fail every call still waiting with ``exc``."""
        self.closed = True
        self._out = []
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None:
            self._transport.abort()
        waiting, self._waiting = self._waiting, collections.deque()
        for fut, _ in waiting:
            if not fut.done():
                fut.set_exception(exc)

    def close(self) -> None:
        self._fail(RedisConnectionError("the script line was closed"))


class ScriptLine:
    """The hub's script calls on one pipelined connection (opened on first use, and
    again after a failure)."""

    def __init__(self, url: str, scripts: dict[str, AsyncScript], *, timeout_s: float = 5.0) -> None:
        pool = ConnectionPool.from_url(url)
        self._kwargs = dict(pool.connection_kwargs)
        self._unix = issubclass(pool.connection_class, UnixDomainSocketConnection)
        self._scripts = scripts
        self._prefixes: dict[tuple[str, int, int], tuple[object, object, bytes, int]] = {}
        """By (script, id of its keys, id of its head): (keys, head, packed, count); a
        caller's keys and head, encoded once (checked by identity, so never stale)."""
        self._timeout_s = timeout_s
        self._conn: _Connection | None = None
        self._opening: asyncio.Task[_Connection] | None = None
        self._closed = False
        """Closed by :meth:`aclose`: a later call fails at once, opening nothing."""
        self.calls = 0
        self.connections = 0

    @property
    def writes(self) -> int:
        """Writes on the current connection (each one or more calls)."""
        return 0 if self._conn is None else self._conn.writes

    def _prefix(self, name: str, keys: Sequence[str | bytes], head: Sequence[Any]) -> tuple[bytes, int]:
        """``EVALSHA``, the script's hash, ``keys`` and ``head`` packed, and their count;
        kept when there is a ``head`` (a caller that passes one keeps its keys and head)."""
        key = (name, id(keys), id(head))
        got = self._prefixes.get(key) if head else None
        if got is not None and got[0] is keys and got[1] is head:
            return got[2], got[3]
        words = [b"EVALSHA", self._scripts[name].sha, len(keys), *keys, *head]
        body = _body(words)
        if head:
            if len(self._prefixes) >= PREFIXES_MAX:
                self._prefixes.clear()
            self._prefixes[key] = (keys, head, body, len(words))
        return body, len(words)

    async def call(
        self, name: str, keys: Sequence[str | bytes], args: Sequence[Any], head: Sequence[Any] = ()
    ) -> Any:
        """Script ``name`` with ``keys`` and ``[*head, *args]`` (a caller's ``keys`` and
        ``head``, when it keeps them the same objects from call to call, are packed once)."""
        self.calls += 1
        prefix, count = self._prefix(name, keys, head)
        packed = b"*%d\r\n%b%b" % (count + len(args), prefix, _body(args))
        wait = BACKOFF_S
        for attempt in range(ATTEMPTS):
            conn = self._conn
            try:
                if self._closed:
                    raise RedisConnectionError("the script line is closed")
                if conn is None or conn.closed:
                    conn = await self._connect()
                return await conn.send(packed)
            except NoScriptError:
                return await self._scripts[name](keys=list(keys), args=[*head, *args])
            except RedisConnectionError:
                if attempt + 1 == ATTEMPTS or self._closed:
                    raise
            await asyncio.sleep(wait)
            wait = min(BACKOFF_CAP_S, wait * 2)
        raise AssertionError("unreachable")

    async def _connect(self) -> _Connection:
        task = self._opening
        if task is None:
            task = self._opening = asyncio.get_running_loop().create_task(self._open())
            task.add_done_callback(self._opened)
        try:
            conn = await asyncio.shield(task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task.cancelled() and self._closed and (me is None or not me.cancelling()):
                raise RedisConnectionError("the script line is closed") from None  # not this caller's cancel
            raise
        self._conn = conn
        return conn

    def _opened(self, task: asyncio.Task[_Connection]) -> None:
        if self._opening is task:
            self._opening = None
        if not task.cancelled() and task.exception() is None:
            self._conn = task.result()
        elif not task.cancelled():
            task.exception()  # retrieved: each caller got it already

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        kw = self._kwargs
        timeout = kw.get("socket_connect_timeout") or self._timeout_s
        try:
            async with asyncio.timeout(timeout):
                if self._unix:
                    _, conn = await loop.create_unix_connection(
                        lambda: _Connection(self._timeout_s), kw["path"]
                    )
                else:
                    _, conn = await loop.create_connection(
                        lambda: _Connection(self._timeout_s),
                        kw.get("host", "localhost"),
                        kw.get("port", 6379),
                    )
                try:
                    if kw.get("password"):
                        user = kw.get("username")
                        auth = ["AUTH", user, kw["password"]] if user else ["AUTH", kw["password"]]
                        await conn.send(pack(auth))
                    if int(kw.get("db") or 0):
                        await conn.send(pack(["SELECT", int(kw["db"])]))
                except BaseException:
                    conn.close()
                    raise
        except TimeoutError as exc:
            raise RedisConnectionError(f"Redis did not answer a connection within {timeout:g} s") from exc
        except OSError as exc:
            raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
        self.connections += 1
        return conn

    async def aclose(self) -> None:
        self._closed = True
        if self._opening is not None:
            self._opening.cancel()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
