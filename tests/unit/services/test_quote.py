"""The quote and the gateway's own prompt estimate: one walk over the prompt feeds both."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from bourse.services.billing import quote_for
from bourse.wire.prompt import PromptSize, measure_prompt
from tests.unit.services.exchange import Exchange

pytestmark = pytest.mark.anyio

TOOLS = [{"type": "function", "function": {"name": "get_price", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("body", "size"),
    [
        ({"messages": [{"role": "user", "content": "héllo"}]}, PromptSize(6, 1, 4 + 6 // 4 + 1)),
        (
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {}}],
                    },
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c", "function": {"name": "get_price", "arguments": '{"a":1}'}}
                        ],
                    },
                ],
                "tools": TOOLS,
            },
            PromptSize(
                8 + 4 + 64 + len("get_price") + len('{"a":1}') + len(orjson.dumps(TOOLS)),
                3,
                3 * 4 + (8 // 4 + 1) + (4 // 4 + 1),
            ),
        ),
        ({"prompt": "once upon"}, PromptSize(9, 1, 9 // 4 + 1)),
        ({"prompt": ["ab", 17, 42]}, PromptSize(2 + 1 + 1, 1, (2 // 4 + 1) + 1 + 1)),
        ({"prompt": None}, PromptSize(0, 1, 0)),
    ],
)
def test_one_walk_gives_the_bound_and_the_estimate(body: dict[str, Any], size: PromptSize) -> None:
    assert measure_prompt(body) == size


def test_the_quote_formula() -> None:
    """tokens = prompt UTF-8 bytes + 8 per message + 8 + the output budget;
    micro-USD = ceil(tokens x price units / 1,000,000), price units = USD per 1M x 10^6."""
    q = quote_for(PromptSize(25, 1, 0), 8, 10.0)
    assert (q.tokens, q.micros, q.bid) == (25 + 8 + 8 + 8, 490, 10.0)
    q = quote_for(PromptSize(100, 3, 0), 1000, 0.15)
    assert q.tokens == 100 + 24 + 8 + 1000 and q.micros == 170  # 1132 x 150000 / 10^6 = 169.8, rounded up


async def test_a_run_holds_its_quote(exchange: Exchange) -> None:
    run = await exchange.open("default", max_tokens=8)
    assert run.quote.tokens == len(b"Tell me about the market.") + 8 + 8 + 8
    assert (await exchange.hold(run)).amount_micros == run.quote.micros == 10 * run.quote.tokens
    await run.abandon()
