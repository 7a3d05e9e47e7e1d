"""Retries: capped exponential back-off with full jitter, the one helper every retry loop uses.

Built on ``tenacity`` (see docs/design.md). Two shapes:

- :func:`retrying` for an operation that raises on failure::

      async for attempt in retrying(attempts=5, base_s=0.05, max_s=1.0, what="settle hold_x"):
          with attempt:
              await store.settle(...)

  The last failure is re-raised once the attempts are spent; ``attempts=None``
  retries until the task is cancelled (a reconnect loop).
- :func:`backoff_s` for a loop that decides for itself whether to go again (a
  webhook that answered 500): the delay before attempt ``n + 1``.
"""

from __future__ import annotations

import logging
import random

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    stop_never,
    wait_random_exponential,
)

log = logging.getLogger("bourse.retry")


def retrying(
    *,
    attempts: int | None,
    base_s: float,
    max_s: float,
    retry_on: type[BaseException] | tuple[type[BaseException], ...] = Exception,
    what: str = "operation",
    logger: logging.Logger | None = None,
) -> AsyncRetrying:
    """An ``async for`` retry loop: full-jitter exponential waits from ``base_s`` up to ``max_s``."""
    out = logger or log

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        out.warning(
            "%s failed (attempt %d): %s; retrying in %.2f s",
            what,
            state.attempt_number,
            exc,
            state.upcoming_sleep,
        )

    return AsyncRetrying(
        stop=stop_never if attempts is None else stop_after_attempt(attempts),
        wait=wait_random_exponential(multiplier=base_s, max=max_s),
        retry=retry_if_exception_type(retry_on),
        before_sleep=before_sleep,
        reraise=True,
    )


def backoff_s(attempt: int, *, base_s: float, max_s: float) -> float:
    """Full-jitter delay after failed attempt number ``attempt`` (0-based): uniform in
    ``[0, min(max_s, base_s * 2**attempt)]``."""
    return random.uniform(0.0, min(max_s, base_s * 2.0 ** min(attempt, 62)))
