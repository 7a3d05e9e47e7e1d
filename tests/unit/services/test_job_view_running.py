"""A job read while it runs says when it started, though its ``running`` mark has not
reached the database yet.

Seen in the suite under load (tests/e2e/jobs/test_lifecycle.py): ``GET /v1/jobs/{id}``
answered ``status: running`` with tokens generated and ``started_at: null``. The status
and progress come from the run in memory; ``started_at`` came only from the stored row,
whose update is written beside the run (a task of its own, which a slow database
delays). The view now takes the start from the run when the row has none yet.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bourse.services.run_state import Phase
from tests.unit.services.exchange import ACCOUNT, Exchange, until

pytestmark = pytest.mark.anyio

BODY = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


async def test_a_running_job_read_before_its_mark_is_stored_says_when_it_started(exchange: Exchange) -> None:
    jobs = exchange.container.jobs
    store = jobs.store
    real = store.update_job
    go = asyncio.Event()
    marks: list[float] = []

    async def slow(job_id: str, **fields: Any) -> None:
        if fields.get("status") == "running":
            marks.append(fields["started_at"])
            await go.wait()  # a slow database
        await real(job_id, **fields)

    store.update_job = slow  # type: ignore[method-assign]
    try:
        view = await jobs.submit(exchange.principal, "/v1/chat/completions", dict(BODY))
        await until(lambda: bool(marks))
        act = jobs.active[view["id"]]
        assert act.run.phase >= Phase.ADMITTED
        stored = await store.job(view["id"])
        assert stored is not None and stored.started_at is None  # the mark is still on its way
        got = await jobs.get(view["id"], ACCOUNT)
        assert got["status"] == "running", got
        assert got["started_at"] == marks[0], got  # the time the mark will store
    finally:
        go.set()
        store.update_job = real  # type: ignore[method-assign]
    await until(lambda: view["id"] not in jobs.active)
    done = await jobs.get(view["id"], ACCOUNT)
    assert done["status"] == "succeeded" and done["started_at"] == marks[0], done
