"""A cancel that comes once a job's run has ended does not strand the job.

Seen in CI (tests/faults/test_pg_terminate.py): a job stayed ``running`` for ever, its
hold settled. Its run had ended; its final state was on its way to a database whose
connections were being terminated (the adapter's retries, each a few hundred ms), and
the client's cancel, which cancelled the job's task, landed in that write (or in the
wait for the ``running`` mark before it). The task ended there: the final state was
never written, nor kept for the sweep.

A cancel is for a run still going (queued or generating). Once the run has ended, the
job's task is not interrupted: the cancel waits for the job's state and answers it
(a finished job is returned unchanged). Both slow writes are held here on an event, as
a database under lost connections holds them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bourse.ports.stores import FINAL_JOB_STATES, Job
from bourse.services.run_state import Phase
from tests.unit.services.exchange import ACCOUNT, Exchange, until

pytestmark = pytest.mark.anyio

BODY = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


async def _cancel_while_a_write_waits(exchange: Exchange, held: str) -> Job:
    """A job whose write of status ``held`` waits until its cancel has been asked; the
    job as stored once both are done."""
    jobs = exchange.container.jobs
    store = jobs.store
    real = store.update_job
    waiting = asyncio.Event()
    go = asyncio.Event()

    async def slow(job_id: str, **fields: Any) -> None:
        if fields.get("status") == held:
            waiting.set()
            await go.wait()  # the database's retries after a lost connection
        await real(job_id, **fields)

    store.update_job = slow  # type: ignore[method-assign]
    try:
        view = await jobs.submit(exchange.principal, "/v1/chat/completions", dict(BODY))
        await asyncio.wait_for(waiting.wait(), 5)
        act = jobs.active[view["id"]]
        await until(lambda: act.run.phase is Phase.DONE)
        assert await act.run.settled() is not None  # the run has ended: its job's state is on its way
        await asyncio.sleep(0.01)  # the job's task waits for that write
        cancel = asyncio.create_task(jobs.cancel(view["id"], ACCOUNT))
        await asyncio.sleep(0.01)  # the cancel is under way while the write waits
        go.set()
        out = await asyncio.wait_for(cancel, 5)
        await until(lambda: view["id"] not in jobs.active)
    finally:
        store.update_job = real  # type: ignore[method-assign]
    job = await store.job(view["id"])
    assert job is not None
    assert job.status in FINAL_JOB_STATES, (job.status, job)
    assert out["status"] == job.status, (out, job.status)
    return job


async def test_a_cancel_during_the_final_write_leaves_the_job_finished(exchange: Exchange) -> None:
    job = await _cancel_while_a_write_waits(exchange, "succeeded")
    assert job.status == "succeeded" and job.result is not None, job


async def test_a_cancel_while_the_running_mark_is_written_leaves_the_job_finished(exchange: Exchange) -> None:
    job = await _cancel_while_a_write_waits(exchange, "running")
    assert job.status == "succeeded" and job.result is not None, job
