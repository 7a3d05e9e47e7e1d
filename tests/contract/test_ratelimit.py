"""The rate-limit port contract (``bourse.ports.limits``), run over both adapters:
``memory`` (:class:`~bourse.coordination.limits_local.MemoryRateLimiter`) and ``redis``
(:class:`~bourse.coordination.limits_redis.RedisRateLimiter`, one hub per replica).

Buckets refill continuously (``limit / 60`` per second), so token counts read from
headers are checked within a band that allows a few seconds of refill on a slow
machine; every band is far narrower than the effect it checks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bourse.coordination.limits_local import MemoryRateLimiter
from bourse.coordination.limits_redis import RedisRateLimiter
from bourse.domain.ratelimit import retry_after_header
from bourse.ports.limits import Decision, KeyLimits
from tests.contract.cluster import Replicas, eventually

WAIT_S = 15.0


class Limiters:
    """Builds limiters of one adapter. For ``redis`` every call is a new replica (its
    own hub) over the test's key prefix, so they share the counters; for ``memory``
    every call is an independent limiter."""

    def __init__(self, kind: str, url: str | None) -> None:
        self.kind = kind
        self.replicas = Replicas(url) if url is not None else None

    async def __call__(self, *, lease_s: float = 3.0) -> Any:
        if self.replicas is None:
            return MemoryRateLimiter()
        return RedisRateLimiter(await self.replicas.hub(lease_s=lease_s))

    async def aclose(self) -> None:
        if self.replicas is not None:
            await self.replicas.aclose()


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def limiter_backend(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    if request.param == "redis":
        return "redis", request.getfixturevalue("redis_service_url")
    return "memory", None


@pytest.fixture
async def make_limiter(limiter_backend: tuple[str, str | None]) -> AsyncIterator[Limiters]:
    limiters = Limiters(*limiter_backend)
    try:
        yield limiters
    finally:
        await limiters.aclose()


@pytest.fixture
async def redis_limiters(redis_service_url: str) -> AsyncIterator[Limiters]:
    limiters = Limiters("redis", redis_service_url)
    try:
        yield limiters
    finally:
        await limiters.aclose()


def seconds(header: str) -> float:
    assert header.endswith("s"), header
    return float(header[:-1])


def refused(d: Decision, reason: str) -> None:
    assert not d.allowed, d
    assert reason in d.reason, d


# -- requests per minute -------------------------------------------------------------------


@pytest.mark.anyio
async def test_rpm_refuses_with_retry_after_and_headers(make_limiter: Limiters) -> None:
    lim = await make_limiter()
    limits = KeyLimits(rpm=3)
    remaining = []
    for _ in range(3):
        d = await lim.acquire("k", limits, 10)
        assert d.allowed, d
        assert d.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(d.headers["x-ratelimit-remaining-requests"])
        # time until the bucket is full again: 20 s per request used (a little less after refill)
        used = 3 - int(d.headers["x-ratelimit-remaining-requests"])
        assert 20 * used - 2 <= seconds(d.headers["x-ratelimit-reset-requests"]) <= 20 * used + 0.01
        assert "x-ratelimit-limit-tokens" not in d.headers
    assert remaining == ["2", "1", "0"]

    d = await lim.acquire("k", limits, 10)
    refused(d, "over 3 requests per minute")
    assert 17.0 <= d.retry_after_s <= 20.01  # one request refills in 20 s
    assert d.headers["x-ratelimit-limit-requests"] == "3"
    assert d.headers["x-ratelimit-remaining-requests"] == "0"
    assert abs(seconds(d.headers["x-ratelimit-reset-requests"]) - d.retry_after_s) < 0.01
    assert retry_after_header(d.retry_after_s) in ("18", "19", "20")

    # finishing does not give requests back; a refusal consumed nothing
    for _ in range(3):
        await lim.finish("k", limits, 10, 10)
    refused(await lim.acquire("k", limits, 10), "requests per minute")
    # other keys have their own buckets
    assert (await lim.acquire("other", limits, 10)).allowed


# -- tokens per minute ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_tpm_consumes_the_estimate_and_refunds_the_rest(make_limiter: Limiters) -> None:
    lim = await make_limiter()
    limits = KeyLimits(tpm=1000)  # refills 16.7 tokens per second
    d = await lim.acquire("k", limits, 600)
    assert d.allowed, d
    assert d.headers["x-ratelimit-limit-tokens"] == "1000"
    assert 400 <= int(d.headers["x-ratelimit-remaining-tokens"]) <= 450
    assert 33.0 <= seconds(d.headers["x-ratelimit-reset-tokens"]) <= 36.01  # 600 tokens at 1000/min
    assert "x-ratelimit-limit-requests" not in d.headers

    d = await lim.acquire("k", limits, 600)  # 400 left, 600 needed
    refused(d, "over 1000 tokens per minute")
    assert 8.0 <= d.retry_after_s <= 12.01  # 200 tokens at 1000/min
    assert 400 <= int(d.headers["x-ratelimit-remaining-tokens"]) <= 450
    assert abs(seconds(d.headers["x-ratelimit-reset-tokens"]) - d.retry_after_s) < 0.01
    assert d.headers["x-ratelimit-limit-tokens"] == "1000"

    # the first request used 100 of its 600: 500 come back, so 600 fit again
    await lim.finish("k", limits, 600, 100)
    d = await lim.acquire("k", limits, 600)
    assert d.allowed, d
    assert 300 <= int(d.headers["x-ratelimit-remaining-tokens"]) <= 360
    # all of it used: nothing comes back
    await lim.finish("k", limits, 600, 600)
    refused(await lim.acquire("k", limits, 600), "tokens per minute")
    # a refund never fills the bucket past its capacity
    await lim.finish("k", limits, 600, 0)
    await lim.finish("k", limits, 600, 0)
    d = await lim.acquire("k", limits, 1000)
    assert d.allowed, d
    assert int(d.headers["x-ratelimit-remaining-tokens"]) <= 60
    refused(await lim.acquire("k", limits, 300), "tokens per minute")


@pytest.mark.anyio
async def test_tpm_estimate_above_the_limit_takes_the_whole_bucket(make_limiter: Limiters) -> None:
    lim = await make_limiter()
    limits = KeyLimits(tpm=1000)
    d = await lim.acquire("k", limits, 5000)  # never refused for good: it waits for a full bucket
    assert d.allowed, d
    assert d.headers["x-ratelimit-remaining-tokens"] == "0"
    refused(await lim.acquire("k", limits, 300), "tokens per minute")
    await lim.finish("k", limits, 5000, 0)  # gives back what was taken (the bucket), not 5000
    d = await lim.acquire("k", limits, 1000)
    assert d.allowed, d
    assert int(d.headers["x-ratelimit-remaining-tokens"]) <= 60


# -- concurrent streams ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_max_streams_counted_and_released_by_finish(make_limiter: Limiters) -> None:
    lim = await make_limiter()
    limits = KeyLimits(max_streams=2)
    assert (await lim.acquire("k", limits, 10)).allowed
    assert (await lim.acquire("k", limits, 10)).allowed
    d = await lim.acquire("k", limits, 10)
    refused(d, "already has 2 requests in flight (limit 2)")
    assert d.retry_after_s == 1.0
    assert d.headers == {"x-ratelimit-limit-streams": "2"}
    assert (await lim.acquire("other", limits, 10)).allowed  # per key

    await lim.finish("k", limits, 10, 10)
    assert (await lim.acquire("k", limits, 10)).allowed
    refused(await lim.acquire("k", limits, 10), "in flight")
    for _ in range(2):
        await lim.finish("k", limits, 10, 10)
    assert (await lim.acquire("k", limits, 10)).allowed
    assert (await lim.acquire("k", limits, 10)).allowed
    refused(await lim.acquire("k", limits, 10), "in flight")


@pytest.mark.anyio
async def test_refused_requests_take_no_stream(make_limiter: Limiters) -> None:
    lim = await make_limiter()
    limits = KeyLimits(rpm=1, max_streams=5)
    assert (await lim.acquire("k", limits, 10)).allowed
    for _ in range(10):
        refused(await lim.acquire("k", limits, 10), "requests per minute")
    # only the admitted request holds a stream: a key with a looser rate still fits 4 more
    looser = KeyLimits(rpm=100, max_streams=5)
    for _ in range(4):
        assert (await lim.acquire("k", looser, 10)).allowed
    refused(await lim.acquire("k", looser, 10), "in flight")


# -- Redis: shared across replicas, leases ---------------------------------------------------


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_replicas_share_the_counters(redis_limiters: Limiters) -> None:
    a = await redis_limiters()
    b = await redis_limiters()
    assert a.hub.replica != b.hub.replica

    rpm = KeyLimits(rpm=3)
    assert (await a.acquire("r", rpm, 1)).allowed
    assert (await b.acquire("r", rpm, 1)).allowed
    d = await a.acquire("r", rpm, 1)
    assert d.allowed and d.headers["x-ratelimit-remaining-requests"] == "0"
    refused(await b.acquire("r", rpm, 1), "over 3 requests per minute")

    tpm = KeyLimits(tpm=1000)
    assert (await a.acquire("t", tpm, 600)).allowed
    refused(await b.acquire("t", tpm, 600), "tokens per minute")
    await a.finish("t", tpm, 600, 0)  # a's refund is seen by b
    assert (await b.acquire("t", tpm, 600)).allowed

    streams = KeyLimits(max_streams=2)
    assert (await a.acquire("s", streams, 1)).allowed
    assert (await b.acquire("s", streams, 1)).allowed
    refused(await a.acquire("s", streams, 1), "already has 2 requests in flight")
    refused(await b.acquire("s", streams, 1), "already has 2 requests in flight")
    await b.finish("s", streams, 1, 1)
    assert (await a.acquire("s", streams, 1)).allowed
    refused(await b.acquire("s", streams, 1), "in flight")


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_dead_replica_streams_stop_counting_after_its_lease(redis_limiters: Limiters) -> None:
    lease_s = 1.0
    dead = await redis_limiters(lease_s=lease_s)
    alive = await redis_limiters(lease_s=lease_s)
    limits = KeyLimits(max_streams=2)
    assert (await dead.acquire("k", limits, 1)).allowed
    assert (await dead.acquire("k", limits, 1)).allowed
    refused(await alive.acquire("k", limits, 1), "already has 2 requests in flight")

    replicas = redis_limiters.replicas
    assert replicas is not None
    await replicas.crash(dead.hub)
    crashed_at = time.monotonic()
    first: Decision = await alive.acquire("k", limits, 1)
    d: Decision | None = first
    if (await replicas.replica_lease_ms(dead.hub) or 0) > await replicas.now_ms():
        # its entry in {prefix}:replicas had not lapsed yet: its streams still counted
        refused(first, "in flight")
        d = None

    async def admitted_again() -> bool:
        nonlocal d
        if d is None or not d.allowed:
            d = await alive.acquire("k", limits, 1)
        return bool(d.allowed)

    await eventually(admitted_again, within=WAIT_S, what="the dead replica's streams to lapse")
    elapsed = time.monotonic() - crashed_at
    assert elapsed < lease_s + 5.0, elapsed
    assert (await replicas.replica_lease_ms(dead.hub) or 0) <= await replicas.now_ms()
    # now only the survivor's streams count: one more fits, then the limit holds
    assert (await alive.acquire("k", limits, 1)).allowed
    refused(await alive.acquire("k", limits, 1), "already has 2 requests in flight")
    await alive.finish("k", limits, 1, 1)
    assert (await alive.acquire("k", limits, 1)).allowed


@pytest.mark.anyio
@pytest.mark.redis
async def test_redis_replica_closed_gracefully_leaves_no_lease(redis_limiters: Limiters) -> None:
    a = await redis_limiters()
    replicas = redis_limiters.replicas
    assert replicas is not None
    assert (await replicas.replica_lease_ms(a.hub) or 0) > await replicas.now_ms()
    await a.hub.aclose()
    replicas.crashed.append(a.hub)  # already closed
    assert await replicas.replica_lease_ms(a.hub) is None


def test_retry_after_header_rounds_up_to_whole_seconds() -> None:
    assert retry_after_header(0.0) == "1"
    assert retry_after_header(0.2) == "1"
    assert retry_after_header(1.0) == "1"
    assert retry_after_header(19.01) == "20"
    assert retry_after_header(59.5) == "60"
