"""The engine's own token counts for an ``openai`` deployment: for a stream the upstream
ends without usage, and for the context pre-check.

A :class:`TokenCounts` is handed to :class:`~bourse.engines.openai_http.OpenAIHTTPEngine`
at construction. The engine asks it only when the upstream does not count itself: at
the end of a stream that carried no usage (llama-cpp-python's server ignores
``stream_options`` and never sends any), and, when the counter knows the upstream's
context (``context_length``), for the exact prompt size before an order enters the book.

:class:`GGUFTokens` is the counter for llama-cpp-python's server (``python -m
llama_cpp.server``): the same GGUF loaded locally, vocabulary only, off the event loop
at start. It renders the prompt exactly as that server does:

- chat: the handler ``Llama.create_chat_completion`` picks (the server's
  ``--chat_format`` if it has one, else the GGUF's ``tokenizer.chat_template`` through
  ``Jinja2ChatFormatter``, else llama-cpp-python's guess or its ``llama-2`` fallback) is
  run against the local vocabulary; it tokenizes the rendered prompt (``add_bos`` unless
  the template added it, ``special=True``) and hands the tokens to ``create_completion``,
  where the count is taken;
- legacy completions: ``Llama._create_completion``'s own arithmetic for a text prompt:
  the BOS (or CLS) token when the model adds one, the prompt tokenized with
  ``add_bos=False, special=True``, and an EOS (or SEP) token when the model adds one.

Completion tokens are the stream's content-carrying chunks: that server streams one
chunk per generated token, and measured against its own non-streamed
``completion_tokens`` (Gemma 3 270M, temperature 0: cut by ``max_tokens``, multi-byte
emoji and CJK text, and an end at the end-of-sequence token) the chunk count matched
every time, as re-tokenizing the text did; the chunks cost nothing to count. One case
differs: an answer cut at a client's ``stop`` string is counted by the server with the
token(s) that completed the stop string, which it never streams, so the count here is
short by those (one token in the cases measured).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from bourse.ports.engine import Kind

__all__ = ["GGUFTokens", "TokenCounts"]

log = logging.getLogger("bourse.engines")


class TokenCounts(Protocol):
    """What an ``openai`` engine asks of its counter."""

    @property
    def context_length(self) -> int | None:
        """The upstream's context in tokens (its ``n_ctx``), or None when not known."""
        ...

    @property
    def ready(self) -> bool:
        """True once :meth:`start` has loaded what counting needs."""
        ...

    async def start(self) -> None:
        """Load the tokenizer (off the event loop). A failure is logged, not raised: the
        counter stays not ready and the engine falls back on the gateway's estimate."""
        ...

    async def prompt_tokens(self, kind: Kind, body: dict[str, Any]) -> int | None:
        """The prompt's tokens as the upstream counts them; None if it cannot tell."""
        ...

    def completion_tokens(self, chunks: int) -> int:
        """The completion tokens of a stream that carried ``chunks`` token-carrying chunks."""
        ...

    async def aclose(self) -> None: ...


class _Captured(Exception):
    """Raised by :class:`_PromptCapture` with the tokens a chat handler would generate from."""

    def __init__(self, prompt: Any) -> None:
        super().__init__("captured")
        self.prompt = prompt


class _PromptCapture:
    """A stand-in for ``Llama`` handed to llama-cpp-python's chat handler: everything is
    the vocabulary-only model's, except ``create_completion``, which is where the
    handler hands over the prompt it rendered and tokenized."""

    verbose = False
    """Quiet for what the handler builds from it (a tool's grammar would print to stderr)."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def create_completion(self, prompt: Any, **_: Any) -> Any:
        raise _Captured(prompt)


_CHAT_ARGS = ("functions", "function_call", "tools", "tool_choice")
"""The request fields that a chat handler renders into the prompt, besides ``messages``."""


def _load_vocab(path: str, chat_format: str | None) -> Any:
    from bourse.engines.llamacpp_native import load_vocab

    return load_vocab(path, chat_format)


class GGUFTokens:
    """llama-cpp-python's server's own counts, from its GGUF loaded here vocabulary-only.

    ``chat_format``: the server's ``--chat_format`` if it was started with one (None:
    the server's default, as here). ``n_ctx``: the server's ``--n_ctx`` (its default is
    2048), for the context pre-check; None: not known, no pre-check by tokens.
    """

    def __init__(
        self,
        path: str,
        *,
        n_ctx: int | None = None,
        chat_format: str | None = None,
        name: str = "openai",
        load: Callable[[str, str | None], Any] = _load_vocab,
    ) -> None:
        self.path = path
        self.name = name
        self._n_ctx = n_ctx
        self._chat_format = chat_format
        self._load = load
        self._llm: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._failed = False
        """A prompt could not be counted once (said at WARNING; later ones at DEBUG)."""

    @property
    def context_length(self) -> int | None:
        return self._n_ctx

    @property
    def ready(self) -> bool:
        return self._llm is not None

    async def start(self) -> None:
        # one thread: the vocabulary is used by one count at a time, off the event loop
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bourse-tokens")
        loop = asyncio.get_running_loop()
        try:
            self._llm = await loop.run_in_executor(self._pool, self._load, self.path, self._chat_format)
        except Exception as exc:  # missing file, not a GGUF, llama-cpp-python not installed
            log.warning(
                "%s: cannot load the tokenizer %s (%s); streams without usage are charged the "
                "gateway's estimate (usage_estimated)",
                self.name, self.path, exc,
            )  # fmt: skip
            return
        log.info("%s: counting tokens with %s (n_ctx %s)", self.name, self.path, self._n_ctx or "not set")

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def prompt_tokens(self, kind: Kind, body: dict[str, Any]) -> int | None:
        if self._llm is None or self._pool is None:
            return None
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, self.count_prompt, kind, body)
        except Exception as exc:  # a template that refuses these messages, a malformed body
            # at WARNING the first time, then at DEBUG: a client's odd prompts must not flood the log
            level = logging.DEBUG if self._failed else logging.WARNING
            self._failed = True
            log.log(level, "%s: cannot count a prompt's tokens (%s: %s); that request is charged the "
                    "gateway's estimate", self.name, type(exc).__name__, exc)  # fmt: skip
            return None

    def completion_tokens(self, chunks: int) -> int:
        return chunks

    def count_prompt(self, kind: Kind, body: dict[str, Any]) -> int:
        """The prompt's tokens as the server counts them (see the module's docstring)."""
        llm = self._llm
        if kind == "chat":
            return self._chat_prompt(llm, body)
        prompt = body.get("prompt")
        if isinstance(prompt, list):  # the server takes a list of at most one string
            prompt = prompt[0] if prompt else ""
        return _text_prompt(llm, prompt if isinstance(prompt, str) else "")

    @staticmethod
    def _chat_prompt(llm: Any, body: dict[str, Any]) -> int:
        from llama_cpp import llama_chat_format

        # the handler Llama.create_chat_completion picks
        handler = (
            llm.chat_handler
            or llm._chat_handlers.get(llm.chat_format)
            or llama_chat_format.get_chat_completion_handler(llm.chat_format)
        )
        args = {k: body[k] for k in _CHAT_ARGS if body.get(k) is not None}
        try:
            capture: Any = _PromptCapture(llm)
            handler(llama=capture, messages=list(body.get("messages") or []), **args)
        except _Captured as captured:
            prompt = captured.prompt
            if isinstance(prompt, str):  # a handler that hands on text: counted as the server would
                return _text_prompt(llm, prompt)
            return len(prompt)
        raise RuntimeError("the chat handler did not ask for a completion")


def _text_prompt(llm: Any, prompt: str) -> int:
    """``Llama._create_completion``'s prompt tokens for a text prompt (no suffix)."""
    model = llm._model
    cls = model.token_cls()
    bos = cls if cls != -1 else llm.token_bos()
    n = 1 if model.add_bos_token() and bos != -1 else 0
    if prompt:
        n += len(llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True))
    if model.add_eos_token() or model.token_sep() != -1:
        n += 1
    return n
