"""Token buckets for per-key limits (pure; the caller passes the time).

A bucket of ``capacity`` refills at ``capacity / 60`` per second (a limit per
minute). Requests and tokens each have one; concurrent streams are a counter.
Tokens are consumed at admission from a conservative estimate; the unused part is
returned when the request ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class Bucket:
    capacity: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.capacity / 60.0)
            self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` is available (0 if it is)."""
        if self.level >= amount:
            return 0.0
        return (amount - self.level) * 60.0 / self.capacity

    def reset_s(self) -> float:
        return (self.capacity - self.level) * 60.0 / self.capacity


@dataclass(slots=True)
class KeyState:
    requests: Bucket | None = None
    tokens: Bucket | None = None
    streams: int = 0


def bucket(state: Bucket | None, capacity: int, now: float) -> Bucket:
    if state is None or state.capacity != capacity:
        return Bucket(float(capacity), float(capacity), now)
    state.refill(now)
    return state


def retry_after_header(seconds: float) -> str:
    """The ``retry-after`` value for a wait of ``seconds``: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(seconds)))
