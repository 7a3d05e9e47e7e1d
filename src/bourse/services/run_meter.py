"""A run's meter: the tokens it generated and delivered, and its timings.

``generated`` counts the completion tokens the engine sent (the gateway's own count,
the usage when the engine reports none); ``delivered`` those of the chunks the run's
consumer took, that is asked for the next event after (the relay had written them to
the client, a job had folded them into its result), so a client that leaves midway
shows ``generated - delivered`` tokens it never got. The run's event loop adds to
the counts in line (once per chunk: a method call each would be the loop's one call
per chunk that does nothing else); the timings are set through the methods, once.
"""

from __future__ import annotations

import time
from typing import Any

from bourse.ports.engine import UsageEvent


class Meter:
    """One run's counts and timings, from ``t0`` (``time.perf_counter``, the request's arrival)."""

    __slots__ = ("delivered", "engine_usage", "generated", "queued_ms", "reasoning", "t0", "ttft_ms")

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.generated = 0
        """Completion tokens the engine sent."""
        self.delivered = 0
        """Of ``generated``, those in chunks the consumer took."""
        self.reasoning = 0
        """Of ``generated``, those the engine sent as reasoning."""
        self.ttft_ms: float | None = None
        """From the arrival to the first chunk of output."""
        self.queued_ms: float | None = None
        """From the order's entry in the book to its first slot."""
        self.engine_usage: UsageEvent | None = None
        """The usage the engine reported (its last), if any."""

    def first_output(self) -> None:
        """The first chunk of output arrived (now)."""
        self.ttft_ms = (time.perf_counter() - self.t0) * 1000.0

    def admitted(self, waited_s: float) -> bool:
        """The order got a slot after ``waited_s`` in the book: True the first time
        (then kept as ``queued_ms``), False on an admission after a requeue."""
        if self.queued_ms is not None:
            return False
        self.queued_ms = waited_s * 1000.0
        return True

    def latency_ms(self) -> float:
        """From the arrival to now."""
        return (time.perf_counter() - self.t0) * 1000.0


def reasoning_count(text: Any, tokens: int) -> int:
    """The reasoning tokens of a chunk that carries ``tokens`` completion tokens: all of
    them for a chunk of one token, else (a whole answer in one chunk) the text's UTF-8
    bytes / 4 + 1, at most ``tokens``."""
    if tokens <= 1 or not isinstance(text, str):
        return tokens
    return min(tokens, len(text.encode()) // 4 + 1)
