"""A request that names no output limit gets the product's ``max_output_tokens`` sent
upstream, unless every engine said its own context and it is within that limit
(:meth:`bourse.services.market.Market.engine_bounds_output`): vLLM refuses a
``max_tokens`` over its ``max_model_len`` (400), so with the default 4096 every such
request to a 2048-token vLLM failed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bourse.services.ids import new_request_id
from bourse.wire.requests import validate
from tests.unit.services.exchange import Exchange, product, running


async def _body_sent(ex: Exchange) -> dict[str, Any]:
    """The engine body of a chat request that names no output limit."""
    body: dict[str, Any] = {"model": "p", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    run = await ex.completions.open(
        "chat", body, validate("chat", body), ex.principal, request_id=new_request_id("chat")
    )
    return run.terms.ask.body


@pytest.mark.anyio
async def test_the_output_limit_is_sent_unless_every_engine_bounds_it(tmp_path: Path) -> None:
    async with running(tmp_path, {"p": product(max_output_tokens=64)}) as ex:
        market = ex.completions.markets["p"]
        (name,) = market.engines
        assert not market.engine_bounds_output()  # nothing said: the limit is sent
        assert (await _body_sent(ex))["max_tokens"] == 64
        market.engine_context(name, 32)  # its engine's context is within the limit
        assert market.engine_bounds_output()
        assert "max_tokens" not in await _body_sent(ex)
        market.engine_context(name, 128)  # over it: the engine could go past the quote
        assert not market.engine_bounds_output()
