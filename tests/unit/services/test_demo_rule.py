"""When a start makes the ``demo`` account (issue 37 item 5), through a real container
on SQLite: the rule ``bourse serve`` picks (:func:`demo_rule`), and what each rule makes
on an empty ledger, on one with accounts, and on one that has the account already.
The served starts are tests/e2e/test_demo_account.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from bourse.container import Container, build
from bourse.services.accounts import DEMO_ACCOUNT, DemoRule, demo_rule
from bourse.settings import Environment, parse_config
from tests.unit.services.exchange import product

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("asked", "built_in_config", "single_node", "rule"),
    [
        (False, True, True, DemoRule.FRESH),  # the README's first command
        (False, False, True, DemoRule.OFF),  # a config file on SQLite
        (False, True, False, DemoRule.OFF),  # PostgreSQL, even on the built-in config
        (False, False, False, DemoRule.OFF),
        (True, False, False, DemoRule.ASKED),  # --demo or [server] demo = true
        (True, True, True, DemoRule.ASKED),
    ],
)
def test_the_rule_of_a_start(asked: bool, built_in_config: bool, single_node: bool, rule: DemoRule) -> None:
    assert demo_rule(asked=asked, built_in_config=built_in_config, single_node=single_node) is rule


@asynccontextmanager
async def started(tmp_path: Path, rule: DemoRule, accounts: tuple[str, ...] = ()) -> AsyncIterator[Container]:
    """A container started with ``rule`` on the SQLite ledger in ``tmp_path``, after a
    first start (no demo) that made ``accounts``."""
    config = parse_config({"products": {"one": product()}}, "tests/unit/services", env={})
    env = Environment(admin_key="bk_admin_unit")
    if accounts:
        first = build(config, data_dir=tmp_path, env=env)
        first.announce = False
        await first.start()
        try:
            for account in accounts:
                await first.admin.create_account(account, 1.0)
        finally:
            await first.stop()
    container = build(config, data_dir=tmp_path, env=env)
    container.announce = False
    container.demo = rule
    await container.start()
    try:
        yield container
    finally:
        await container.stop()


async def _demo_keys(container: Container) -> list[str]:
    return [k["id"] for k in await container.admin.keys(DEMO_ACCOUNT, 10, None)]


async def test_off_makes_nothing(tmp_path: Path) -> None:
    async with started(tmp_path, DemoRule.OFF) as c:
        assert c.demo_key is None
        assert await c.store.account(DEMO_ACCOUNT) is None and await _demo_keys(c) == []


async def test_fresh_makes_it_on_an_empty_ledger_only(tmp_path: Path) -> None:
    async with started(tmp_path / "empty", DemoRule.FRESH) as c:
        assert c.demo_key is not None
        assert (await c.auth.user(f"Bearer {c.demo_key}")).account_id == DEMO_ACCOUNT
        account = await c.store.account(DEMO_ACCOUNT)
        assert account is not None and account.balance_micros == 5_000_000
    async with started(tmp_path / "used", DemoRule.FRESH, accounts=("acme",)) as c:
        assert c.demo_key is None and await c.store.account(DEMO_ACCOUNT) is None


async def test_asked_makes_it_once_on_any_ledger(tmp_path: Path) -> None:
    async with started(tmp_path, DemoRule.ASKED, accounts=("acme",)) as c:
        assert c.demo_key is not None and len(await _demo_keys(c)) == 1
    async with started(tmp_path, DemoRule.ASKED) as c:  # a restart: the account is there
        assert c.demo_key is None and len(await _demo_keys(c)) == 1
