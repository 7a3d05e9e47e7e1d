"""A per-deployment circuit breaker (pure; the caller passes the time).

``threshold`` consecutive transient failures open the breaker for ``cooldown_s``;
after that one trial admission is let through (half-open): a success closes the
breaker, a failure opens it again. ``on_change`` (if set) hears each opening
(``"open"``, also again after a failed trial) and each closing (``"closed"``).

:func:`cooling_for` says when a request need not wait at all: every deployment of a
product is cooling down, so the answer is 503 at once, with the time left.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class CircuitBreaker:
    threshold: int = 3
    cooldown_s: float = 5.0
    failures: int = 0
    open_until: float = 0.0
    half_open: bool = False
    trial_running: bool = False
    on_change: Callable[[str], None] | None = None

    def available(self, now: float) -> bool:
        if self.failures < self.threshold:
            return True
        if now < self.open_until:
            return False
        # half-open: one trial at a time
        return not self.trial_running

    def on_admit(self, now: float) -> None:
        if self.failures >= self.threshold and now >= self.open_until:
            self.trial_running = True

    def record_failure(self, now: float) -> None:
        self.failures += 1
        self.trial_running = False
        if self.failures >= self.threshold:
            opening = self.failures == self.threshold or now >= self.open_until
            self.open_until = now + self.cooldown_s
            if opening and self.on_change is not None:
                self.on_change("open")

    def record_success(self) -> None:
        was_open = self.failures >= self.threshold
        self.failures = 0
        self.trial_running = False
        self.open_until = 0.0
        if was_open and self.on_change is not None:
            self.on_change("closed")

    def cooling_left(self, now: float) -> float:
        """Seconds the breaker stays open (0 when closed, or its cool-down is over)."""
        if self.failures < self.threshold:
            return 0.0
        return max(0.0, self.open_until - now)

    @property
    def state(self) -> str:
        return "closed" if self.failures < self.threshold else "open"


def cooling_for(breakers: Iterable[CircuitBreaker], now: float) -> float | None:
    """Seconds until the first of ``breakers`` ends its cool-down, when every one is
    open; None when any can be tried now (or there are none)."""
    left: float | None = None
    for b in breakers:
        t = b.cooling_left(now)
        if t <= 0:
            return None
        left = t if left is None else min(left, t)
    return left
