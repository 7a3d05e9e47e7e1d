"""A job charged just before the gateway died is not run and charged again.

Found by the fault suite (``tests/faults/test_kill.py`` on PostgreSQL: a request
charged by two holds, and the usage records short of the revenue). A job's run
settles its hold (the charge, with its usage record) and then stores the job's
result: two transactions. A ``kill -9`` between them leaves a ``running`` job whose
hold is already settled. The restarted gateway resumed it like any interrupted job,
"from the beginning", and charged it a second time, and the second run's usage
record replaced the first's.

Now a resumed job whose earlier hold was already charged is not run again: it ends
``failed``, its error saying that the result was lost after the charge and where its
receipt is, and it stays charged once. (A hold released or reconciled before the
restart charged nothing, so that job runs again, as before.)

The state the kill leaves is written straight into the store of a stopped gateway,
then a gateway starts on the same data folder. The data folder is watched
(:func:`tests.support.ledgers.watched`): the suite's ledger check runs on it at the end.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bourse.container import Container, build
from bourse.ports.stores import Hold, Job, UsageRecord
from bourse.settings import Environment, parse_config
from tests.support.ledgers import watched
from tests.support.waiting import await_until

pytestmark = pytest.mark.anyio

PRODUCTS = {
    "one": {
        "sim_overrides": True,
        "deployments": [{"engine": "sim", "slots": 1, "floor": 1.0}],
    }
}
ACCOUNT = "resume"
CHARGE = 321


def _container(data_dir: Path) -> Container:
    config = parse_config({"products": PRODUCTS}, "tests/faults/test_job_resume", env={})
    container = build(config, data_dir=data_dir, env=Environment(admin_key="bk_admin_resume"))
    container.announce = False
    return container


async def _left_by_a_kill(data_dir: Path, *, charged: bool) -> Job:
    """A gateway that ran a job, settled its hold (``charged``) or released it, and died
    before it stored the job's result."""
    first = _container(data_dir)
    await first.start()
    try:
        await first.admin.create_account(ACCOUNT, 1.0)
        key = await first.admin.create_key(ACCOUNT, None, None, None, None)
        now = time.time()
        owner = first.billing.owner
        hold = Hold("hold_resume", ACCOUNT, "chatcmpl-resume", 1000, "open", owner=owner, product="one",
                    created_at=now)  # fmt: skip
        await first.store.place_hold(hold)
        usage = UsageRecord("chatcmpl-resume", ACCOUNT, "one", now, "completed", CHARGE if charged else 0,
                            {"usage": {"cost_micros": CHARGE if charged else 0}})  # fmt: skip
        if charged:
            await first.store.settle(hold.id, CHARGE, usage, now)
        else:
            await first.store.release(hold.id, usage, now)
        job = Job(
            id="job_resume", account_id=ACCOUNT, key_id=key["id"], endpoint="/v1/chat/completions",
            body={"model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                  "sim": {"output_tokens": 5}},
            status="running", request_id=hold.request_id, bid=1.0, created_at=now, expires_at=now + 3600,
            hold_id=hold.id, owner=owner, started_at=now,
        )  # fmt: skip
        await first.store.put_job(job)
        return job
    finally:
        await first.stop()


async def _restarted(data_dir: Path, job: Job) -> tuple[Container, Job]:
    second = _container(data_dir)
    await second.start()

    async def ended() -> Job | None:
        j = await second.store.job(job.id)
        return j if j is not None and j.status not in ("queued", "running") else None

    return second, await await_until(ended, 15, what="the resumed job ended")


async def test_a_job_charged_before_the_kill_is_not_charged_again(tmp_path: Path) -> None:
    with watched(tmp_path, None):
        await _charged_once(tmp_path)


async def _charged_once(tmp_path: Path) -> None:
    job = await _left_by_a_kill(tmp_path, charged=True)
    second, done = await _restarted(tmp_path, job)
    try:
        assert done.status == "failed" and done.error is not None, done
        message = done.error["error"]["message"]
        assert "charged" in message and f"/v1/usage/{job.request_id}" in message, message
        holds = [h for h in await second.store.holds(None, ACCOUNT, 100) if h.request_id == job.request_id]
        assert [(h.state, h.charged_micros) for h in holds] == [("settled", CHARGE)], holds
        account = await second.store.account(ACCOUNT)
        assert account is not None and account.balance_micros == 1_000_000 - CHARGE
        record = await second.store.usage(ACCOUNT, job.request_id)
        assert record is not None and record.cost_micros == CHARGE
        totals = await second.store.totals()
        assert totals.balanced, totals
    finally:
        await second.stop()


async def test_a_job_whose_hold_was_released_runs_again_and_is_charged_once(tmp_path: Path) -> None:
    with watched(tmp_path, None):
        await _run_again(tmp_path)


async def _run_again(tmp_path: Path) -> None:
    job = await _left_by_a_kill(tmp_path, charged=False)
    second, done = await _restarted(tmp_path, job)
    try:
        assert done.status == "succeeded" and done.result is not None, done
        cost = done.result["usage"]["cost_micros"]
        holds = [h for h in await second.store.holds(None, ACCOUNT, 100) if h.request_id == job.request_id]
        assert sorted((h.state, h.charged_micros) for h in holds) == [("released", 0), ("settled", cost)], (
            holds
        )
        account = await second.store.account(ACCOUNT)
        assert account is not None and account.balance_micros == 1_000_000 - cost
    finally:
        await second.stop()
