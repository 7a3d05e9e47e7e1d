"""Whether a deployment may take orders at all, as its probes say (pure, no I/O).

A deployment is *available* until something shows that it cannot serve: a probe that
finds its URL wrong, its model not served, its credentials refused or its upstream
unreachable, or a request whose generation route answers 404. Then it is unavailable
with a one-line ``reason`` and takes no order until a probe passes again. This is
apart from the circuit breaker (:mod:`bourse.domain.breaker`), which counts transient
failures of requests: an unavailable deployment's failures are explained already and
are not counted there.

``on_change`` (if set) hears each change: the new reason, or None when it is
available again. ``hold_s`` is how long another replica should keep it out on this
replica's word (the shared book's "cooling until"), renewed at each failed probe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class Availability:
    reason: str | None = None
    """Why the deployment cannot take orders now; None while it is available."""
    hold_s: float = 30.0
    on_change: Callable[[str | None], None] | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    def set(self, reason: str | None) -> bool:
        """Record a probe's verdict (None: it passed); True when that changes the state.
        A new reason while it stays unavailable is kept without a change."""
        changed = (reason is None) != (self.reason is None)
        self.reason = reason
        if changed and self.on_change is not None:
            self.on_change(reason)
        return changed

    def fail(self, reason: str) -> bool:
        return self.set(reason)
