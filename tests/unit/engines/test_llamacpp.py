"""The llamacpp engine's own logic with a scripted stand-in for the model: the worker's
messages, stop strings, limits, token counts, chunk shapes, failures and the slot's
release on cancel; the chat formats (the base model's few-shot frame, llama-cpp-python's
templates); llama.cpp's log lines and their levels. The real model is driven in
tests/e2e/local."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import pytest

from bourse.engines.llamacpp import LlamaCppEngine
from bourse.engines.llamacpp_formats import BASE_SHOTS, base_prompt, chat_format
from bourse.engines.llamacpp_native import _LlamaLog
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


async def _started(
    monkeypatch: pytest.MonkeyPatch, n_ctx: int = 64, chat_format: str = "gemma"
) -> tuple[LlamaCppEngine, FakeLlama]:
    fake = FakeLlama()
    engine = LlamaCppEngine("model.gguf", n_ctx=n_ctx, name="tiny", chat_format=chat_format)
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


# -- the base model's chat format -------------------------------------------------------

SHOTS = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in BASE_SHOTS)


def test_the_base_format_asks_the_question_after_worked_examples_and_the_system_text() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France? "}]},
    ]
    assert base_prompt(messages) == SHOTS + "Answer briefly.\n\nQ: What is the capital of France?\nA:"


def test_the_base_format_carries_the_conversation_as_questions_and_answers() -> None:
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Another?"},
    ]
    assert base_prompt(messages) == SHOTS + "Q: Name a colour.\nA: Red.\n\nBe brief.\n\nQ: Another?\nA:"
    # a conversation that ends with an answer asks for another answer
    assert base_prompt(messages[:2]).endswith("Q: Name a colour.\nA: Red.\n\nA:")


def test_a_llama_cpp_chat_format_by_name_and_an_unknown_name_refused() -> None:
    gemma = chat_format("gemma")
    assert gemma.render([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]) == (
        "<start_of_turn>user\nS\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    )
    assert (
        chat_format("llama-3").render([{"role": "user", "content": "hi"}]).startswith("<|start_header_id|>")
    )
    assert "<|im_start|>user\nhi<|im_end|>" in chat_format("chatml").render(
        [{"role": "user", "content": "hi"}]
    )
    with pytest.raises(ValueError, match=r"unknown chat_format 'gema' \(known: base, .*chatml.*gemma"):
        chat_format("gema")


async def test_an_unknown_chat_format_leaves_the_engine_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, _ = await _started(monkeypatch, chat_format="gema")
    try:
        assert not engine.loaded
        assert engine.broken is not None and "unknown chat_format 'gema'" in engine.broken
    finally:
        await engine.aclose()


@pytest.fixture
async def base_engine(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[LlamaCppEngine, FakeLlama]]:
    engine, fake = await _started(monkeypatch, n_ctx=512, chat_format="base")
    try:
        yield engine, fake
    finally:
        await engine.aclose()


def _chat(question: str, **body: Any) -> GenerationRequest:
    return _request({"messages": [{"role": "user", "content": question}], **body}, kind="chat")


def _content(chunks: list[ChunkEvent]) -> str:
    return "".join(c.chunk["choices"][0]["delta"].get("content", "") for c in chunks)


@pytest.mark.parametrize(
    ("script", "tokens"),
    [
        ([b" Paris", b".", b"\n", b"\n", b"Q: more"], 4),
        ([b" Paris", b".", b"\nQ", b":", b" more"], 4),
        ([b" Paris", b".\n\nA", b" rambling"], 2),
    ],
    ids=["blank-line", "next-question", "blank-line-inside-a-token"],
)
async def test_a_base_answer_ends_at_the_next_question_or_a_blank_line(
    base_engine: tuple[LlamaCppEngine, FakeLlama], script: list[bytes], tokens: int
) -> None:
    engine, fake = base_engine
    fake.script = [*script, b"never", EOS]
    chunks, usages = await _run(engine, _chat("What is the capital of France?"))
    assert _content(chunks) == "Paris."  # the space after "A:" is not part of the answer
    assert chunks[0].chunk["choices"][0]["delta"] == {"role": "assistant", "content": "Paris"}
    assert chunks[-1].chunk["choices"][0]["finish_reason"] == "stop"
    assert usages[0].completion_tokens == tokens  # up to the token that completed the stop string
    request = _chat("What is the capital of France?")
    assert usages[0].prompt_tokens == await engine.count_prompt_tokens("chat", request.body)
    assert usages[0].prompt_tokens == len(base_prompt(request.body["messages"]).split()) + 1  # + BOS


async def test_a_base_answer_that_opens_with_whitespace_is_shown_from_its_first_word(
    base_engine: tuple[LlamaCppEngine, FakeLlama],
) -> None:
    engine, fake = base_engine
    fake.script = [b" ", b" \t", b" Blue", b" sky", EOS]
    chunks, usages = await _run(engine, _chat("What colour is the sky?"))
    assert _content(chunks) == "Blue sky"
    assert [c.tokens for c in chunks] == [3, 1]  # the whitespace tokens ride on the first word
    assert usages[0].completion_tokens == 4


async def test_the_base_frame_stops_apply_to_chat_only_and_beside_the_request_s_own(
    base_engine: tuple[LlamaCppEngine, FakeLlama],
) -> None:
    engine, fake = base_engine
    fake.script = [b" a", b"\n\n", b"b", EOS]
    text, _ = await _run(engine, _request({"prompt": "x"}))
    assert "".join(_texts(text)) == " a\n\nb"  # a plain completion is left as the model wrote it
    fake.script = [b" one", b" two", b" three", EOS]
    chunks, _ = await _run(engine, _chat("Count.", stop=" three"))
    assert _content(chunks) == "one two"


# -- llama.cpp's log lines ----------------------------------------------------------------


def test_llama_cpp_log_lines_are_debug_except_errors_and_are_logged_whole(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lines = _LlamaLog()
    with caplog.at_level(logging.DEBUG, logger="bourse.llamacpp"):
        lines(2, "llama_model_loader: - kv   0: general.architecture str = gemma3\n")  # INFO
        lines(3, "load: control-looking token: 212 '</s>' was not control-type\n")  # WARN
        lines(1, "init_tokenizer: initializing tokenizer for type 1\n")  # DEBUG
        lines(2, "load_tensors: loading")
        for piece in (".", ".", " done\n"):
            lines(5, piece)  # CONT: the rest of the line before
        lines(4, "llama_model_load: error loading model: bad magic\n")  # ERROR
        lines(5, "second line of the error\n")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "llama_model_loader: - kv   0: general.architecture str = gemma3"),
        (logging.DEBUG, "load: control-looking token: 212 '</s>' was not control-type"),
        (logging.DEBUG, "init_tokenizer: initializing tokenizer for type 1"),
        (logging.DEBUG, "load_tensors: loading.. done"),
        (logging.WARNING, "llama_model_load: error loading model: bad magic"),
        (logging.WARNING, "second line of the error"),
    ]
