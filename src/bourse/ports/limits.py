"""The rate-limit port: per-key requests/min, tokens/min and concurrent streams.

``acquire`` either admits (consuming one request, the token estimate and one stream
slot, atomically) or refuses with the time to wait. ``finish`` gives back the
stream slot and the difference between the token estimate and what was used.
Two adapters (``tests/contract/test_ratelimit.py`` runs the contract over both):
:class:`bourse.coordination.limits_local.MemoryRateLimiter` in process, and
:class:`bourse.coordination.limits_redis.RedisRateLimiter`, whose counters every
replica shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from bourse.domain.values import immutable


class LimiterUnavailable(Exception):
    """The shared rate-limit counters cannot be reached (Redis down); the request gets a 503."""


@immutable
class KeyLimits:
    rpm: int | None = None
    tpm: int | None = None
    max_streams: int | None = None


@dataclass(slots=True)
class Decision:
    allowed: bool
    reason: str = ""
    retry_after_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


class RateLimiter(Protocol):
    async def acquire(self, key_id: str, limits: KeyLimits, tokens: int) -> Decision: ...
    async def finish(
        self, key_id: str, limits: KeyLimits, reserved_tokens: int, used_tokens: int
    ) -> None: ...
