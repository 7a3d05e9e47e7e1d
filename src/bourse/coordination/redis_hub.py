"""This replica's link to Redis: the connection pool, the scripts, the admission
channel and the heartbeat.

- Every replica has an id and subscribes to ``{prefix}:admit:{id}``; the book's
  scripts publish there the moment one of its orders gets a slot, so a waiter
  learns of its admission at once, not on a timer.
- A heartbeat every ``lease_s / 3`` renews this replica's entry in
  ``{prefix}:replicas`` and the leases of every order it waits on or holds, and
  reconciles its books (an admission whose message was lost is picked up there).
  A replica that stops beating (kill -9) loses its slots once the lease lapses and
  its waiting orders are parked (kept in place, admitted to nobody); the next clear
  by any replica gives the slots back. Each step of a heartbeat runs on its own, so
  an unreachable Redis delays none of the others.
- Calls retry a connection that fails (a pooled connection Redis closed when it
  restarted fails once, then reconnects), so no dead connection outlives a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from importlib import resources
from typing import Any, Protocol, cast

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError

from bourse.coordination import script_line
from bourse.coordination.script_batch import ScriptBatch
from bourse.coordination.script_line import ScriptLine
from bourse.retrying import retrying

log = logging.getLogger("bourse.coordination")

BOOK_SCRIPTS = (
    "SUBMIT",
    "TAKE",
    "REMOVE",
    "RELEASE",
    "COOL",
    "HEARTBEAT",
    "STANDING",
    "VIEW",
    "FAILED",
    "REBID",
)
"""The book's scripts: ``lua/book.lua`` (what they share) followed by ``lua/book_{name}.lua``."""
RATE_SCRIPTS = ("RATE_ACQUIRE", "RATE_FINISH")
"""The rate limiter's scripts: ``lua/{name}.lua``, each on its own."""


def load_scripts() -> dict[str, str]:
    """Every Lua script by name (as :meth:`RedisHub.call` names them), read from the package."""
    lua = resources.files("bourse.coordination").joinpath("lua")
    common = lua.joinpath("book.lua").read_text(encoding="utf-8")
    out = {
        name: common + lua.joinpath(f"book_{name.lower()}.lua").read_text(encoding="utf-8")
        for name in BOOK_SCRIPTS
    }
    for name in RATE_SCRIPTS:
        out[name] = lua.joinpath(f"{name.lower()}.lua").read_text(encoding="utf-8")
    return out


class ReplicaBook(Protocol):
    product: str

    def on_admitted(self, order_id: str, deployment: str, price: str, level: str, attempt: int) -> None: ...

    async def heartbeat(self) -> None: ...

    async def aclose(self) -> None: ...


class RedisHub:
    """One per process: shared by the books and the rate limiter."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "bourse",
        lease_s: float = 3.0,
        replica: str | None = None,
        take_up_s: float = 0.5,
        park_s: float = 30.0,
    ):
        self.url = url
        self.prefix = prefix
        self.lease_s = lease_s
        self.lease_ms = int(lease_s * 1000)
        self.take_up_s = take_up_s
        """An admission offered to this replica goes back if not taken up within this."""
        self.park_s = park_s
        """The parked orders of a replica silent this long past its lease are dropped."""
        self.replica = replica or "r" + os.urandom(6).hex()
        self.channel_prefix = f"{prefix}:admit:"
        # calls: bounded, so a half-dead connection cannot stall a request forever; a
        # connection Redis closed (a restart) is retried on a new one, not returned
        # to the caller as a failure (a timeout is not retried: the call may have run)
        self.redis: aioredis.Redis = aioredis.from_url(
            url,
            decode_responses=True,
            health_check_interval=30,
            max_connections=512,
            socket_timeout=5,
            socket_connect_timeout=5,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), 3),
            retry_on_error=[RedisConnectionError],
        )
        # the admission channel waits for messages without a read timeout; named, so
        # an operator (or a test) can tell it apart in CLIENT LIST
        self.subscriber_name = f"{prefix}:admissions:{self.replica}"
        self._sub: aioredis.Redis = aioredis.from_url(
            url,
            decode_responses=True,
            health_check_interval=30,
            socket_connect_timeout=5,
            client_name=self.subscriber_name,
        )
        self._books: dict[str, ReplicaBook] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._subscribed = asyncio.Event()
        self.script: dict[str, AsyncScript] = {}
        self.batch = ScriptBatch(lambda: self.redis, self.script)
        self.line = ScriptLine(url, self.script, timeout_s=5) if script_line.usable(url) else None
        """The scripts' own pipelined connection; None for TLS (then :attr:`batch`)."""
        self.heartbeats = 0
        self._beat_failing = False
        self._beat_hooks: list[Callable[[], Awaitable[None]]] = []

    def on_beat(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run ``hook`` on every heartbeat (after the books)."""
        self._beat_hooks.append(hook)

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def register(self, book: ReplicaBook) -> None:
        self._books[book.product] = book

    async def start(self) -> None:
        """Connect (fail loudly if Redis is unreachable), subscribe, start the heartbeat."""
        try:
            await self.redis.ping()
        except Exception as exc:
            raise RuntimeError(f"cannot reach Redis at {_safe_url(self.url)}: {exc}") from exc
        for name, source in load_scripts().items():
            self.script[name] = self.redis.register_script(source)
        await self.beat_replica()
        self._tasks.append(asyncio.create_task(self._listen(), name="bourse-redis-admissions"))
        await asyncio.wait_for(self._subscribed.wait(), timeout=10)
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="bourse-redis-heartbeat"))
        log.info("cluster: replica %s on %s (lease %.1f s)", self.replica, _safe_url(self.url), self.lease_s)

    async def beat_replica(self) -> None:
        now_ms = await self._now_ms()
        key = self.key("replicas")
        await self.redis.zadd(key, {self.replica: now_ms + self.lease_ms})
        await self.redis.zremrangebyscore(key, "-inf", now_ms - 60_000)

    async def _now_ms(self) -> int:
        sec, usec = await self.redis.time()
        return int(sec) * 1000 + int(usec) // 1000

    async def _listen(self) -> None:
        """Deliver admissions from this replica's channel; resubscribe whenever the
        connection is lost (with back-off while Redis refuses). The heartbeat
        reconciles admissions published while we were away."""
        channel = self.channel_prefix + self.replica
        while True:
            async for attempt in retrying(
                attempts=None, base_s=0.05, max_s=2.0, what="cluster: admission channel", logger=log
            ):
                with attempt:
                    pubsub = await self._subscribe(channel)
            self._subscribed.set()
            try:
                await self._deliver(pubsub)
            except Exception as exc:
                log.warning("cluster: admission channel lost (%s); reconnecting", exc)
            finally:
                await _close_quietly(pubsub)

    async def _subscribe(self, channel: str) -> PubSub:
        pubsub = self._sub.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel)
        except BaseException:
            await _close_quietly(pubsub)
            raise
        return pubsub

    async def _deliver(self, pubsub: PubSub) -> None:
        """Hand each admission message to its book, until the connection fails."""
        books = self._books
        while True:
            msg = await pubsub.get_message(timeout=None)
            if msg is None or msg.get("type") != "message":
                continue
            product, oid, dep, price, level, attempt = str(msg["data"]).split("|", 5)
            book = books.get(product)
            if book is not None:
                book.on_admitted(oid, dep, price, level, int(attempt))

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            await self.beat()

    async def beat(self) -> None:
        """One heartbeat: the replica's entry, each book, each hook, each on its own
        (Redis unreachable fails them all, but a failure of one skips no other)."""
        steps: list[Callable[[], Awaitable[None]]] = [self.beat_replica]
        steps += [book.heartbeat for book in list(self._books.values())]
        steps += self._beat_hooks
        failed = 0
        for step in steps:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failed += 1
                if not self._beat_failing:
                    log.warning(
                        "cluster: heartbeat failed (%s); retrying every %.1f s", exc, self.lease_s / 3
                    )
        if failed:
            self._beat_failing = True
            return
        if self._beat_failing:
            log.info("cluster: heartbeat back")
        self._beat_failing = False
        self.heartbeats += 1

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run a fire-and-forget Redis call (a release) and log its failure."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("cluster: background call failed: %s", task.exception())

    async def call(
        self, name: str, keys: Sequence[str | bytes], args: Sequence[Any], head: Sequence[Any] = ()
    ) -> Any:
        """Run script ``name``: on the scripts' own line, every call made in one turn of
        the loop in one write, pipelined (:class:`~bourse.coordination.script_line.ScriptLine`);
        over TLS through redis-py, ``EVALSHA`` straight away when no other call is on its
        way, else with the calls made in the same turn as one pipeline
        (:class:`~bourse.coordination.script_batch.ScriptBatch`). Either way through
        the script object when Redis does not know the script (a restart emptied its
        script cache: the object loads it again). The script's arguments are ``head``
        then ``args``: a caller's ``keys`` and ``head`` that stay the same objects from
        call to call are encoded once."""
        if self.line is not None:
            return await self.line.call(name, keys, args, head)
        return await self.batch.call(name, keys, [*head, *args])

    async def aclose(self) -> None:
        """Give back this replica's orders and slots, stop the tasks, close the
        connections; every step is bounded (Redis may be gone)."""
        for book in list(self._books.values()):
            try:
                await asyncio.wait_for(book.aclose(), timeout=5)
            except Exception:
                log.exception("cluster: closing the book of %s", book.product)
        if self._background:
            await asyncio.wait(list(self._background), timeout=5)
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        try:
            await asyncio.wait_for(self.redis.zrem(self.key("replicas"), self.replica), timeout=5)
        except Exception:
            pass
        if self.line is not None:
            await self.line.aclose()
        for client in (self.redis, self._sub):
            try:
                await asyncio.wait_for(client.aclose(), timeout=5)
            except Exception:
                pass


async def _close_quietly(pubsub: PubSub) -> None:
    try:
        # redis-py types ``aclose`` from 8.x on, not before: the cast holds for both
        await cast(Callable[[], Awaitable[None]], pubsub.aclose)()
    except Exception:
        pass


def _safe_url(url: str) -> str:
    """The URL without its password (never logged)."""
    if "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
