"""Group commit per partition: the concurrent writes of one hot row share a transaction.

Every hold and every settlement of an account updates that account's row, and a row
lock is held until the transaction commits, so one busy account is written one
transaction (one commit) at a time. A :class:`Coalescer` keeps one writer per
partition (an account) in this process: a write that finds its partition idle runs
alone, at once, as it always did; the writes that arrive while it runs wait and then
go together, as one batch, in one transaction that takes the row once. Unloaded, it
costs nothing; loaded, a commit carries as many writes as have queued up.

A batch function answers each item separately (a value or the exception that item
alone would have raised), so a refused item never fails its neighbours. A write that
finds the database unavailable (``fail_together``) is the exception: the writes queued
behind it get the same answer at once, rather than each waiting out the one before it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

I = TypeVar("I")  # noqa: E741 (an item)
R = TypeVar("R")

MAX_BATCH = 128
"""The most writes one transaction carries (the rest go in the next one)."""


class Coalescer(Generic[I, R]):
    """One writer per partition key; the writes queued behind it go as one batch."""

    def __init__(
        self,
        one: Callable[[I], Awaitable[R]],
        many: Callable[[list[I]], Awaitable[list[R | Exception]]],
        *,
        max_batch: int = MAX_BATCH,
        fail_together: tuple[type[Exception], ...] = (),
    ) -> None:
        self._one = one
        self._many = many
        self._max = max(1, max_batch)
        self._fail_together = fail_together
        """A write that fails with one of these (the database is unavailable) fails the
        writes queued behind it at once, with the same error: each would otherwise wait
        out the one before it and then its own timeout."""
        self._queues: dict[Hashable, list[tuple[I, asyncio.Future[R]]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, key: Hashable, item: I) -> R:
        """``item``'s outcome: run alone when ``key`` is idle, else in the next batch."""
        queue = self._queues.get(key)
        if queue is None:
            self._queues[key] = []
            failure = None
            try:
                return await self._one(item)
            except self._fail_together as exc:
                failure = exc
                raise
            finally:
                self._next(key, failure)
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        queue.append((item, fut))
        return await fut

    def _next(self, key: Hashable, failure: Exception | None = None) -> None:
        """The partition's writer is done: the queued writes go next (in a task of
        their own, so no caller's cancellation stops them), or fail with ``failure``
        (see ``fail_together``), or the partition is idle."""
        queue = self._queues[key]
        if failure is not None:
            del self._queues[key]
            for _, fut in queue:
                if not fut.done():
                    fut.set_exception(failure)
            return
        if not queue:
            del self._queues[key]
            return
        batch, self._queues[key] = queue[: self._max], queue[self._max :]
        task = asyncio.get_running_loop().create_task(self._drain(key, batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, key: Hashable, batch: list[tuple[I, asyncio.Future[R]]]) -> None:
        items = [item for item, _ in batch]
        failure = None
        try:
            outcomes = await self._run(items)
            if self._fail_together:
                failure = next((o for o in outcomes if isinstance(o, self._fail_together)), None)
        except asyncio.CancelledError:
            for _, fut in batch:
                fut.cancel()
            raise
        finally:
            self._next(key, failure)
        for (_, fut), out in zip(batch, outcomes, strict=True):
            if fut.done():  # its caller was cancelled; its write stands
                continue
            if isinstance(out, Exception):
                fut.set_exception(out)
            else:
                fut.set_result(out)

    async def _run(self, items: list[I]) -> list[R | Exception]:
        try:
            if len(items) == 1:
                return [await self._one(items[0])]
            return await self._many(items)
        except Exception as exc:
            return [exc] * len(items)
