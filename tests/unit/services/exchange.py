"""An exchange in process for service tests: the real container (sim engines, the
in-process book, SQLite in a temporary folder, the in-memory rate limiter), no
server, no socket.

:func:`running` builds one from a few products (``sim`` deployments of one slot,
floor 10 USD per 1M tokens, so that a token costs 10 micro-USD), funds an account
and gives an :class:`Exchange` that opens runs and reads the ledger behind them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bourse.container import Container, build
from bourse.domain import policy
from bourse.ports.stores import Hold, UsageRecord
from bourse.services.auth import Principal
from bourse.services.completion import CompletionService, Finished, Run, RunEvent
from bourse.services.ids import new_request_id
from bourse.settings import Environment, parse_config
from bourse.wire.requests import validate

PRESETS = tuple(policy.PRESETS)
FLOOR = 10.0
"""USD per 1M tokens: one token costs 10 micro-USD."""
MICROS_PER_TOKEN = 10
ACCOUNT = "unit"


def product(policy: str = "default", *, slots: int = 1, **knobs: Any) -> dict[str, Any]:
    """A product on one ``sim`` deployment (no pacing, a breaker that does not open)."""
    return {
        "policy": policy,
        "max_output_tokens": 64,
        "sim_overrides": True,
        **knobs,
        "deployments": [
            {"engine": "sim", "slots": slots, "floor": FLOOR, "breaker_threshold": 1000, "cooldown_s": 0}
        ],
    }


@dataclass
class Exchange:
    container: Container
    principal: Principal

    @property
    def completions(self) -> CompletionService:
        return self.container.completions

    async def open(
        self,
        model: str,
        *,
        sim: dict[str, Any] | None = None,
        max_tokens: int = 8,
        timeout_s: float | None = None,
        stream: bool = True,
        present: Callable[[], bool] | None = None,
    ) -> Run:
        """A booked run of a chat request (as the route opens it; ``present``: the relay's
        look at the client's connection)."""
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me about the market."}],
            "max_tokens": max_tokens,
            "stream": stream,
            "seed": 7,
        }
        if sim is not None:
            body["sim"] = sim
        if timeout_s is not None:
            body["timeout"] = timeout_s
        return await self.completions.open(
            "chat",
            body,
            validate("chat", body),
            self.principal,
            request_id=new_request_id("chat"),
            present=present,
        )

    async def hold(self, run: Run) -> Hold:
        hold = await self.container.store.hold(run.hold_id)
        assert hold is not None
        return hold

    async def record(self, run: Run) -> UsageRecord:
        rec = await self.container.store.usage(ACCOUNT, run.request_id)
        assert rec is not None
        return rec

    async def busy(self, model: str) -> tuple[int, int]:
        """(slots busy, orders waiting) of ``model``'s book."""
        view = await self.completions.markets[model].view()
        return sum(d.busy for d in view.deployments), view.waiting

    async def balance(self) -> int:
        acc = await self.container.store.account(ACCOUNT)
        assert acc is not None
        return acc.balance_micros


async def run_to_end(run: Run) -> tuple[list[RunEvent], Finished]:
    """Every event of ``run``; the last is its :class:`Finished`."""
    events = [ev async for ev in run.events()]
    fin = events[-1]
    assert isinstance(fin, Finished), events
    return events, fin


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until ``condition()`` holds (checked every millisecond)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.001)


@asynccontextmanager
async def running(tmp_path: Path, products: dict[str, dict[str, Any]]) -> AsyncIterator[Exchange]:
    """A started exchange with ``products`` and a funded account ($1)."""
    config = parse_config({"products": products}, "tests/unit/services", env={})
    container = build(config, data_dir=tmp_path, env=Environment(admin_key="bk_admin_unit"))
    container.announce = False
    await container.start()
    try:
        await container.admin.create_account(ACCOUNT, 1.0)
        created = await container.admin.create_key(ACCOUNT, None, None, None, None)
        principal = await container.auth.user(f"Bearer {created['key']}")
        yield Exchange(container, principal)
    finally:
        await container.stop()
