"""The reasoning tokens of a run in ``usage.completion_tokens_details``: the engine's
own count, else the gateway's count of the reasoning it relayed."""

from __future__ import annotations

import pytest

from bourse.engines.sim import REASONING_TOKENS
from tests.unit.services.exchange import Exchange, run_to_end

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("omit_usage", [False, True])
async def test_reasoning_tokens_in_the_usage(exchange: Exchange, omit_usage: bool) -> None:
    run = await exchange.open(
        "default", sim={"reasoning": True, "output_tokens": 3, "omit_usage": omit_usage}
    )
    _, fin = await run_to_end(run)
    assert fin.usage["completion_tokens_details"]["reasoning_tokens"] == REASONING_TOKENS, fin.usage
    assert bool(fin.usage.get("usage_estimated")) is omit_usage


async def test_no_reasoning_no_details(exchange: Exchange) -> None:
    _, fin = await run_to_end(await exchange.open("default"))
    assert "completion_tokens_details" not in fin.usage, fin.usage
