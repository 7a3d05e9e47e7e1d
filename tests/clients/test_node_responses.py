"""The npm clients on the Responses API (``node/responses.mjs``): the Vercel AI SDK's
default provider (``createOpenAI()(model)``, which speaks the Responses API) with
``streamText`` and ``generateText``, and the ``openai`` package's streamed
``responses.create``, each against a served gateway, unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.clients.test_node_clients import run_json
from tests.e2e.responses.support import PRODUCTS, SERVER, Caller
from tests.support.env import Env, start_env


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with start_env("sim", PRODUCTS, server=SERVER) as e:
        yield e


def _run(env: Env, client: str, model: str = "fast") -> dict[str, Any]:
    gw = env.gateway
    return run_json(
        "responses.mjs", client, env={"BOURSE_URL": gw.v1, "BOURSE_KEY": gw.api_key, "BOURSE_MODEL": model}
    )


def _stored_text(env: Env, response_id: object) -> str:
    doc = Caller(env.url, env.gateway.api_key).retrieve(str(response_id))
    assert doc["status"] == "completed", doc
    return "".join(p["text"] for item in doc["output"] if item["type"] == "message" for p in item["content"])


@pytest.mark.parametrize("client", ["ai-stream", "ai-generate"])
def test_the_ai_sdk_default_provider(env: Env, client: str) -> None:
    seen = _run(env, client)
    assert seen["text"] and seen["finishReason"] == "stop", seen
    usage = seen["usage"]
    assert isinstance(usage, dict) and usage["outputTokens"] == 6 and usage["inputTokens"] > 0, seen
    assert str(seen["responseId"]).startswith("resp-"), seen
    assert _stored_text(env, seen["responseId"]) == seen["text"]
    if client == "ai-stream":
        assert seen["errors"] == [] and "text-delta" in seen["parts"] and "finish" in seen["parts"], seen


def test_the_ai_sdk_default_provider_over_two_turns(env: Env) -> None:
    seen = _run(env, "ai-multi-turn")
    assert seen["first"] and seen["second"], seen
    kinds = [item.get("type", "message") for item in seen["input"]]
    assert kinds == ["message", "item_reference", "message"], seen["input"]
    # the reference was resolved: the engine saw the first answer (its tokens are in the prompt)
    assert seen["usage"]["inputTokens"] > len(seen["first"].split()), seen


def test_the_openai_package_streams_a_response(env: Env) -> None:
    seen = _run(env, "openai-stream")
    types = seen["types"]
    assert isinstance(types, list) and types[0] == "response.created" and types[-1] == "response.completed", (
        seen
    )
    assert types.count("response.output_text.delta") == 6, types
    assert seen["sequence"] == list(range(len(types))), seen
    assert seen["status"] == "completed" and seen["text"] == _stored_text(env, seen["id"]), seen
    usage = seen["usage"]
    assert isinstance(usage, dict) and usage["output_tokens"] == 6 and usage["cost_micros"] > 0, usage
