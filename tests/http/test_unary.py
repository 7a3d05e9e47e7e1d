"""The non-streamed answer (SPEC sections 3 and 5) for each preset, from the app in
process: the same text and usage as the stream, the receipt in the body under the
policy's name, the money headers, and an engine failure as an HTTP error."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.http.gateway import PRESETS
from tests.support.asgi import InProcessGateway
from tests.support.bodies import USER
from tests.support.errors import assert_error_envelope

pytestmark = pytest.mark.anyio

PREFIX = {"hips": "x-hips-"}
"""Receipt header prefix by product (``x-bourse-`` otherwise)."""
ID_PREFIX = {"gopuram": "gen-"}
"""The request id's prefix by product (``chatcmpl-`` otherwise)."""
ID_HEADER = {"aigrid": "x-aigrid-invocation", "gopuram": "x-gopuram-request-id"}
"""The header that repeats the request id, by product."""
ENGINE_ERROR = {"aigrid": ("provider_failed", "upstream_error"), "gopuram": ("provider_error", "api_error")}
"""The (code, type) of an engine failure by product (``upstream_error`` otherwise)."""


def _assert_id_headers(r: httpx.Response, product: str) -> str:
    """The request id in ``x-request-id`` with the product's prefix, repeated in its own header."""
    rid = r.headers["x-request-id"]
    assert rid.startswith(ID_PREFIX.get(product, "chatcmpl-")), rid
    for name in ("x-aigrid-invocation", "x-gopuram-request-id"):
        assert r.headers.get(name) == (rid if ID_HEADER.get(product) == name else None), dict(r.headers)
    return rid


async def _chat(gw: InProcessGateway, product: str, **extra: Any) -> httpx.Response:
    return await gw.post("/v1/chat/completions", {"model": product, "messages": USER, **extra})


@pytest.mark.parametrize("product", PRESETS)
async def test_non_streamed_answer_body_and_headers(gw: InProcessGateway, product: str) -> None:
    r = await _chat(gw, product, seed=2)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert int(r.headers["content-length"]) == len(r.content)
    doc = r.json()
    rid = _assert_id_headers(r, product)
    assert (doc["id"], doc["object"], doc["model"]) == (rid, "chat.completion", product)
    [choice] = doc["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"], choice
    assert choice["finish_reason"] == "stop"
    usage = doc["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["cost_micros"] == usage["total_tokens"]  # one micro-USD per token
    prefix = PREFIX.get(product, "x-bourse-")
    receipt_name = "hips" if product == "hips" else "receipt"
    receipt = doc[receipt_name]
    assert ("receipt" if product == "hips" else "hips") not in doc
    assert receipt["outcome"] == "completed"
    assert int(r.headers[f"{prefix}cost-micros"]) == receipt["cost_micros"] == usage["cost_micros"]
    assert float(r.headers[f"{prefix}latency-ms"]) == receipt["latency_ms"]
    quote = receipt["quote"] if product == "hips" else receipt["quote_micros"]
    assert int(r.headers[f"{prefix}quote-micros"]) == quote
    other = "x-bourse-" if product == "hips" else "x-hips-"
    assert not [k for k in r.headers if k.startswith(other)], dict(r.headers)


@pytest.mark.parametrize("product", ["default", "gopuram"])
async def test_non_streamed_text_and_usage_equal_the_stream(gw: InProcessGateway, product: str) -> None:
    whole = (await _chat(gw, product, seed=7)).json()
    res = await gw.sse({"model": product, "seed": 7, "stream_options": {"include_usage": True}})
    assert whole["choices"][0]["message"]["content"] == res.text()
    [u] = [c for c in res.chunks if c.get("choices") == []]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens", "cost_micros"):
        assert whole["usage"][key] == u["usage"][key], key


@pytest.mark.parametrize(("product", "field"), [("default", "reasoning_content"), ("gopuram", "reasoning")])
async def test_non_streamed_reasoning_under_the_policy_name(
    gw: InProcessGateway, product: str, field: str
) -> None:
    doc = (await _chat(gw, product, seed=2, sim={"reasoning": True})).json()
    message = doc["choices"][0]["message"]
    other = "reasoning" if field == "reasoning_content" else "reasoning_content"
    assert message[field] and other not in message, message
    res = await gw.sse({"model": product, "seed": 2, "sim": {"reasoning": True}})
    assert message[field] == "".join(c["choices"][0]["delta"].get(field, "") for c in res.content_chunks)


async def test_non_streamed_tool_call_is_assembled(gw: InProcessGateway) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    doc = (await _chat(gw, "default", seed=11, tools=tools, sim={"tool_call": True})).json()
    choice = doc["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert choice["message"]["content"] is None
    res = await gw.sse({"model": "default", "seed": 11, "tools": tools, "sim": {"tool_call": True}})
    streamed = [tc for c in res.content_chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert call["function"]["arguments"] == "".join(tc["function"]["arguments"] for tc in streamed)


async def test_non_streamed_legacy_completion(gw: InProcessGateway) -> None:
    r = await gw.post("/v1/completions", {"model": "default", "prompt": "Once upon a time", "seed": 3})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert (doc["id"], doc["object"], doc["model"]) == (
        r.headers["x-request-id"],
        "text_completion",
        "default",
    )
    assert doc["id"].startswith("cmpl-")
    assert doc["choices"][0]["text"] and doc["choices"][0]["finish_reason"] == "stop"
    res = await gw.sse({"model": "default", "prompt": "Once upon a time", "seed": 3}, path="/v1/completions")
    assert doc["choices"][0]["text"] == res.text()


@pytest.mark.parametrize("product", PRESETS)
async def test_non_streamed_error_after_output_is_an_http_502(gw: InProcessGateway, product: str) -> None:
    """The engine failed: 502 with the product's code and type for an engine failure,
    the request id in the product's headers, ``x-should-retry: false`` (it ran and
    produced: sent again, it would run, and by its policy be charged, again)."""
    r = await _chat(gw, product, seed=2, sim={"fail_after_tokens": 3, "output_tokens": 10})
    code, error_type = ENGINE_ERROR.get(product, ("upstream_error", "upstream_error"))
    err = assert_error_envelope(r, 502, code, should_retry="false")
    assert err["type"] == error_type, err
    assert "3 tokens" in err["message"]
    _assert_id_headers(r, product)
    assert r.headers["x-should-retry"] == "false"
    prefix = PREFIX.get(product, "x-bourse-")
    assert int(r.headers[f"{prefix}quote-micros"]) > 0


async def test_non_streamed_failure_before_output_after_requeues_is_502(gw: InProcessGateway) -> None:
    r = await _chat(gw, "flaky", sim={"fail_before_output": -1})
    assert_error_envelope(r, 502, "upstream_error")


async def test_non_streamed_engine_refusal_is_400(gw: InProcessGateway) -> None:
    r = await _chat(gw, "default", sim={"output_tokens": 0})
    err = assert_error_envelope(r, 400, "invalid_request")
    assert "sim.output_tokens" in err["message"]
