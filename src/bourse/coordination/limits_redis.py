"""The Redis adapter of the rate-limit port: per-key buckets and stream counts
shared by every replica.

The token buckets are those of :mod:`bourse.domain.ratelimit`, kept in a Redis
hash and updated atomically in Lua (``lua/rate_acquire.lua``, ``lua/rate_finish.lua``),
so a key's requests/min and tokens/min hold across replicas. Concurrent streams are counted per replica; a replica whose lease
lapsed (it died) no longer counts, so a crash cannot lock a key out. A key with
no limit at all costs no round trip (limits set later count streams opened after).
A count that missed an update while Redis was unreachable is rewritten from this
replica's own tally by the next heartbeat.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import RedisError

from bourse.coordination.redis_hub import RedisHub
from bourse.ports.limits import Decision, KeyLimits, LimiterUnavailable


class RedisRateLimiter:
    def __init__(self, hub: RedisHub) -> None:
        self.hub = hub
        self._streams: dict[str, int] = {}
        """This replica's streams in flight per key (the truth its Redis count must match)."""
        self._dirty: set[str] = set()
        """Keys whose Redis count missed an update; rewritten by the heartbeat."""
        hub.on_beat(self._repair)

    async def _repair(self) -> None:
        for key_id in list(self._dirty):
            _, s = self._keys(key_id)
            n = self._streams.get(key_id, 0)
            if n > 0:
                await self.hub.redis.hset(s, self.hub.replica, n)
            else:
                await self.hub.redis.hdel(s, self.hub.replica)
            self._dirty.discard(key_id)

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.hub.call(name, keys, args)
        except (RedisError, OSError) as exc:
            raise LimiterUnavailable(f"the shared rate limits are unreachable ({exc})") from exc

    def _keys(self, key_id: str) -> tuple[str, str]:
        tag = f"{{{self.hub.prefix}:rl:{key_id}}}"
        return f"{tag}:b", f"{tag}:s"

    async def acquire(self, key_id: str, limits: KeyLimits, tokens: int) -> Decision:
        if limits.rpm is None and limits.tpm is None and limits.max_streams is None:
            return Decision(True)  # nothing to count: no round trip
        b, s = self._keys(key_id)
        rpm = -1 if limits.rpm is None else limits.rpm
        tpm = -1 if limits.tpm is None else limits.tpm
        res = await self._call(
            "RATE_ACQUIRE",
            [b, s, self.hub.key("replicas")],
            [
                rpm,
                tpm,
                -1 if limits.max_streams is None else limits.max_streams,
                tokens,
                self.hub.replica,
                61_000,
            ],
        )
        allowed = int(res[0]) == 1
        if allowed:
            self._streams[key_id] = self._streams.get(key_id, 0) + 1
        headers: dict[str, str] = {}
        if limits.rpm is not None:
            headers["x-ratelimit-limit-requests"] = str(limits.rpm)
        if limits.tpm is not None:
            headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
        if not allowed:
            what, wait = res[1], float(res[2])
            if what == "streams":
                return Decision(
                    False,
                    f"this key already has {res[3]} requests in flight (limit {limits.max_streams})",
                    1.0,
                    {"x-ratelimit-limit-streams": str(limits.max_streams)},
                )
            if what == "requests":
                headers["x-ratelimit-remaining-requests"] = "0"
                headers["x-ratelimit-reset-requests"] = f"{wait:.3f}s"
                return Decision(False, f"over {limits.rpm} requests per minute", wait, headers)
            headers["x-ratelimit-remaining-tokens"] = str(int(float(res[3])))
            headers["x-ratelimit-reset-tokens"] = f"{wait:.3f}s"
            return Decision(False, f"over {limits.tpm} tokens per minute", wait, headers)
        rq, tk = float(res[2]), float(res[3])
        if limits.rpm is not None:
            headers["x-ratelimit-remaining-requests"] = str(int(rq))
            headers["x-ratelimit-reset-requests"] = f"{(limits.rpm - rq) * 60.0 / limits.rpm:.3f}s"
        if limits.tpm is not None:
            headers["x-ratelimit-remaining-tokens"] = str(max(0, int(tk)))
            headers["x-ratelimit-reset-tokens"] = f"{(limits.tpm - tk) * 60.0 / limits.tpm:.3f}s"
        return Decision(True, headers=headers)

    async def finish(self, key_id: str, limits: KeyLimits, reserved_tokens: int, used_tokens: int) -> None:
        if limits.rpm is None and limits.tpm is None and limits.max_streams is None:
            return
        n = self._streams.get(key_id, 0) - 1
        if n > 0:
            self._streams[key_id] = n
        else:
            self._streams.pop(key_id, None)
        b, s = self._keys(key_id)
        back = 0
        if limits.tpm is not None:
            back = max(0, min(reserved_tokens, limits.tpm) - used_tokens)
        try:
            await self._call(
                "RATE_FINISH", [b, s], [-1 if limits.tpm is None else limits.tpm, back, self.hub.replica]
            )
        except LimiterUnavailable:
            self._dirty.add(key_id)  # the heartbeat writes the true count back
            raise
