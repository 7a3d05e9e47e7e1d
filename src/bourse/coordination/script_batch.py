"""Script calls sent together (issue 40 item 4: replicas near one process): the
calls a replica makes to Redis while another is on its way go out as one pipeline.

A call alone (nothing sent and unanswered, nothing waiting) is sent at once, as
``EVALSHA``: at low load nothing changes. A call made while others are on their way
waits for the end of the loop's turn, with every other call made in it, and they go
as one pipeline (``transaction=False``: one write, one read of every answer; no
``MULTI``): under load a request's round trip costs a share of one. Each caller gets
its own answer, or its own error (a script's error is its call's alone; a connection
that fails fails the calls sent on it, as before). A script Redis does not know (a
restart emptied its cache) is loaded again by its script object and that call run
once more, as :meth:`RedisHub.call` always did. Calls in one pipeline run in the order
they were made (before, calls made together went on separate connections, in no
order). A caller that stops waiting (cancelled) leaves its call sent: its answer is
dropped, as a cancelled call's could have run already.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

MAX_BATCH = 128
"""Calls in one pipeline at most (more wait for the next)."""
MAX_IN_FLIGHT = 2
"""Round trips on their way at once (each on its own pooled connection): a call made
while all are out waits for one to come back, with every call made meanwhile, and
they go together. A lane that stalls (a half-dead connection) holds its calls up to
the client's socket timeout, the other lanes go on."""

_Call = tuple[str, Sequence[str | bytes], Sequence[Any], "asyncio.Future[Any]"]


class ScriptBatch:
    def __init__(self, redis: Callable[[], aioredis.Redis], scripts: dict[str, AsyncScript]) -> None:
        self._redis = redis
        """The client to send through (read at each send: the hub's)."""
        self._scripts = scripts
        self._pending: list[_Call] = []
        self._flushing = False
        self._unanswered = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.round_trips = 0
        """Round trips made (a pipeline counts once): what the calls cost."""
        self.calls = 0

    async def call(self, name: str, keys: Sequence[str | bytes], args: Sequence[Any]) -> Any:
        self.calls += 1
        if self._unanswered < MAX_IN_FLIGHT and not self._pending:  # a lane free: straight away
            self._unanswered += 1
            self.round_trips += 1
            try:
                return await self._one(name, keys, args)
            finally:
                self._answered()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((name, keys, args, fut))
        self._schedule()
        return await fut

    def _answered(self) -> None:
        self._unanswered -= 1
        if self._pending:
            self._schedule()

    def _schedule(self) -> None:
        """Send what waits at the end of this turn, if a lane is free (else when one is)."""
        if not self._flushing and self._unanswered < MAX_IN_FLIGHT:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def _one(self, name: str, keys: Sequence[str | bytes], args: Sequence[Any]) -> Any:
        script = self._scripts[name]
        try:
            return await self._redis().evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await script(keys=list(keys), args=list(args))

    def _flush(self) -> None:
        self._flushing = False
        while self._pending and self._unanswered < MAX_IN_FLIGHT:
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            batch = [c for c in batch if not c[3].done()]  # its caller gone before it was sent
            if not batch:
                continue
            self._unanswered += 1
            self.round_trips += 1
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[_Call]) -> None:
        try:
            if len(batch) == 1:
                name, keys, args, fut = batch[0]
                try:
                    res: Any = await self._one(name, keys, args)
                except Exception as exc:
                    res = exc
                _answer(fut, res)
                return
            pipe = self._redis().pipeline(transaction=False)
            for name, keys, args, _ in batch:
                pipe.evalsha(self._scripts[name].sha, len(keys), *keys, *args)
            try:
                results = await pipe.execute(raise_on_error=False)
            except BaseException as exc:  # the connection failed (or the task was cancelled: a stop)
                for *_, fut in batch:
                    _answer(fut, exc if isinstance(exc, Exception) else asyncio.CancelledError())
                if not isinstance(exc, Exception):
                    raise
                return
            for (name, keys, args, fut), res in zip(batch, results, strict=True):
                if isinstance(res, NoScriptError) and not fut.done():
                    try:
                        res = await self._scripts[name](keys=list(keys), args=list(args))
                    except Exception as exc:
                        res = exc
                _answer(fut, res)
        finally:
            self._answered()


def _answer(fut: asyncio.Future[Any], res: Any) -> None:
    if fut.done():  # its caller stopped waiting
        return
    if isinstance(res, asyncio.CancelledError):
        fut.cancel()
    elif isinstance(res, BaseException):
        fut.set_exception(res)
    else:
        fut.set_result(res)
