"""Which engine of a product counts its prompts for the context pre-check: one that is
loaded and knows its context; an ``openai`` engine without a tokenizer and ``n_ctx``
(a ``TokenCounter`` by its shape) is passed over, so a product that also runs an
exact counter keeps it."""

from __future__ import annotations

from typing import Any, cast

from bourse.domain.policy import resolve_policy
from bourse.engines.openai_http import OpenAIHTTPEngine
from bourse.ports.engine import Engine, Kind
from bourse.services.market import Market


class _Exact(Engine):
    """A loaded engine with its own tokenizer (as the llamacpp engine is)."""

    @property
    def context_length(self) -> int:
        return 512

    async def count_prompt_tokens(self, kind: Kind, body: dict[str, Any]) -> int | None:
        return 7

    def generate(self, request: Any) -> Any:
        raise NotImplementedError


def _market(engines: dict[str, Engine]) -> Market:
    return Market(
        "p", cast(Any, None), engines, resolve_policy("default", {}), default_bid=0.1, context_length=8192,
        max_output_tokens=16, supports_tools=True, sim_overrides=False, stall_timeout_s=10,
    )  # fmt: skip


def test_an_openai_engine_without_a_tokenizer_is_passed_over() -> None:
    exact = _Exact()
    bare = OpenAIHTTPEngine("http://127.0.0.1:9/v1", "m")
    assert _market({"a": bare, "b": exact}).token_counter() is exact
    assert _market({"a": bare}).token_counter() is None
