"""Waiting on a condition instead of sleeping: :func:`wait_until` polls a predicate
until it holds, and fails with a message after a timeout; :func:`await_until` is the
same for an async predicate, polled without blocking the event loop.

A test that needs one event to happen before the next waits for the first to be
visible (a market view, a job state, a line of output), never for a fixed time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.01


def wait_until(
    predicate: Callable[[], T | None], timeout: float = 10.0, *, what: str = "", poll_s: float = POLL_S
) -> T:
    """Call ``predicate`` until it returns a true value, and return that value; raise
    AssertionError (naming ``what``) when ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(poll_s)


async def await_until(
    predicate: Callable[[], Awaitable[T | None]],
    within: float = 10.0,
    *,
    what: str = "",
    poll_s: float = POLL_S,
) -> T:
    """Await ``predicate()`` until it gives a true value, and return that value; raise
    AssertionError (naming ``what``) when ``within`` seconds pass first."""
    deadline = time.monotonic() + within
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what or predicate}")
        await asyncio.sleep(poll_s)
