"""The SSE contract of SPEC section 4, through the served gateway, for both engine kinds:
same text streamed or not, tool calls, ids and model, the usage chunk, keep-alives,
and no buffering."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.bodies import USER
from tests.support.config import Dep, Product
from tests.support.env import ENGINE_KINDS, INTERNAL_MODEL, UPSTREAM_MODEL, Env, start_env
from tests.support.sse import collect_sse

SEEDS = (1, 7, 4242)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    products = [
        Product("p", [Dep("p-a", slots=16)]),
        Product("always", [Dep("always-a", slots=4)], {"usage_chunk": "always"}),
    ]
    with start_env(request.param, products, server={"quiet_interval_s": 0.2}) as e:
        yield e


# -- 1. streamed text == non-streamed text ------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_chat_streamed_text_equals_non_streamed(env: Env, seed: int) -> None:
    client = env.client()
    whole = client.chat.completions.create(model="p", messages=USER, seed=seed)
    text = whole.choices[0].message.content
    assert text, whole
    pieces: list[str] = []
    finish = None
    for chunk in client.chat.completions.create(model="p", messages=USER, seed=seed, stream=True):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == text
    assert finish == whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None and whole.usage.completion_tokens == len([p for p in pieces if p])


def test_chat_different_seeds_give_different_text(env: Env) -> None:
    client = env.client()
    texts = {
        client.chat.completions.create(model="p", messages=USER, seed=s).choices[0].message.content
        for s in SEEDS
    }
    assert len(texts) == len(SEEDS)


@pytest.mark.parametrize("seed", SEEDS)
def test_legacy_completion_streamed_text_equals_non_streamed(env: Env, seed: int) -> None:
    client = env.client()
    whole = client.completions.create(model="p", prompt="Once upon a time", seed=seed)
    assert whole.object == "text_completion"
    text = whole.choices[0].text
    assert text
    pieces: list[str] = []
    objects = set()
    for chunk in client.completions.create(model="p", prompt="Once upon a time", seed=seed, stream=True):
        objects.add(chunk.object)
        assert chunk.model == "p"
        for choice in chunk.choices:
            pieces.append(choice.text)
    assert "".join(pieces) == text
    assert objects == {"text_completion"}


def test_legacy_completion_raw_stream_chunks_are_text_completion(env: Env) -> None:
    res = collect_sse(env, {"model": "p", "prompt": "Hello", "seed": 3}, path="/v1/completions")
    assert res.status == 200
    assert res.content_chunks
    for c in res.content_chunks:
        assert c["object"] == "text_completion"
        assert "text" in c["choices"][0]
        assert c["id"] == res.headers["x-request-id"]
        assert c["model"] == "p"
    assert res.frames[-1].is_done


# -- 2. tool calls -----------------------------------------------------------------------


def test_streamed_tool_call_equals_non_streamed(env: Env) -> None:
    client = env.client()
    kw: dict[str, Any] = dict(
        model="p", messages=USER, seed=11, tools=TOOLS, extra_body={"sim": {"tool_call": True}}
    )
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
    expected = choice.message.tool_calls[0]

    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    slot["id"] = tc.id
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls"
    assert list(calls) == [0]
    got = calls[0]
    assert got["id"] == expected.id and got["id"]
    assert got["name"] == expected.function.name == "get_weather"  # the first tool offered
    assert got["arguments"] == expected.function.arguments
    args = json.loads(got["arguments"])
    assert isinstance(args, dict) and args


def test_tool_call_arguments_arrive_in_fragments(env: Env) -> None:
    body = {"model": "p", "seed": 11, "tools": TOOLS, "sim": {"tool_call": True}}
    res = collect_sse(env, body)
    fragments = [
        tc["function"]["arguments"]
        for c in res.content_chunks
        for tc in c["choices"][0]["delta"].get("tool_calls") or []
        if tc.get("function", {}).get("arguments")
    ]
    assert len(fragments) >= 2, "tool-call arguments should stream as several fragments"
    assert res.content_chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# -- 3. ids and model ----------------------------------------------------------------------


def test_sse_response_headers(env: Env) -> None:
    res = collect_sse(env, {"model": "p", "seed": 1})
    assert res.status == 200
    h = res.headers
    assert h["content-type"] == "text/event-stream; charset=utf-8"
    assert h["cache-control"] == "no-cache, no-transform"
    assert h["x-accel-buffering"] == "no"
    assert h.get("x-request-id")


def test_every_chunk_id_equals_request_id_header_and_model_is_product(env: Env) -> None:
    res = collect_sse(env, {"model": "p", "seed": 5, "stream_options": {"include_usage": True}})
    rid = res.headers["x-request-id"]
    chunks = res.chunks
    assert len(chunks) >= 3
    for c in chunks:
        assert c["id"] == rid, c
        assert c["model"] == "p", c
        assert c["object"] == "chat.completion.chunk"
    assert res.frames[-1].is_done
    # the engine's internal names never reach the client
    assert INTERNAL_MODEL.encode() not in res.raw
    assert UPSTREAM_MODEL.encode() not in res.raw


def test_request_ids_differ_between_requests(env: Env) -> None:
    ids = {collect_sse(env, {"model": "p", "seed": 1}).headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3


def test_non_streamed_id_equals_header_and_model_is_product(env: Env) -> None:
    raw = env.client().chat.completions.with_raw_response.create(model="p", messages=USER, seed=2)
    whole = raw.parse()
    assert whole.id == raw.headers["x-request-id"]
    assert whole.model == "p"
    assert INTERNAL_MODEL not in raw.text and UPSTREAM_MODEL not in raw.text


def test_sdk_stream_chunks_carry_product_model(env: Env) -> None:
    client = env.client()
    ids = set()
    models = set()
    for chunk in client.chat.completions.create(model="p", messages=USER, seed=9, stream=True):
        ids.add(chunk.id)
        models.add(chunk.model)
    assert len(ids) == 1
    assert models == {"p"}


# -- 4. the usage chunk ------------------------------------------------------------------------


def test_no_usage_chunk_unless_asked(env: Env) -> None:
    res = collect_sse(env, {"model": "p", "seed": 4})
    assert res.status == 200
    assert [c for c in res.chunks if c.get("choices") == []] == []
    assert all(c.get("usage") is None for c in res.chunks)
    assert all("receipt" not in c for c in res.chunks)
    assert res.frames[-1].is_done


def test_usage_chunk_when_asked_matches_non_streamed_usage(env: Env) -> None:
    whole = env.client().chat.completions.create(model="p", messages=USER, seed=4)
    assert whole.usage is not None
    res = collect_sse(env, {"model": "p", "seed": 4, "stream_options": {"include_usage": True}})
    usage_chunks = [c for c in res.chunks if c.get("choices") == []]
    assert len(usage_chunks) == 1, "exactly one usage chunk: the engine's own is consumed"
    u = usage_chunks[0]
    # the usage chunk is the last data frame before [DONE]
    assert res.kinds()[-2:] == ["usage", "DONE"]
    assert u["usage"]["prompt_tokens"] == whole.usage.prompt_tokens
    assert u["usage"]["completion_tokens"] == whole.usage.completion_tokens
    assert u["usage"]["total_tokens"] == whole.usage.total_tokens
    assert u["usage"]["completion_tokens"] == len(res.content_chunks)
    receipt = u["receipt"]
    assert receipt["outcome"] == "completed"
    assert isinstance(receipt["latency_ms"], int | float) and receipt["latency_ms"] >= 0
    assert isinstance(receipt["ttft_ms"], int | float) and 0 <= receipt["ttft_ms"] <= receipt["latency_ms"]
    # content chunks carry no usage
    assert all(c.get("usage") is None for c in res.content_chunks)


def test_usage_chunk_with_sdk_include_usage(env: Env) -> None:
    client = env.client()
    chunks = list(
        client.chat.completions.create(
            model="p", messages=USER, seed=8, stream=True, stream_options={"include_usage": True}
        )
    )
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1
    assert with_usage[0] is chunks[-1]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == sum(
        1 for c in chunks if c.choices and c.choices[0].delta.content
    )


def test_include_usage_false_gives_no_usage_chunk(env: Env) -> None:
    res = collect_sse(env, {"model": "p", "seed": 4, "stream_options": {"include_usage": False}})
    assert [c for c in res.chunks if c.get("choices") == []] == []


def test_usage_chunk_always_policy_sends_it_unasked(env: Env) -> None:
    whole = env.client().chat.completions.create(model="always", messages=USER, seed=6)
    assert whole.usage is not None
    res = collect_sse(env, {"model": "always", "seed": 6})
    usage_chunks = [c for c in res.chunks if c.get("choices") == []]
    assert len(usage_chunks) == 1
    u = usage_chunks[0]
    assert u["usage"]["completion_tokens"] == whole.usage.completion_tokens
    assert u["usage"]["prompt_tokens"] == whole.usage.prompt_tokens
    assert u["receipt"]["outcome"] == "completed"
    assert u["id"] == res.headers["x-request-id"] and u["model"] == "always"
    assert res.kinds()[-2:] == ["usage", "DONE"]


def test_legacy_completion_usage_chunk(env: Env) -> None:
    whole = env.client().completions.create(model="p", prompt="Hi", seed=2)
    res = collect_sse(
        env,
        {"model": "p", "prompt": "Hi", "seed": 2, "stream_options": {"include_usage": True}},
        path="/v1/completions",
    )
    usage_chunks = [c for c in res.chunks if c.get("choices") == []]
    assert len(usage_chunks) == 1
    assert whole.usage is not None
    assert usage_chunks[0]["usage"]["completion_tokens"] == whole.usage.completion_tokens
    assert usage_chunks[0]["object"] == "text_completion"


# -- 6. keep-alive on stall -----------------------------------------------------------------------


def test_stall_yields_keep_alives_between_chunks(env: Env) -> None:
    body = {"model": "p", "seed": 3, "sim": {"stall_after_tokens": 3, "stall_s": 1.2, "output_tokens": 8}}
    res = collect_sse(env, body)
    assert res.status == 200
    kinds = res.kinds()
    first_data = kinds.index("data")
    # three chunks, then keep-alives while the engine is silent, then the rest
    after = kinds[first_data:]
    assert after[:3] == ["data", "data", "data"], kinds
    gap = []
    for k in after[3:]:
        if k == "data":
            break
        gap.append(k)
    assert len(gap) >= 2, kinds
    assert set(gap) == {"c:keep-alive"}, kinds
    assert after.count("data") == 8
    assert kinds[-1] == "DONE"
    # no keep-alive before output began
    assert "c:keep-alive" not in kinds[:first_data]
    # keep-alives are spread over the stall, not sent in one burst
    ka = [f.t for f in res.frames if f.comment == "keep-alive"]
    assert ka[-1] - ka[0] >= 0.3


# -- 9. no buffering -------------------------------------------------------------------------------


def test_first_chunk_arrives_while_engine_still_generating(env: Env) -> None:
    body = {"model": "p", "seed": 1, "sim": {"tokens_per_s": 10, "output_tokens": 20}}
    res = collect_sse(env, body)
    content = [f for f in res.data_frames if not f.is_done and f.json.get("choices")]
    assert len(content) == 20
    first, last = content[0].t, content[-1].t
    assert first < 1.0, f"first chunk at {first:.3f}s"
    assert last >= 1.8, f"last chunk at {last:.3f}s"
    # chunks arrive spread out, one at a time, not in a burst at the end
    halfway = content[10].t
    assert halfway < last - 0.5, (halfway, last)


def test_sdk_yields_first_chunk_before_generation_ends(env: Env) -> None:
    import time

    client = env.client()
    t0 = time.monotonic()
    stream = client.chat.completions.create(
        model="p",
        messages=USER,
        seed=1,
        stream=True,
        extra_body={"sim": {"tokens_per_s": 10, "output_tokens": 12}},
    )
    first_at = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first_at is None:
            first_at = time.monotonic() - t0
    total = time.monotonic() - t0
    assert first_at is not None and first_at < 0.6, first_at
    assert total >= 1.0, total
