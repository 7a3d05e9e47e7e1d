"""An ``openai`` deployment with ``api = "responses"``: its upstream speaks the Responses
API (here another bourse gateway, whose ``/v1/responses`` runs the sim engine). Chat
completions and responses sent to the front gateway reach the upstream as streamed,
unstored Responses requests, and come back with the upstream's text, tool calls,
reasoning, usage and failures."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.responses.support import FLOOR, PRODUCTS, SERVER, Caller
from tests.support.bodies import USER
from tests.support.config import Dep, Product, config_toml
from tests.support.gateway import Gateway, running_gateway

TOOLS: list[Any] = [
    {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}
]


STALL_S = 0.5
"""The stall timeout of the front's ``relayed-stall``: a stall ends within 0.5-0.625 s."""
BOUND_S = 10.0
"""Each request of the stall test ends well within this; unended, the upstream's
stall lasts 30 s."""
STALLS = {"stall_after_tokens": 3, "stall_s": 30, "output_tokens": 8, "tokens_per_s": 1000}

UPSTREAM = [
    *PRODUCTS,
    Product("tools", [Dep("tools-a", sim={"tool_call": True})]),
    Product("stall", [Dep("stall-a", sim=STALLS)]),
]


@pytest.fixture(scope="module")
def gateways() -> Iterator[tuple[Gateway, Gateway]]:
    with running_gateway(config_toml(UPSTREAM, server=SERVER)) as upstream:

        def through(d: Dep) -> dict[str, Any]:
            return {
                "engine": "openai",
                "base_url": upstream.v1,
                "api": "responses",
                "api_key_env": "UPSTREAM_KEY",
            }

        front = [
            Product(f"relayed-{name}", [Dep(f"relayed-{name}-a", floor=FLOOR, extra={"model": name})])
            for name in ("fast", "think", "fail", "tools")
        ]
        stall = Dep("relayed-stall-a", floor=FLOOR, extra={"model": "stall"})
        front.append(Product("relayed-stall", [stall], {"stall_timeout_s": STALL_S}))
        text = config_toml(front, server=SERVER, engine_keys=through)
        with running_gateway(text, {"UPSTREAM_KEY": upstream.api_key}) as gw:
            yield gw, upstream


def test_a_chat_completion_through_a_responses_upstream(gateways: tuple[Gateway, Gateway]) -> None:
    gw, upstream = gateways
    client = gw.client()
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="relayed-fast", messages=messages)
    direct = upstream.client().responses.create(model="fast", store=False, input=messages)
    assert r.choices[0].message.content == direct.output_text and r.choices[0].finish_reason == "stop"
    assert r.usage is not None and direct.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (direct.usage.input_tokens, 6)
    assert "usage_estimated" not in r.usage.model_dump()  # the upstream's own counts
    chunks = list(
        client.chat.completions.create(
            model="relayed-fast", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (
        text == direct.output_text
        and chunks[-1].usage is not None
        and chunks[-1].usage.completion_tokens == 6
    )


def test_a_response_through_a_responses_upstream(gateways: tuple[Gateway, Gateway]) -> None:
    gw, _ = gateways
    me = Caller(gw.url, gw.api_key)
    s = me.stream({"model": "relayed-fast", "input": "Hi"})
    final = s.events[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 6, final
    assert final["usage"]["cost_micros"] > 0
    think = me.create({"model": "relayed-think", "input": "Think."})
    assert [i["type"] for i in think["output"]] == ["reasoning", "message"], think["output"]
    assert think["usage"]["output_tokens_details"]["reasoning_tokens"] == 6, think["usage"]
    cut = me.create({"model": "relayed-fast", "input": "Hi", "max_output_tokens": 2})
    assert cut["status"] == "incomplete" and cut["usage"]["output_tokens"] == 2, cut


def test_tool_calls_come_back_from_a_responses_upstream(gateways: tuple[Gateway, Gateway]) -> None:
    gw, _ = gateways
    r = gw.client().chat.completions.create(
        model="relayed-tools", messages=[{"role": "user", "content": "Weather?"}],
        tools=[{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
    )  # fmt: skip
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls is not None and len(calls) == 1, r
    call = calls[0]
    assert call.type == "function" and call.function.name == "weather" and json.loads(call.function.arguments)
    item = Caller(gw.url, gw.api_key).create({"model": "relayed-tools", "input": "Weather?", "tools": TOOLS})
    assert item["output"][0]["type"] == "function_call" and item["output"][0]["name"] == "weather", item


def test_a_failure_of_a_responses_upstream(gateways: tuple[Gateway, Gateway]) -> None:
    gw, _ = gateways
    me = Caller(gw.url, gw.api_key)
    s = me.stream({"model": "relayed-fail", "input": "Go."})
    types = [e["type"] for e in s.events]
    assert types.count("response.output_text.delta") == 3 and types[-1] == "response.failed", types
    assert s.events[-1]["response"]["error"]["code"] == "upstream_error", s.events[-1]
    with pytest.raises(openai.BadRequestError, match="Responses API"):
        gw.client().completions.create(model="relayed-fast", prompt="Once upon a time")


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
def test_a_non_streamed_request_whose_responses_upstream_stalls_is_ended_by_the_stall_clock(
    gateways: tuple[Gateway, Gateway], route: str
) -> None:
    """A non-streamed request to an ``api = "responses"`` deployment is a stream
    upstream (the Responses API's answer is read event by event), so its gaps are
    timed like any stream's. Before the fix the engine said it answered whole, the
    stall clock was off, and this request waited out the upstream's 30 s stall."""
    gw, _ = gateways
    body: dict[str, Any] = {"model": "relayed-stall", "max_tokens": 8, "messages": USER}
    if route == "/v1/responses":
        body = {"model": "relayed-stall", "max_output_tokens": 8, "input": "Hi"}
    t0 = time.monotonic()
    r = httpx.post(gw.url + route, json=body, headers=gw.headers, timeout=BOUND_S)
    elapsed = time.monotonic() - t0
    assert STALL_S <= elapsed < BOUND_S, elapsed
    assert r.status_code == 502, r.text  # failed after output: nothing whole to answer
    err = r.json()["error"]
    assert err["code"] == "upstream_error" and f"no token for {STALL_S:g} s" in err["message"], err
