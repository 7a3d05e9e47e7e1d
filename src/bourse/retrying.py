"""Retries: capped exponential back-off with full jitter, the one helper every retry loop uses.

Built on ``tenacity`` (see docs/design.md). Two shapes:

- :func:`retrying` for an operation that raises on failure::

      async for attempt in retrying(attempts=5, base_s=0.05, max_s=1.0, what="settle hold_x"):
          with attempt:
              await store.settle(...)

  The last failure is re-raised once the attempts are spent; ``attempts=None``
  retries until the task is cancelled (a reconnect loop).
- :func:`retry_call` for the same loop around one operation on a hot path (a
  request's settlement): its first attempt runs without building the tenacity loop
  (tens of microseconds a call), which only a failure then builds; the waits, the
  attempt numbers in the warnings and the re-raised failure are those of
  :func:`retrying`.
- :func:`backoff_s` for a loop that decides for itself whether to go again (a
  webhook that answered 500): the delay before attempt ``n + 1``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    stop_never,
    wait_random_exponential,
)

log = logging.getLogger("bourse.retry")
T = TypeVar("T")


def retrying(
    *,
    attempts: int | None,
    base_s: float,
    max_s: float,
    retry_on: type[BaseException] | tuple[type[BaseException], ...] = Exception,
    what: str = "operation",
    logger: logging.Logger | None = None,
    first_attempt: int = 1,
) -> AsyncRetrying:
    """An ``async for`` retry loop: full-jitter exponential waits from ``base_s`` up to ``max_s``
    (``first_attempt``: the number its first attempt has in the warnings)."""
    out = logger or log

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        out.warning(
            "%s failed (attempt %d): %s; retrying in %.2f s",
            what,
            state.attempt_number + first_attempt - 1,
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


async def retry_call(
    op: Callable[[], Awaitable[T]],
    *,
    attempts: int | None,
    base_s: float,
    max_s: float,
    retry_on: type[BaseException] | tuple[type[BaseException], ...] = Exception,
    what: str = "operation",
    logger: logging.Logger | None = None,
) -> T:
    """``await op()`` retried as :func:`retrying` would (see the module's docstring)."""
    try:
        return await op()
    except retry_on as exc:
        if attempts is not None and attempts <= 1:
            raise
        first = exc
    # tenacity's wait_random_exponential after attempt 1: uniform in [0, min(max_s, base_s)]
    wait = random.uniform(0.0, min(max_s, base_s))
    (logger or log).warning("%s failed (attempt %d): %s; retrying in %.2f s", what, 1, first, wait)
    await asyncio.sleep(wait)
    # attempts 2, 3, ...: twice the multiplier gives attempt n the wait retrying gives it
    rest = retrying(
        attempts=None if attempts is None else attempts - 1,
        base_s=2 * base_s,
        max_s=max_s,
        retry_on=retry_on,
        what=what,
        logger=logger,
        first_attempt=2,
    )
    async for attempt in rest:
        with attempt:
            return await op()
    raise AssertionError("unreachable: the loop returns or re-raises")  # pragma: no cover


def backoff_s(attempt: int, *, base_s: float, max_s: float) -> float:
    """Full-jitter delay after failed attempt number ``attempt`` (0-based): uniform in
    ``[0, min(max_s, base_s * 2**attempt)]``."""
    return random.uniform(0.0, min(max_s, base_s * 2.0 ** min(attempt, 62)))
