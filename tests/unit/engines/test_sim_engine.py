"""The sim engine: shapes, determinism, lengths, every setting, cancellation counts."""

from __future__ import annotations

import itertools
import time
from typing import Any

import anyio
import anyio.lowlevel
import orjson
import pytest

from bourse.engines.sim import REASONING_TOKENS, SimEngine, SimSettings
from bourse.engines.simtext import count_prompt_tokens, natural_length, sim_tokens
from bourse.ports.engine import ChunkEvent, Engine, EngineFailure, GenerationRequest, Kind, UsageEvent

pytestmark = pytest.mark.anyio

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "tell me a story"}], "seed": 11}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _request(body: dict[str, Any], kind: Kind = "chat", attempt: int = 0) -> GenerationRequest:
    return GenerationRequest(request_id="req-1", kind=kind, body=body, attempt=attempt)


async def _run(
    engine: SimEngine, body: dict[str, Any], kind: Kind = "chat", attempt: int = 0
) -> tuple[list[ChunkEvent], list[UsageEvent]]:
    chunks: list[ChunkEvent] = []
    usages: list[UsageEvent] = []
    async for event in engine.generate(_request(body, kind, attempt)):
        if isinstance(event, ChunkEvent):
            chunks.append(event)
        else:
            usages.append(event)
    return chunks, usages


def _deltas(chunks: list[ChunkEvent]) -> list[dict[str, Any]]:
    return [c.chunk["choices"][0]["delta"] for c in chunks]


def _content(chunks: list[ChunkEvent]) -> str:
    return "".join(d.get("content", "") for d in _deltas(chunks))


def _finishes(chunks: list[ChunkEvent]) -> list[str | None]:
    return [c.chunk["choices"][0]["finish_reason"] for c in chunks]


def test_sim_engine_satisfies_the_port() -> None:
    engine: Engine = SimEngine(SimSettings())
    assert engine is not None


async def test_chat_chunks_have_the_openai_shape() -> None:
    engine = SimEngine(SimSettings(), model_name="sim-x")
    chunks, usages = await _run(engine, CHAT)
    n = natural_length(11)
    assert len(chunks) == n
    first = chunks[0].chunk
    assert set(first) == {"id", "object", "created", "model", "choices"}
    assert first["id"] == "req-1"
    assert first["object"] == "chat.completion.chunk"
    assert first["model"] == "sim-x"
    assert isinstance(first["created"], int)
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": sim_tokens(11, 1)[0]},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert all("role" not in d for d in _deltas(chunks)[1:])
    assert all(c.tokens == 1 for c in chunks)
    assert _finishes(chunks) == [None] * (n - 1) + ["stop"]
    assert _content(chunks) == "".join(sim_tokens(11, n))
    assert usages == [UsageEvent(prompt_tokens=count_prompt_tokens("chat", CHAT), completion_tokens=n)]
    assert engine.stats == {"started": 1, "completed": 1, "cancelled": 0, "running": 0, "peak_running": 1}


async def test_same_seed_same_text_and_other_seed_other_text() -> None:
    engine = SimEngine(SimSettings())
    a, _ = await _run(engine, CHAT)
    b, _ = await _run(engine, dict(CHAT))
    c, _ = await _run(engine, {**CHAT, "seed": 12})
    assert _content(a) == _content(b)
    assert _content(a) != _content(c)


async def test_without_a_seed_the_prompt_decides() -> None:
    engine = SimEngine(SimSettings())
    body = {"messages": [{"role": "user", "content": "hi"}]}
    a, _ = await _run(engine, body)
    b, _ = await _run(engine, {"messages": [{"role": "user", "content": "hi"}]})
    assert _content(a) == _content(b)


async def test_output_tokens_forces_the_length() -> None:
    chunks, usages = await _run(SimEngine(SimSettings(output_tokens=100)), CHAT)
    assert len(chunks) == 100
    assert _finishes(chunks)[-1] == "stop"
    assert usages[0].completion_tokens == 100


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_body_max_tokens_cuts_with_length(field: str) -> None:
    chunks, usages = await _run(SimEngine(SimSettings()), {**CHAT, field: 3})
    assert len(chunks) == 3
    assert _finishes(chunks) == [None, None, "length"]
    assert usages[0].completion_tokens == 3
    assert _content(chunks) == "".join(sim_tokens(11, 3))


async def test_a_larger_max_tokens_changes_nothing() -> None:
    chunks, _ = await _run(SimEngine(SimSettings()), {**CHAT, "max_tokens": 1000})
    assert len(chunks) == natural_length(11)
    assert _finishes(chunks)[-1] == "stop"


async def test_engine_output_limit_cuts_with_length() -> None:
    chunks, _ = await _run(SimEngine(SimSettings(max_output_tokens=5, output_tokens=50)), CHAT)
    assert len(chunks) == 5
    assert _finishes(chunks)[-1] == "length"


async def test_fail_before_output_counts_attempts() -> None:
    engine = SimEngine(SimSettings(fail_before_output=2))
    for attempt in (0, 1):
        with pytest.raises(EngineFailure) as info:
            await _run(engine, CHAT, attempt=attempt)
        assert info.value.transient
        assert info.value.status == 502
        assert info.value.message == "simulated failure before output"
    chunks, _ = await _run(engine, CHAT, attempt=2)
    assert chunks
    assert engine.stats == {"started": 3, "completed": 1, "cancelled": 0, "running": 0, "peak_running": 1}


async def test_fail_before_output_minus_one_always_fails() -> None:
    engine = SimEngine(SimSettings(fail_before_output=-1))
    for attempt in (0, 5, 100):
        with pytest.raises(EngineFailure):
            await _run(engine, CHAT, attempt=attempt)


async def test_fail_before_output_waits_for_ttft() -> None:
    engine = SimEngine(SimSettings(fail_before_output=1, ttft_ms=100))
    started = time.monotonic()
    with pytest.raises(EngineFailure):
        await _run(engine, CHAT)
    assert time.monotonic() - started >= 0.09


async def test_fail_after_tokens_is_final() -> None:
    engine = SimEngine(SimSettings(fail_after_tokens=3))
    received: list[ChunkEvent] = []
    with pytest.raises(EngineFailure) as info:
        async for event in engine.generate(_request(CHAT)):
            assert isinstance(event, ChunkEvent)
            received.append(event)
    assert len(received) == 3
    assert not info.value.transient
    assert info.value.message == "simulated failure after 3 tokens"
    assert engine.stats == {"started": 1, "completed": 0, "cancelled": 0, "running": 0, "peak_running": 1}


async def test_ttft_and_pace() -> None:
    engine = SimEngine(SimSettings(ttft_ms=100, tokens_per_s=100, output_tokens=11))
    started = time.monotonic()
    stamps: list[float] = []
    async for _event in engine.generate(_request(CHAT)):
        stamps.append(time.monotonic() - started)
    assert stamps[0] >= 0.09
    assert stamps[10] - stamps[0] >= 0.09


async def test_stall_sleeps_once_after_n_tokens() -> None:
    engine = SimEngine(SimSettings(stall_after_tokens=2, stall_s=0.2, output_tokens=6))
    stamps: list[float] = []
    async for _ in engine.generate(_request(CHAT)):
        stamps.append(time.monotonic())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert gaps[1] >= 0.19
    assert sum(gaps) - gaps[1] < 0.1


async def test_omit_usage() -> None:
    chunks, usages = await _run(SimEngine(SimSettings(omit_usage=True)), CHAT)
    assert chunks
    assert usages == []


async def test_tool_call_fragments_reassemble() -> None:
    engine = SimEngine(SimSettings(tool_call=True))
    chunks, usages = await _run(engine, {**CHAT, "tools": TOOLS})
    deltas = _deltas(chunks)
    assert all("content" not in d for d in deltas)
    header = deltas[0]
    assert header["role"] == "assistant"
    call = header["tool_calls"][0]
    assert call["index"] == 0
    assert call["type"] == "function"
    assert call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": ""}
    fragments = [d["tool_calls"][0] for d in deltas[1:]]
    assert len(fragments) > 2
    assert all(set(f) == {"index", "function"} and f["index"] == 0 for f in fragments)
    arguments = orjson.loads("".join(f["function"]["arguments"] for f in fragments))
    assert set(arguments) == {"city", "days"}
    assert _finishes(chunks) == [None] * (len(chunks) - 1) + ["tool_calls"]
    assert usages[0].completion_tokens == len(chunks)
    again, _ = await _run(engine, {**CHAT, "tools": TOOLS})
    assert _deltas(again) == deltas


async def test_tool_call_without_tools_answers_text() -> None:
    chunks, _ = await _run(SimEngine(SimSettings(tool_call=True)), CHAT)
    assert _content(chunks)
    assert _finishes(chunks)[-1] == "stop"


async def test_reasoning_comes_first() -> None:
    chunks, usages = await _run(SimEngine(SimSettings(reasoning=True)), CHAT)
    deltas = _deltas(chunks)
    reasoning = deltas[:REASONING_TOKENS]
    assert reasoning[0]["role"] == "assistant"
    assert all(set(d) - {"role"} == {"reasoning_content"} for d in reasoning)
    assert all(set(d) == {"content"} for d in deltas[REASONING_TOKENS:])
    assert _content(chunks) == "".join(sim_tokens(11, natural_length(11)))
    assert usages[0].completion_tokens == REASONING_TOKENS + natural_length(11)


async def test_reasoning_counts_against_max_tokens() -> None:
    chunks, _ = await _run(SimEngine(SimSettings(reasoning=True)), {**CHAT, "max_tokens": 8})
    assert len(chunks) == 8
    assert _finishes(chunks)[-1] == "length"


async def test_completion_kind_shape() -> None:
    body = {"model": "sim", "prompt": "once upon a time", "seed": 11}
    chunks, usages = await _run(SimEngine(SimSettings()), body, kind="completion")
    first = chunks[0].chunk
    assert first["object"] == "text_completion"
    assert first["choices"][0].keys() == {"index", "text", "logprobs", "finish_reason"}
    text = "".join(c.chunk["choices"][0]["text"] for c in chunks)
    assert text == "".join(sim_tokens(11, natural_length(11)))
    assert _finishes(chunks)[-1] == "stop"
    assert usages[0].prompt_tokens == 5


async def test_per_request_sim_object_overrides_the_deployment() -> None:
    engine = SimEngine(SimSettings(output_tokens=4))
    chunks, _ = await _run(engine, {**CHAT, "sim": {"output_tokens": 9}})
    assert len(chunks) == 9
    assert engine.settings.output_tokens == 4


@pytest.mark.parametrize(
    ("sim", "starts"),
    [
        ({"ttft_ms": "fast"}, "sim.ttft_ms: expected a number from 0 to 30000, got 'fast'"),
        ({"bogus": 1}, "sim.bogus: expected one of the settings"),
        ({"omit_usage": 1}, "sim.omit_usage: expected true or false, got 1"),
        ({"fail_before_output": -2}, "sim.fail_before_output: expected an integer from -1 to 100, got -2"),
        ([1], "sim: expected an object, got list"),
    ],
)
async def test_invalid_sim_object_is_a_400(sim: object, starts: str) -> None:
    engine = SimEngine(SimSettings())
    with pytest.raises(EngineFailure) as info:
        await _run(engine, {**CHAT, "sim": sim})
    failure = info.value
    assert failure.message.startswith(starts)
    assert (failure.transient, failure.status, failure.code, failure.error_type) == (
        False,
        400,
        "invalid_request",
        "invalid_request_error",
    )


def test_settings_from_mapping_validates() -> None:
    settings = SimSettings.from_mapping({"ttft_ms": 5, "fail_after_tokens": None, "reasoning": True})
    assert settings == SimSettings(ttft_ms=5.0, reasoning=True)
    assert settings.merged({"ttft_ms": 1.5}) == SimSettings(ttft_ms=1.5, reasoning=True)
    with pytest.raises(ValueError, match=r"^sim\.stall_s: expected a number >= 0, got True$"):
        SimSettings.from_mapping({"stall_s": True})
    with pytest.raises(ValueError, match=r"^sim\.output_tokens: expected an integer >= 1 or null, got 0$"):
        SimSettings.from_mapping({"output_tokens": 0})
    with pytest.raises(ValueError, match=r"^sim\.tokens_per_s: expected a number >= 0, got nan$"):
        SimSettings.from_mapping({"tokens_per_s": float("nan")})


async def test_aclose_mid_stream_counts_cancelled() -> None:
    engine = SimEngine(SimSettings(output_tokens=20))
    events = engine.generate(_request(CHAT))
    for _ in range(3):
        await anext(events)
    await events.aclose()
    assert engine.stats == {"started": 1, "completed": 0, "cancelled": 1, "running": 0, "peak_running": 1}


async def test_task_cancel_while_sleeping_counts_cancelled() -> None:
    engine = SimEngine(SimSettings(output_tokens=20, tokens_per_s=2))
    received = 0

    async def consume() -> None:
        nonlocal received
        async for _ in engine.generate(_request(CHAT)):
            received += 1

    with anyio.move_on_after(0.2):
        await consume()
    assert received == 1
    assert engine.stats == {"started": 1, "completed": 0, "cancelled": 1, "running": 0, "peak_running": 1}


async def test_closing_after_the_last_chunk_is_completed() -> None:
    engine = SimEngine(SimSettings(output_tokens=3))
    events = engine.generate(_request(CHAT))
    for _ in range(3):
        await anext(events)
    await events.aclose()
    assert engine.stats == {"started": 1, "completed": 1, "cancelled": 0, "running": 0, "peak_running": 1}


async def test_many_tokens_without_delay_stay_cooperative() -> None:
    engine = SimEngine(SimSettings(output_tokens=1000, max_output_tokens=1000))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        chunks, _ = await _run(engine, CHAT)
        tg.cancel_scope.cancel()
    assert len(chunks) == 1000
    assert ticks >= 10


async def test_engine_aclose_is_a_no_op() -> None:
    engine = SimEngine(SimSettings())
    await engine.aclose()
    chunks, _ = await _run(engine, CHAT)
    assert chunks
