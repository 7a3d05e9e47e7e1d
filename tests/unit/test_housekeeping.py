"""Housekeeping (:mod:`bourse.services.housekeeping`): expired idempotency keys are purged
on a schedule, in batches, a failed pass does not stop the next, and the application's
lifespan starts and stops it (the composition root wires it to the store)."""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from bourse.container import build
from bourse.ports.stores import IdemBegin, StoredResponse
from bourse.services.housekeeping import Housekeeping
from bourse.settings import Environment, parse_config
from tests.contract.cluster import eventually
from tests.support.gateway import ADMIN_KEY


class FakeStore:
    """An idempotency store holding ``expired`` expired keys; ``failures`` purge calls raise first."""

    def __init__(self, expired: int = 0, failures: int = 0) -> None:
        self.expired = expired
        self.failures = failures
        self.calls: list[tuple[float, int]] = []

    async def idem_begin(
        self, account_id: str, key: str, body_hash: str, now: float, ttl_s: float
    ) -> IdemBegin:
        raise NotImplementedError

    async def idem_complete(self, account_id: str, key: str, response: StoredResponse | None) -> None:
        raise NotImplementedError

    async def prunable(self, age_s: float, limit: int) -> list[str]:
        raise NotImplementedError  # retention is off in these tests (tests/contract/test_retention.py)

    async def prune(self, request_ids: Sequence[str], age_s: float) -> tuple[int, int]:
        raise NotImplementedError

    async def purge_idempotency(self, now: float, limit: int) -> int:
        self.calls.append((now, limit))
        if self.failures:
            self.failures -= 1
            raise OSError("database unreachable")
        n = min(limit, self.expired)
        self.expired -= n
        return n


@pytest.mark.anyio
async def test_a_pass_purges_in_batches_until_a_short_one() -> None:
    store = FakeStore(expired=25)
    hk = Housekeeping(store, interval_s=3600, batch=10, clock=lambda: 123.0)
    assert await hk.purge_once() == 25
    assert store.calls == [(123.0, 10), (123.0, 10), (123.0, 10)]
    assert store.expired == 0


@pytest.mark.anyio
async def test_the_schedule_runs_at_start_and_every_interval() -> None:
    store = FakeStore(expired=3)
    hk = Housekeeping(store, interval_s=0.01, batch=2)
    hk.start()
    try:

        async def passes() -> bool:
            return hk.passes >= 3

        await eventually(passes, what="three housekeeping passes")
        assert store.expired == 0
    finally:
        task = hk._task
        await hk.stop()
    assert task is not None and task.cancelled()  # stopped: no pass runs any more


@pytest.mark.anyio
async def test_a_failed_pass_is_logged_and_the_next_one_runs(caplog: pytest.LogCaptureFixture) -> None:
    store = FakeStore(expired=1, failures=1)
    hk = Housekeeping(store, interval_s=0.01)
    hk.start()
    try:

        async def purged() -> bool:
            return store.expired == 0

        await eventually(purged, what="the pass after the failed one")
    finally:
        await hk.stop()
    assert "purging expired idempotency keys failed" in caplog.text


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Housekeeping(FakeStore(), interval_s=0)
    with pytest.raises(ValueError):
        Housekeeping(FakeStore(), interval_s=1, batch=0)
    with pytest.raises(ValueError):
        Housekeeping(FakeStore(), interval_s=1, retention_s=0)
    with pytest.raises(ValueError):
        Housekeeping(FakeStore(), interval_s=1, retention_s=60, retention_interval_s=0)


CONFIG = """
[storage]
idempotency_purge_interval_s = 0.05

[products.p]
[[products.p.deployments]]
engine = "sim"
slots = 1
floor = 0.1
"""


@pytest.mark.anyio
async def test_the_running_gateway_purges_expired_keys_from_its_database(tmp_path: Path) -> None:
    """Wired by the composition root: started with the app, it empties the table of
    the keys whose TTL has passed and keeps the others."""
    config = parse_config(tomllib.loads(CONFIG), "<test>", env={})
    container = build(config, data_dir=tmp_path, env=Environment(admin_key=ADMIN_KEY))
    container.announce = False
    store: Any = container.store
    await container.start()
    try:
        now = 1_700_000_000.0  # long ago: these keys expired then
        for i in range(3):
            assert (await store.idem_begin("acct", f"old{i}", "h", now, 60.0)).state == "new"
        assert (await store.idem_begin("acct", "live", "h", now, 10 * 365 * 86_400.0)).state == "new"

        async def only_live_left() -> bool:
            def keys(db: Any) -> list[str]:
                return [r["key"] for r in db.fetch("SELECT key FROM idempotency")]

            left: list[str] = await store._read(keys)
            return left == ["live"]

        await eventually(only_live_left, what="the expired keys purged")
    finally:
        await container.stop()
    assert container.housekeeping._task is None


@pytest.mark.anyio
async def test_the_gateway_starts_the_retention_chore_only_when_it_is_set(tmp_path: Path) -> None:
    """``[storage] retention_s`` reaches the housekeeping (its own task, on its own
    interval); unset, no retention task runs."""
    for retention, runs in (("", False), ("retention_s = 86400\nretention_interval_s = 0.05\n", True)):
        text = CONFIG.replace("[storage]\n", "[storage]\n" + retention)
        config = parse_config(tomllib.loads(text), "<test>", env={})
        container = build(config, data_dir=tmp_path / str(runs), env=Environment(admin_key=ADMIN_KEY))
        container.announce = False
        await container.start()
        hk = container.housekeeping
        try:
            assert hk.retention_s == (86_400.0 if runs else None)
            if runs:

                async def passes(hk: Housekeeping = hk) -> bool:
                    return hk.retention_passes >= 2

                await eventually(passes, what="two retention passes")
            else:
                assert hk._retention_task is None
        finally:
            await container.stop()
        assert hk._retention_task is None
