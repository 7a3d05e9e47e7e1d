"""The quote and the gateway's own prompt estimate: one walk over the prompt feeds both."""

from __future__ import annotations

import re
from pathlib import Path
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


ROOT = Path(__file__).parents[3]
DOCUMENTED = {
    # file: a pattern whose two groups are the allowance per message and per request
    "docs/money.md": r"quote tokens = prompt bytes \+ (\d+) \u00d7 messages \+ (\d+) \+ output budget",
    "docs/architecture.md": r"tokens\s+= prompt_bytes \+ (\d+) \u00d7 messages \+ (\d+) \+ max_output",
    "README.md": r"(\d+) prompt bytes \+ (\d+) for the message\s+\+ (\d+) \+ `max_tokens` (\d+)\)",
}


@pytest.mark.parametrize("doc", ["docs/money.md", "docs/architecture.md"])
async def test_the_documented_formula_is_the_real_hold(exchange: Exchange, doc: str) -> None:
    """The formula as the docs write it, computed for a request, is what a real hold takes."""
    text = (ROOT / doc).read_text()
    found = re.search(DOCUMENTED[doc], text)
    assert found is not None, f"{doc} no longer states the quote formula"
    per_message, per_request = int(found[1]), int(found[2])
    run = await exchange.open("default", max_tokens=8)
    tokens = len(b"Tell me about the market.") + per_message * 1 + per_request + 8
    hold = await exchange.hold(run)
    assert hold.amount_micros == -(-tokens * 10_000_000 // 1_000_000), (doc, tokens, hold)
    await run.abandon()


def test_the_readme_example_is_the_formula() -> None:
    """The README's worked example ("Hello", max_tokens 3 at 0.20): its parts and its
    total are the formula's, and its hold is the quote the code computes."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"hold was (\d+) micro-USD \((\d+) tokens at the bid: " + DOCUMENTED["README.md"], text)
    assert found is not None, "README.md no longer works the quote example"
    held, total, nbytes, per_message, per_request, max_tokens = (int(g) for g in found.groups())
    q = quote_for(PromptSize(nbytes, 1, 0), max_tokens, 0.20)
    assert (q.tokens, q.micros) == (total, held) == (nbytes + per_message + per_request + max_tokens, held)
