"""A per-deployment circuit breaker (pure; the caller passes the time).

``threshold`` consecutive transient failures open the breaker for ``cooldown_s``;
after that one trial admission is let through (half-open): a success closes the
breaker, a failure opens it again. ``on_change`` (if set) hears each opening
(``"open"``, also again after a failed trial) and each closing (``"closed"``).
"""

from __future__ import annotations

from collections.abc import Callable
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

    @property
    def state(self) -> str:
        return "closed" if self.failures < self.threshold else "open"
