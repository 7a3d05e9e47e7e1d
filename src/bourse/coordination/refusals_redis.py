"""The refusals of every replica in one Redis list (:class:`~bourse.ports.refusals.SharedRefusals`):
``{prefix}:refused``, newest first, trimmed to the newest ``keep``.

A refusal is written after its answer, off the request's path: lines wait in a
bounded buffer (a burst of 429s keeps its newest ``keep``) and one task writes them
all in one round trip (``LPUSH`` + ``LTRIM``, pipelined). Redis away: the lines are
dropped, one warning a streak (the replica still lists its own, kept in memory),
as are those not yet written when the process stops."""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from redis.exceptions import RedisError

from bourse.coordination.redis_hub import RedisHub

log = logging.getLogger("bourse.dashboard")


class RedisRefusals:
    def __init__(self, hub: RedisHub, *, keep: int = 1000) -> None:
        self._hub = hub
        self.key = hub.key("refused")
        self._keep = keep
        self._pending: deque[str] = deque(maxlen=keep)
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def add(self, line: str) -> None:
        self._pending.append(line)
        if self._task is None:
            try:
                self._task = asyncio.get_running_loop().create_task(self._write(), name="bourse-refusals")
            except RuntimeError:  # no loop (shutting down): kept in this process only
                self._pending.clear()

    async def _write(self) -> None:
        try:
            while self._pending:
                lines = list(self._pending)
                self._pending.clear()
                try:
                    pipe = self._hub.redis.pipeline(transaction=False)
                    pipe.lpush(self.key, *lines)
                    pipe.ltrim(self.key, 0, self._keep - 1)
                    await pipe.execute()
                    self._failing = False
                except (RedisError, OSError, RuntimeError) as exc:  # RuntimeError: the pool closed at a stop
                    if not self._failing:
                        log.warning("refusals: not shared (Redis: %s); this replica lists its own",
                                    type(exc).__name__)  # fmt: skip
                    self._failing = True
        finally:
            self._task = None

    async def recent(self) -> list[str]:
        lines = await self._hub.redis.lrange(self.key, 0, self._keep - 1)
        return [x if isinstance(x, str) else x.decode() for x in lines]  # the hub decodes: str
