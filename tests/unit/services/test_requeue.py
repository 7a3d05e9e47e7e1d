"""Requeue (SPEC section 8): a transient failure before any output puts the order back
in the book, up to the policy's ``max_requeues``; then the run fails, uncharged."""

from __future__ import annotations

import pytest

from bourse.ports.engine import ChunkEvent
from bourse.services.completion import Finished, Queued, Requeued
from tests.unit.services.exchange import Exchange, run_to_end

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("model", "failures", "succeeds"),
    [
        ("default", 1, True),
        ("default", 3, True),  # max_requeues = 3: the fourth attempt runs
        ("default", 4, False),
        ("two-requeues", 2, True),
        ("two-requeues", 3, False),
    ],
)
async def test_requeues_up_to_max_requeues(
    exchange: Exchange, model: str, failures: int, succeeds: bool
) -> None:
    run = await exchange.open(model, sim={"fail_before_output": failures})
    events, fin = await run_to_end(run)
    requeues = min(failures, exchange.completions.markets[model].policy.max_requeues)
    assert type(events[0]) is Queued
    assert [type(ev) for ev in events[1 : 1 + requeues]] == [Requeued] * requeues
    assert run.order is not None and run.order.requeues == requeues
    assert fin.usage["x_market"]["requeues"] == requeues
    if succeeds:
        assert fin.outcome == "completed" and fin.error is None
        assert any(type(ev) is ChunkEvent for ev in events) and fin.cost_micros > 0
        assert (await exchange.hold(run)).state == "settled"
    else:
        assert fin.outcome == "error" and fin.error is not None
        assert (fin.error.status, fin.error.code) == (502, "upstream_error")
        assert "on every attempt" in fin.error.message
        assert not any(type(ev) is ChunkEvent for ev in events) and fin.cost_micros == 0
        assert (await exchange.hold(run)).state == "released"
    assert isinstance(fin, Finished)
    assert await exchange.busy(model) == (0, 0)
    # each attempt that failed before any output is a failed attempt in the book's view
    # (nobody paid it), the one that ran a clear
    view = await exchange.completions.markets[model].view()
    attempts = [(c.attempt, c.failed) for c in view.recent if c.order_id == run.order.id]
    failed = failures if succeeds else requeues + 1
    assert attempts == ([(failed, False)] if succeeds else []) + [(a, True) for a in reversed(range(failed))]


async def test_a_failure_after_output_is_final(exchange: Exchange) -> None:
    run = await exchange.open("default", sim={"fail_after_tokens": 2})
    events, fin = await run_to_end(run)
    assert not any(type(ev) is Requeued for ev in events)
    assert fin.outcome == "error" and fin.error is not None and fin.error.status == 502
    assert run.order is not None and run.order.requeues == 0
    assert await exchange.busy("default") == (0, 0)
    view = await exchange.completions.markets["default"].view()
    assert [c.failed for c in view.recent if c.order_id == run.order.id] == [False], "it ran: paid, cleared"
