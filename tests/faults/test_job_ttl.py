"""A job whose TTL ends while it runs keeps the result it was charged for (issue 14, item 8).

Before the fix a job that was still running at its ``expires_at`` was charged when it
finished, and the next sweep threw its result away: the client paid for an answer it
could never read. The choice made: a charged result stays readable for at least
``[jobs] min_result_s`` after the job ends; the job's ``expires_at`` moves to
``finished_at + min_result_s`` when that is later (a job that ends well inside its
TTL keeps its own). The sweeps are called directly at chosen times, so nothing here
waits on the sweeper's clock.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bourse.settings import JobsConfig
from tests.support.asgi import InProcessGateway, in_process_gateway
from tests.support.bodies import USER
from tests.support.waiting import await_until

pytestmark = pytest.mark.anyio

MIN_RESULT_S = 120.0
CONFIG = f"""
[server]
log_level = "warning"
[jobs]
min_result_s = {MIN_RESULT_S}
[products.slow]
sim_overrides = true
[[products.slow.deployments]]
engine = "sim"
slots = 2
floor = 1.0
"""
FINAL = ("succeeded", "failed", "canceled", "expired")


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[InProcessGateway]:
    async with in_process_gateway(CONFIG, tmp_path) as g:
        yield g


async def _submit(gw: InProcessGateway, ttl_s: float, tokens: int, tokens_per_s: float) -> dict[str, Any]:
    body = {"model": "slow", "messages": USER, "max_tokens": tokens,
            "sim": {"output_tokens": tokens, "tokens_per_s": tokens_per_s}}  # fmt: skip
    r = await gw.post("/v1/jobs", {"endpoint": "/v1/chat/completions", "body": body, "ttl_s": ttl_s})
    assert r.status_code == 202, r.text
    job: dict[str, Any] = r.json()
    return job


async def _final(gw: InProcessGateway, job_id: str) -> dict[str, Any]:
    async def ended() -> dict[str, Any] | None:
        job: dict[str, Any] = (await gw.get(f"/v1/jobs/{job_id}")).json()
        return job if job["status"] in FINAL else None

    return await await_until(ended, 30, what=f"job {job_id} ended")


async def _job(gw: InProcessGateway, job_id: str) -> dict[str, Any]:
    r = await gw.get(f"/v1/jobs/{job_id}")
    assert r.status_code == 200, r.text
    job: dict[str, Any] = r.json()
    return job


async def test_a_job_whose_ttl_ends_while_it_runs_keeps_its_charged_result(gw: InProcessGateway) -> None:
    before = await gw.balance()
    job = await _submit(gw, ttl_s=1.0, tokens=30, tokens_per_s=20)  # runs about 1.5 s: past its TTL
    done = await _final(gw, job["id"])
    assert done["status"] == "succeeded", done
    assert done["finished_at"] > job["expires_at"], (done["finished_at"], job["expires_at"])
    cost = done["result"]["usage"]["cost_micros"]
    assert cost > 0 and before - await gw.balance() == cost  # charged once
    assert done["expires_at"] >= done["finished_at"] + MIN_RESULT_S, done

    # a sweep now, and one just before the new expiry, keep the result readable
    store = gw.container.store
    for when in (time.time(), done["finished_at"] + MIN_RESULT_S - 1):
        await store.expire_jobs(when)
        kept = await _job(gw, job["id"])
        assert kept["status"] == "succeeded" and kept["result"] == done["result"], kept
    # and it goes once it has been readable for min_result_s
    await store.expire_jobs(done["expires_at"] + 1)
    gone = await _job(gw, job["id"])
    assert gone["status"] == "expired" and "result" not in gone, gone


async def test_a_job_that_ends_inside_its_ttl_keeps_its_own_expiry(gw: InProcessGateway) -> None:
    job = await _submit(gw, ttl_s=3600.0, tokens=3, tokens_per_s=0)
    done = await _final(gw, job["id"])
    assert done["status"] == "succeeded", done
    assert done["expires_at"] == job["expires_at"]


def test_the_minimum_is_ten_minutes_by_default() -> None:
    assert JobsConfig().min_result_s == 600.0
