"""Retries (:mod:`bourse.retrying`): ``retry_call`` runs a first attempt without building
the tenacity loop, and a failure then goes on exactly as ``retrying`` would: the same
wait bounds, the same attempt numbers in the warnings, the last failure re-raised."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from bourse import retrying as retrying_module
from bourse.retrying import retry_call, retrying

pytestmark = pytest.mark.anyio


class Flaky:
    """An operation failing ``failures`` times with ``exc`` and then answering 42."""

    def __init__(self, failures: int, exc: type[BaseException] = OSError) -> None:
        self.failures = failures
        self.exc = exc
        self.calls = 0

    async def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc(f"failure {self.calls}")
        return 42


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every wait's upper bound (random.uniform answers its high end), slept as nothing."""
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float, result: Any = None) -> Any:
        slept.append(seconds)
        return await real_sleep(0, result)

    monkeypatch.setattr(random, "uniform", lambda a, b: b)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    return slept


async def with_retrying(op: Callable[[], Awaitable[int]], attempts: int) -> int:
    async for attempt in retrying(attempts=attempts, base_s=0.05, max_s=0.3, what="op"):
        with attempt:
            return await op()
    raise AssertionError("unreachable")


async def test_a_first_success_builds_no_retry_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_loop(**_: Any) -> Any:
        raise AssertionError("the tenacity loop was built")

    monkeypatch.setattr(retrying_module, "retrying", no_loop)
    op = Flaky(0)
    assert await retry_call(op, attempts=5, base_s=0.05, max_s=1.0) == 42
    assert op.calls == 1


@pytest.mark.parametrize("failures", [1, 2, 4])
async def test_failures_are_retried_with_the_waits_and_warnings_of_retrying(
    failures: int, waits: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "bourse.retry")
    assert await with_retrying(Flaky(failures), attempts=5) == 42
    expected_waits, expected_log = list(waits), [r.getMessage() for r in caplog.records]
    waits.clear()
    caplog.clear()
    op = Flaky(failures)
    assert await retry_call(op, attempts=5, base_s=0.05, max_s=0.3, what="op") == 42
    assert op.calls == failures + 1
    assert waits == expected_waits == [min(0.3, 0.05 * 2**n) for n in range(failures)]
    assert [r.getMessage() for r in caplog.records] == expected_log
    assert expected_log[-1].startswith(f"op failed (attempt {failures}): failure {failures}; retrying in")


async def test_the_last_failure_is_reraised_once_the_attempts_are_spent(waits: list[float]) -> None:
    op = Flaky(10)
    with pytest.raises(OSError, match="failure 3"):
        await retry_call(op, attempts=3, base_s=0.05, max_s=1.0)
    assert op.calls == 3
    assert len(waits) == 2
    one = Flaky(10)
    with pytest.raises(OSError, match="failure 1"):
        await retry_call(one, attempts=1, base_s=0.05, max_s=1.0)
    assert one.calls == 1


async def test_a_failure_it_does_not_retry_goes_through_at_once(waits: list[float]) -> None:
    op = Flaky(1, ValueError)
    with pytest.raises(ValueError, match="failure 1"):
        await retry_call(op, attempts=5, base_s=0.05, max_s=1.0, retry_on=OSError)
    assert op.calls == 1
    assert waits == []
