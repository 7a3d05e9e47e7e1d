"""The openai engine's own token counts (:mod:`bourse.engines.upstream_tokens`): the GGUF
counter's prompt arithmetic and chat rendering, its life (start off the loop, a load
that fails), and the engine's use of it at the end of a stream without usage."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiohttp import web
from tests.unit.engines.test_openai_http import CHAT, _answer, _chunk, _collect, _fake, _request, _sse

from bourse.engines.upstream_tokens import GGUFTokens, _PromptCapture, _text_prompt
from bourse.ports.engine import Kind, TokenCounter, UsageEvent

pytestmark = pytest.mark.anyio


class _Model:
    def __init__(self, *, add_bos: bool, add_eos: bool, cls: int = -1, sep: int = -1) -> None:
        self._bos, self._eos, self._cls, self._sep = add_bos, add_eos, cls, sep

    def add_bos_token(self) -> bool:
        return self._bos

    def add_eos_token(self) -> bool:
        return self._eos

    def token_cls(self) -> int:
        return self._cls

    def token_sep(self) -> int:
        return self._sep


class _Vocab:
    """A vocabulary of one token per byte, recording how it was asked to tokenize."""

    chat_handler: Any = None
    chat_format = "fake"
    _chat_handlers: dict[str, Any]

    def __init__(self, model: _Model, bos: int = 2) -> None:
        self._model = model
        self._bos = bos
        self.calls: list[tuple[bytes, bool, bool]] = []
        self._chat_handlers = {"fake": self._handler}

    def token_bos(self) -> int:
        return self._bos

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        self.calls.append((text, add_bos, special))
        return ([self._bos] if add_bos else []) + list(text)

    @staticmethod
    def _handler(*, llama: Any, messages: list[dict[str, Any]], **kw: Any) -> Any:
        # as llama-cpp-python's handlers do: render, tokenize, hand to create_completion
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + (
            "<tools>" if kw.get("tools") else ""
        )
        return llama.create_completion(prompt=llama.tokenize(text.encode(), add_bos=True, special=True))


def _counter(vocab: _Vocab, n_ctx: int | None = 64) -> GGUFTokens:
    return GGUFTokens("model.gguf", n_ctx=n_ctx, load=lambda path, fmt: vocab)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (_Model(add_bos=True, add_eos=False), 1 + 5),
        (_Model(add_bos=False, add_eos=False), 5),
        (_Model(add_bos=True, add_eos=True), 1 + 5 + 1),
        (_Model(add_bos=False, add_eos=False, sep=9), 5 + 1),  # a SEP token is always added
        (_Model(add_bos=True, add_eos=False, cls=7), 1 + 5),
    ],
)
def test_a_text_prompt_counts_as_the_servers_create_completion(model: _Model, expected: int) -> None:
    vocab = _Vocab(model)
    assert _text_prompt(vocab, "hello") == expected
    assert vocab.calls == [(b"hello", False, True)]  # no BOS from the tokenizer, special tokens parsed


def test_an_empty_text_prompt_is_only_its_bos() -> None:
    vocab = _Vocab(_Model(add_bos=True, add_eos=False))
    assert _text_prompt(vocab, "") == 1
    assert vocab.calls == []


def test_a_bos_of_minus_one_is_not_counted() -> None:
    assert _text_prompt(_Vocab(_Model(add_bos=True, add_eos=False), bos=-1), "abc") == 3


async def test_a_chat_prompt_is_what_the_servers_handler_hands_to_create_completion() -> None:
    vocab = _Vocab(_Model(add_bos=True, add_eos=True))
    counter = _counter(vocab)
    await counter.start()
    try:
        messages = [{"role": "user", "content": "hi"}]
        # the handler's own tokens, BOS included; a token list gets no BOS/EOS of create_completion's
        assert await counter.prompt_tokens("chat", {"messages": messages}) == 1 + len("<user>hi")
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        assert await counter.prompt_tokens("chat", {"messages": messages, "tools": tools}) == 1 + len(
            "<user>hi<tools>"
        )
    finally:
        await counter.aclose()


async def test_a_legacy_prompt_list_counts_its_one_string() -> None:
    counter = _counter(_Vocab(_Model(add_bos=True, add_eos=False)))
    await counter.start()
    try:
        assert await counter.prompt_tokens("completion", {"prompt": ["abcd"]}) == 5
        assert await counter.prompt_tokens("completion", {"prompt": []}) == 1
    finally:
        await counter.aclose()


def test_the_capture_stands_in_for_the_model() -> None:
    vocab = _Vocab(_Model(add_bos=True, add_eos=False))
    capture = _PromptCapture(vocab)
    assert capture.tokenize(b"ab", add_bos=False) == [97, 98]
    with pytest.raises(Exception, match="captured") as info:
        capture.create_completion(prompt=[1, 2, 3], temperature=0)
    assert info.value.prompt == [1, 2, 3]  # type: ignore[attr-defined]


async def test_before_start_and_after_a_failed_load_nothing_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def refuse(path: str, fmt: str | None) -> Any:
        raise FileNotFoundError(f"no such file: {path}")

    counter = GGUFTokens("/nowhere/model.gguf", n_ctx=2048, name="lcp/0", load=refuse)
    assert not counter.ready
    assert await counter.prompt_tokens("chat", {"messages": []}) is None
    with caplog.at_level(logging.WARNING, logger="bourse.engines"):
        await counter.start()
    try:
        assert not counter.ready
        assert await counter.prompt_tokens("completion", {"prompt": "x"}) is None
        assert "lcp/0: cannot load the tokenizer /nowhere/model.gguf" in caplog.text
        assert "usage_estimated" in caplog.text
    finally:
        await counter.aclose()


async def test_a_prompt_the_template_refuses_is_not_counted(caplog: pytest.LogCaptureFixture) -> None:
    vocab = _Vocab(_Model(add_bos=True, add_eos=False))

    def refuse(*, llama: Any, messages: list[dict[str, Any]], **kw: Any) -> Any:
        raise ValueError("Conversation roles must alternate user/assistant")

    vocab._chat_handlers["fake"] = refuse
    counter = _counter(vocab)
    await counter.start()
    try:
        with caplog.at_level(logging.WARNING, logger="bourse.engines"):
            for _ in range(3):
                assert (
                    await counter.prompt_tokens("chat", {"messages": [{"role": "x", "content": "y"}]}) is None
                )
        warned = [r for r in caplog.records if "roles must alternate" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING, warned  # once, not per request
    finally:
        await counter.aclose()


def test_completion_tokens_are_the_token_carrying_chunks() -> None:
    assert _counter(_Vocab(_Model(add_bos=True, add_eos=False))).completion_tokens(17) == 17


def test_the_packaged_gguf_counts_as_llama_cpp_python_itself() -> None:
    """Against the library the server runs: a chat prompt rendered and tokenized by
    ``Llama``'s own chat handler, and a text prompt tokenized as ``_create_completion``
    does (the server-side figures are in tests/engines/test_token_counts.py)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from bourse.engines.llamacpp import default_model_path
    from bourse.engines.llamacpp_native import load_vocab

    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("the packaged model (bourse[local]) is not installed")
    llm = load_vocab(path)
    counter = GGUFTokens(path)
    counter._llm = llm
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    # the packaged GGUF has no chat template: llama-cpp-python falls back on its llama-2 format
    assert llm.chat_format == "llama-2"
    formatted = llama_cpp.llama_chat_format.format_llama2(messages=messages)
    want = len(llm.tokenize(formatted.prompt.encode(), add_bos=not formatted.added_special, special=True))
    assert counter.count_prompt("chat", {"messages": messages}) == want
    text = "The capital of France is"
    assert counter.count_prompt("completion", {"prompt": text}) == 1 + len(
        llm.tokenize(text.encode(), add_bos=False, special=True)
    )


# -- the engine's use of it ------------------------------------------------------------


class _Counts:
    """A counter that says what it was asked."""

    def __init__(self, context: int | None = 100, ready: bool = True) -> None:
        self.context = context
        self.is_ready = ready
        self.asked: list[tuple[Kind, dict[str, Any]]] = []
        self.started = self.closed = False

    @property
    def context_length(self) -> int | None:
        return self.context

    @property
    def ready(self) -> bool:
        return self.is_ready

    async def start(self) -> None:
        self.started = True

    async def prompt_tokens(self, kind: Kind, body: dict[str, Any]) -> int | None:
        self.asked.append((kind, body))
        return 42

    def completion_tokens(self, chunks: int) -> int:
        return chunks * 10

    async def aclose(self) -> None:
        self.closed = True


async def test_a_stream_without_usage_is_counted_by_the_engines_counter() -> None:
    counts = _Counts()
    stream = _sse(_chunk("a"), _chunk("b"), _chunk("", "stop"))
    async with _fake(_answer(200, stream), tokens=counts) as engine:
        await engine.start()
        assert counts.started
        request = _request(CHAT)
        chunks, usages = await _collect(engine, request)
    assert counts.closed
    assert len(chunks) == 3
    assert usages == [UsageEvent(42, 20, {})]  # two token-carrying chunks
    assert counts.asked == [("chat", request.body)]


async def test_a_stream_with_usage_never_asks_the_counter_and_later_streams_are_not_counted() -> None:
    counts = _Counts()
    usage = {"id": "up-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    async with _fake(_answer(200, _sse(_chunk("a", "stop"), usage)), tokens=counts) as engine:
        assert engine._chat_parse().__class__.__name__ == "CountingParse"
        _, usages = await _collect(engine, _request(CHAT))
        assert usages == [UsageEvent(3, 1, {})]
        assert counts.asked == []
        # the upstream counts: the next streams' chunks are not counted (no cost)
        assert engine._chat_parse().__class__.__name__ == "StreamParse"


async def test_without_a_counter_a_stream_without_usage_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    async with _fake(_answer(200, _sse(_chunk("a", "stop"))), name="lcp/0") as engine:
        with caplog.at_level(logging.WARNING, logger="bourse.engines"):
            for _ in range(2):
                _, usages = await _collect(engine, _request(CHAT))
                assert usages == []
    lines = [r.getMessage() for r in caplog.records if "sent no usage" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("lcp/0:") and "tokenizer" in lines[0], lines


async def test_a_counter_not_ready_leaves_the_estimate() -> None:
    counts = _Counts(ready=False)
    async with _fake(_answer(200, _sse(_chunk("a", "stop"))), tokens=counts) as engine:
        _, usages = await _collect(engine, _request(CHAT))
    assert usages == [] and counts.asked == []


async def test_the_engine_counts_prompts_for_the_precheck_only_when_it_knows_the_context() -> None:
    async def never(request: web.BaseRequest) -> web.StreamResponse:
        raise AssertionError("the pre-check must not reach the upstream")

    body = {"messages": [{"role": "user", "content": "hi"}]}
    async with _fake(never, tokens=_Counts(context=2048)) as engine:
        assert isinstance(engine, TokenCounter)
        assert engine.context_length == 2048
        assert await engine.count_prompt_tokens("chat", body) == 42
    async with _fake(never, tokens=_Counts(context=None)) as engine:
        assert engine.context_length == 0
        assert await engine.count_prompt_tokens("chat", body) is None  # the gateway's byte bound applies
    async with _fake(never, tokens=_Counts(ready=False)) as engine:
        assert await engine.count_prompt_tokens("chat", body) is None
    async with _fake(never) as engine:
        assert await engine.count_prompt_tokens("chat", body) is None
