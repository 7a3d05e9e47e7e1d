"""Replicas of one test's Redis cluster: hubs sharing one fresh key prefix.

Each :meth:`Replicas.hub` is one replica (its own connection pool, admission
channel and heartbeat). :meth:`Replicas.crash` stops a hub the way ``kill -9``
would: no graceful book close, no removal from ``{prefix}:replicas``.
:meth:`Replicas.pause` stops it the way ``SIGSTOP`` would: no heartbeat, and the
admission messages it receives are held until :meth:`Replicas.resume` hands them
over (as a stopped process reads its socket once it runs again).
:meth:`Replicas.aclose` closes the live hubs and deletes every key of the prefix.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from bourse.coordination.redis_hub import RedisHub


class Replicas:
    def __init__(self, url: str) -> None:
        self.url = url
        self.prefix = "t" + os.urandom(6).hex()
        self.hubs: list[RedisHub] = []
        self.crashed: list[RedisHub] = []
        self._held: dict[str, list[tuple[Any, tuple[Any, ...]]]] = {}
        self.admin = aioredis.from_url(url, decode_responses=True)

    async def hub(self, *, lease_s: float = 3.0, **kw: Any) -> RedisHub:
        hub = RedisHub(self.url, prefix=self.prefix, lease_s=lease_s, **kw)
        self.hubs.append(hub)
        await hub.start()
        return hub

    async def crash(self, hub: RedisHub) -> None:
        """Stop ``hub`` without any cleanup: its orders and slots stay in Redis until
        their leases lapse, its replica entry stays until it expires."""
        tasks = [*hub._tasks, *hub._background]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        hub._tasks.clear()
        hub._books.clear()
        await hub.redis.aclose()
        if hub.line is not None:
            await hub.line.aclose()
        self.crashed.append(hub)

    async def kill_listener(self, hub: RedisHub) -> None:
        """Stop the admission listener of ``hub`` (its heartbeat goes on)."""
        [listener] = [t for t in hub._tasks if t.get_name() == "bourse-redis-admissions"]
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)

    async def pause(self, hub: RedisHub) -> list[tuple[Any, tuple[Any, ...]]]:
        """Stop ``hub``'s heartbeat and hold back the admissions its channel delivers;
        the held messages (book, arguments) are returned, filled while it is paused."""
        [beat] = [t for t in hub._tasks if t.get_name() == "bourse-redis-heartbeat"]
        beat.cancel()
        await asyncio.gather(beat, return_exceptions=True)
        hub._tasks.remove(beat)
        held: list[tuple[Any, tuple[Any, ...]]] = []
        for book in hub._books.values():

            def hold(*args: Any, book: Any = book) -> None:
                held.append((book, args))

            book.on_admitted = hold  # type: ignore[method-assign,assignment]
        self._held[hub.replica] = held
        return held

    async def resume(self, hub: RedisHub) -> None:
        """Run ``hub`` again: its heartbeat restarts and the held admissions are delivered."""
        for book in hub._books.values():
            del book.on_admitted
        for book, args in self._held.pop(hub.replica, []):
            book.on_admitted(*args)
        hub._tasks.append(asyncio.create_task(hub._heartbeat(), name="bourse-redis-heartbeat"))

    async def subscribers(self, hub: RedisHub) -> int:
        counts = await self.admin.pubsub_numsub(hub.channel_prefix + hub.replica)
        return int(counts[0][1])

    async def replica_lease_ms(self, hub: RedisHub) -> float | None:
        """The expiry (Redis ms) of ``hub``'s entry in ``{prefix}:replicas``."""
        return await self.admin.zscore(f"{self.prefix}:replicas", hub.replica)

    async def now_ms(self) -> int:
        sec, usec = await self.admin.time()
        return int(sec) * 1000 + int(usec) // 1000

    async def keys(self) -> list[str]:
        return [k async for k in self.admin.scan_iter(match=f"*{self.prefix}*", count=1000)]

    async def aclose(self) -> None:
        try:
            for hub in self.hubs:
                if hub not in self.crashed:
                    await hub.aclose()
        finally:
            keys = await self.keys()
            if keys:
                await self.admin.delete(*keys)
            await self.admin.aclose()


async def eventually(
    check: Callable[[], Awaitable[bool]], *, within: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``check`` until it is true; fail after ``within`` seconds (generous: the
    adapters are asynchronous, and the machine may be loaded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        if await check():
            return
        if loop.time() > end:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.01)
