"""The market's notes over Redis (:class:`~bourse.ports.market.MarketNotes`): a replica
that wrote a new market version publishes its number on ``{prefix}:market``; every
replica listens there and applies it at once (one that missed it catches up on its
next database poll, :data:`bourse.market_desk.POLL_S`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from bourse.coordination.redis_hub import RedisHub

log = logging.getLogger("bourse.market")


class RedisMarketNotes:
    def __init__(self, hub: RedisHub) -> None:
        self._hub = hub
        self.channel = hub.key("market")

    async def publish(self, version: int) -> None:
        await self._hub.redis.publish(self.channel, str(version))

    async def listen(self, heard: Callable[[int], Awaitable[None]]) -> None:
        failing = False
        while True:
            pubsub = self._hub.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                failing = False
                async for message in pubsub.listen():
                    data = message.get("data")
                    if message.get("type") == "message" and isinstance(data, str) and data.isdigit():
                        await self._tell(heard, int(data))
            except (RedisError, OSError) as exc:  # the poll covers the gap; listen again soon
                if not failing:
                    log.warning(
                        "market notes: Redis listen failed (%s); polling meanwhile", type(exc).__name__
                    )
                failing = True
                await asyncio.sleep(1.0)
            finally:
                await pubsub.aclose()

    @staticmethod
    async def _tell(heard: Callable[[int], Awaitable[None]], version: int) -> None:
        try:
            await heard(version)
        except Exception as exc:  # e.g. the database away: the poll applies it later
            log.warning("market notes: v%d not applied yet (%s)", version, type(exc).__name__)
