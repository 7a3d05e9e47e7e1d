"""The llamacpp engine's own logic with a scripted stand-in for the model: the worker's
messages, stop strings, limits, token counts, chunk shapes, failures and the slot's
release on cancel. The real model is driven in tests/e2e/local."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import pytest

from bourse.engines.llamacpp import LlamaCppEngine
from bourse.ports.engine import (
    ChunkEvent,
    Engine,
    EngineFailure,
    GenerationRequest,
    Kind,
    TokenCounter,
    UsageEvent,
)

pytestmark = pytest.mark.anyio

EOS = 1
END_OF_TURN = 2
SPECIAL = {b"<end_of_turn>": END_OF_TURN}


class FakeLlama:
    """Stands in for ``llama_cpp.Llama``: ``generate`` plays ``script`` (byte pieces, one
    token each; ``EOS`` ends the answer); a prompt is one token per word, after BOS."""

    def __init__(self) -> None:
        self.script: Iterable[bytes | int] = []
        self.pieces: dict[int, bytes] = {}
        self.seeds: list[int] = []
        self.closed = threading.Event()

    def token_eos(self) -> int:
        return EOS

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        if special and text in SPECIAL:
            return [SPECIAL[text]]
        return [0] * add_bos + [3] * len(text.split())

    def detokenize(self, tokens: list[int]) -> bytes:
        return b"".join(self.pieces[t] for t in tokens)

    def set_seed(self, seed: int) -> None:
        self.seeds.append(seed)

    def generate(self, prompt: list[int], **sampling: Any) -> Iterator[int]:
        try:
            for i, piece in enumerate(self.script):
                if isinstance(piece, int):
                    yield piece
                    continue
                token = 100 + i
                self.pieces[token] = piece
                yield token
        finally:
            self.closed.set()


async def _started(monkeypatch: pytest.MonkeyPatch, n_ctx: int = 64) -> tuple[LlamaCppEngine, FakeLlama]:
    fake = FakeLlama()
    engine = LlamaCppEngine("model.gguf", n_ctx=n_ctx, name="tiny")
    monkeypatch.setattr(engine, "_load", lambda path, vocab_only: fake)
    await engine.start()
    return engine, fake


@pytest.fixture
async def llm_engine(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[LlamaCppEngine, FakeLlama]]:
    engine, fake = await _started(monkeypatch)
    try:
        yield engine, fake
    finally:
        await engine.aclose()


def _request(body: dict[str, Any], kind: Kind = "completion") -> GenerationRequest:
    return GenerationRequest("req-1", kind, {"model": "tiny", **body})


async def _run(engine: Engine, request: GenerationRequest) -> tuple[list[ChunkEvent], list[UsageEvent]]:
    chunks: list[ChunkEvent] = []
    usages: list[UsageEvent] = []
    async for event in engine.generate(request):
        if isinstance(event, ChunkEvent):
            chunks.append(event)
        else:
            usages.append(event)
    return chunks, usages


def _texts(chunks: list[ChunkEvent]) -> list[str]:
    return [c.chunk["choices"][0]["text"] for c in chunks]


def _finish(chunks: list[ChunkEvent]) -> list[str | None]:
    return [c.chunk["choices"][0]["finish_reason"] for c in chunks]


async def test_a_completion_streams_one_chunk_per_token_and_counts_usage(
    llm_engine: tuple[LlamaCppEngine, FakeLlama],
) -> None:
    engine, fake = llm_engine
    fake.script = [b"Hel", b"lo", b" there", EOS]
    chunks, usages = await _run(engine, _request({"prompt": "say hello now", "seed": 7}))
    assert _texts(chunks) == ["Hel", "lo", " there"]
    assert _finish(chunks) == [None, None, "stop"]
    assert [c.tokens for c in chunks] == [1, 1, 1]
    assert chunks[0].chunk["object"] == "text_completion" and chunks[0].chunk["model"] == "tiny"
    assert usages == [UsageEvent(4, 3)]  # BOS + three words; the stop token is not counted
    assert fake.seeds == [7]


async def test_a_chat_answer_says_its_role_first_and_its_finish_on_the_last_chunk(
    llm_engine: tuple[LlamaCppEngine, FakeLlama],
) -> None:
    engine, fake = llm_engine
    fake.script = [b"Hi", b"!", END_OF_TURN]
    request = _request({"messages": [{"role": "user", "content": "hello"}]}, kind="chat")
    chunks, usages = await _run(engine, request)
    assert [c.chunk["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": "Hi"},
        {"content": "!"},
    ]
    assert _finish(chunks) == [None, "stop"]
    assert chunks[0].chunk["object"] == "chat.completion.chunk"
    assert usages[0].completion_tokens == 2
    assert usages[0].prompt_tokens == await engine.count_prompt_tokens("chat", request.body)


async def test_max_tokens_cuts_with_length(llm_engine: tuple[LlamaCppEngine, FakeLlama]) -> None:
    engine, fake = llm_engine
    fake.script = [b"a", b"b", b"c", b"d", EOS]
    chunks, usages = await _run(engine, _request({"prompt": "x", "max_tokens": 2}))
    assert _texts(chunks) == ["a", "b"]
    assert _finish(chunks) == [None, "length"]
    assert usages == [UsageEvent(2, 2)]


async def test_a_stop_string_across_tokens_is_cut_and_never_shown(
    llm_engine: tuple[LlamaCppEngine, FakeLlama],
) -> None:
    engine, fake = llm_engine
    fake.script = [b"Hel", b"lo E", b"N", b"D more", b"never", EOS]
    chunks, usages = await _run(engine, _request({"prompt": "x", "stop": ["END", "zz"]}))
    assert "".join(_texts(chunks)) == "Hello "
    assert _finish(chunks)[-1] == "stop"
    assert usages[0].completion_tokens == 4  # the token that held the stop string counts
    assert fake.closed.wait(5)


@pytest.mark.parametrize("stop", ["", [""], None, []])
async def test_an_empty_stop_string_stops_nothing(
    llm_engine: tuple[LlamaCppEngine, FakeLlama], stop: str | list[str] | None
) -> None:
    engine, fake = llm_engine
    fake.script = [b"a", b"b", EOS]
    chunks, _ = await _run(engine, _request({"prompt": "x", "stop": stop}))
    assert _texts(chunks) == ["a", "b"]


@pytest.mark.parametrize(
    ("end", "limit", "finish"), [(EOS, 9, "stop"), (b"cut", 2, "length")], ids=["end-of-text", "length"]
)
async def test_text_held_for_a_stop_string_that_never_came_is_delivered(
    llm_engine: tuple[LlamaCppEngine, FakeLlama], end: bytes | int, limit: int, finish: str
) -> None:
    engine, fake = llm_engine
    fake.script = [b"ab", b"EN", end]
    chunks, usages = await _run(engine, _request({"prompt": "x", "stop": "END", "max_tokens": limit}))
    assert "".join(_texts(chunks)) == "abEN"
    assert _finish(chunks)[-1] == finish
    assert sum(c.tokens for c in chunks) == usages[0].completion_tokens == 2


async def test_a_token_without_text_yet_is_counted_with_the_next_piece(
    llm_engine: tuple[LlamaCppEngine, FakeLlama],
) -> None:
    engine, fake = llm_engine
    fake.script = ["é".encode()[:1], "é".encode()[1:], b"!", EOS]
    chunks, usages = await _run(engine, _request({"prompt": "x"}))
    assert _texts(chunks) == ["é", "!"]
    assert [c.tokens for c in chunks] == [2, 1]
    assert usages[0].completion_tokens == 3


async def test_an_empty_answer_is_one_chunk_with_its_finish_reason(
    llm_engine: tuple[LlamaCppEngine, FakeLlama],
) -> None:
    engine, fake = llm_engine
    fake.script = [EOS]
    chat, _ = await _run(engine, _request({"messages": [{"role": "user", "content": "hi"}]}, kind="chat"))
    assert [(c.chunk["choices"][0]["delta"], c.tokens) for c in chat] == [({"role": "assistant"}, 0)]
    assert _finish(chat) == ["stop"]
    text, usages = await _run(engine, _request({"prompt": "x"}))
    assert _texts(text) == [""] and _finish(text) == ["stop"] and usages == [UsageEvent(2, 0)]


async def test_a_prompt_over_the_context_is_refused(llm_engine: tuple[LlamaCppEngine, FakeLlama]) -> None:
    engine, _ = llm_engine
    with pytest.raises(EngineFailure) as info:
        await _run(engine, _request({"prompt": "word " * 70}))
    assert (info.value.status, info.value.code, info.value.transient) == (
        400,
        "context_length_exceeded",
        False,
    )
    assert "64" in info.value.message


async def test_closing_the_stream_stops_the_worker_and_frees_the_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, fake = await _started(monkeypatch, n_ctx=10**9)  # room for an answer that never ends
    try:
        fake.script = itertools.repeat(b"a")
        stream = engine.generate(_request({"prompt": "x"}))
        assert isinstance(await anext(stream), ChunkEvent)
        await asyncio.wait_for(stream.aclose(), 5)
        assert fake.closed.is_set()  # the worker closed the model's generator
        fake.script = [b"b", EOS]
        chunks, _ = await asyncio.wait_for(_run(engine, _request({"prompt": "x"})), 5)
        assert _texts(chunks) == ["b"]  # the one slot is free again
    finally:
        await engine.aclose()


async def test_it_is_a_token_counter_once_loaded(llm_engine: tuple[LlamaCppEngine, FakeLlama]) -> None:
    engine, _ = llm_engine
    assert isinstance(engine, TokenCounter)
    assert engine.loaded and engine.broken is None and engine.context_length == 64
    assert await engine.count_prompt_tokens("completion", {"prompt": "one two three"}) == 4


async def test_a_model_that_cannot_load_leaves_the_engine_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LlamaCppEngine("missing.gguf", name="tiny")

    def refuse(path: str, vocab_only: bool) -> Any:
        raise FileNotFoundError(f"no such file: {path}")

    monkeypatch.setattr(engine, "_load", refuse)
    assert not engine.loaded and engine.broken is None
    await engine.start()
    try:
        assert not engine.loaded
        assert engine.broken == "the model of tiny could not be loaded: no such file: missing.gguf"
        assert await engine.count_prompt_tokens("completion", {"prompt": "x"}) is None
        with pytest.raises(EngineFailure) as info:
            await _run(engine, _request({"prompt": "x"}))
        assert (info.value.status, info.value.code, info.value.transient) == (503, "no_capacity", False)
    finally:
        await engine.aclose()


async def test_before_start_a_generation_is_a_transient_failure() -> None:
    engine = LlamaCppEngine("model.gguf", name="tiny")
    with pytest.raises(EngineFailure) as info:
        await _run(engine, _request({"prompt": "x"}))
    assert info.value.transient and info.value.status == 503
