"""A detached deadline order (issue 38, item 3) keeps its deadline across a restart.

A job's row keeps the body it re-enters the book with when a later gateway resumes
it. A deadline given in headers (``X-Max-Price`` with ``X-Deadline-S``) is written
into that body, and a resumed job's deadline is its original one: the time left of
``deadline_s`` since the job was accepted, or, when that has passed, the 408
``book_timeout`` it would have had then. It does not start again from zero.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from bourse.ports.stores import Job
from tests.unit.services.exchange import Exchange, until

pytestmark = pytest.mark.anyio

BODY = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


async def _stored(exchange: Exchange, view: dict[str, Any]) -> Job:
    job = await exchange.container.store.job(view["id"])
    assert job is not None
    return job


async def _done(exchange: Exchange, job_id: str) -> Job:
    jobs = exchange.container.jobs
    await until(lambda: job_id not in jobs.active)
    job = await exchange.container.store.job(job_id)
    assert job is not None
    return job


async def test_a_header_deadline_is_recorded_with_the_job(exchange: Exchange) -> None:
    jobs = exchange.container.jobs
    view = await jobs.submit(
        exchange.principal, "/v1/chat/completions", dict(BODY), max_price_header="50", deadline_header="30"
    )
    job = await _stored(exchange, view)
    assert (job.body.get("max_price"), job.body.get("deadline_s")) == (50.0, 30.0), job.body
    await _done(exchange, job.id)


async def test_a_fixed_bid_job_keeps_its_header_terms(exchange: Exchange) -> None:
    jobs = exchange.container.jobs
    view = await jobs.submit(
        exchange.principal, "/v1/chat/completions", dict(BODY), max_price_header="40", timeout_header="12"
    )
    job = await _stored(exchange, view)
    assert (job.body.get("max_price"), job.body.get("timeout"), job.body.get("deadline_s")) == (
        40.0,
        12.0,
        None,
    )
    await _done(exchange, job.id)


async def _resumed(exchange: Exchange, accepted_s_ago: float) -> Job:
    """A queued deadline job (30 s) accepted ``accepted_s_ago`` by a gateway that died,
    resumed by this one."""
    jobs = exchange.container.jobs
    view = await jobs.submit(
        exchange.principal, "/v1/chat/completions", {**BODY, "max_price": 50.0, "deadline_s": 30.0}
    )
    first = await _done(exchange, view["id"])
    left = replace(
        first, id=first.id + "r", status="queued", result=None, error=None, hold_id=None, started_at=None,
        finished_at=None, created_at=first.created_at - accepted_s_ago, request_id=first.request_id + "r",
    )  # fmt: skip
    await exchange.container.store.put_job(left)
    await jobs._resume(left)
    return left


async def test_a_resumed_job_keeps_the_time_left_of_its_deadline(exchange: Exchange) -> None:
    jobs = exchange.container.jobs
    job = await _resumed(exchange, 20.0)
    act = jobs.active.get(job.id)
    assert act is not None
    deadline = act.run.terms.ask.deadline_s
    assert deadline is not None and 8.0 <= deadline <= 10.5, deadline  # 30 s less the 20 gone, not 30
    done = await _done(exchange, job.id)
    assert done.status == "succeeded", done


async def test_a_job_resumed_past_its_deadline_ends_with_book_timeout(exchange: Exchange) -> None:
    job = await _resumed(exchange, 31.0)
    done = await _done(exchange, job.id)
    assert done.status == "failed" and done.error is not None, done
    assert (done.error["status"], done.error["error"]["code"]) == (408, "book_timeout"), done.error
