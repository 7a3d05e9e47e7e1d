"""The engine port: how the gateway asks a deployment for a generation.

An :class:`Engine` turns a :class:`GenerationRequest` into an async iterator of
:class:`EngineEvent` values; around that it has a small life (``start``, ``loaded``,
``broken``, ``aclose``: see :class:`Engine`). The iterator carries the generation:

- each :class:`ChunkEvent` carries one OpenAI-shaped stream chunk as a ``dict``
  (``chat.completion.chunk`` or ``text_completion``) exactly as the engine made it;
  the gateway rewrites ``id`` and ``model`` and relays it;
- a :class:`UsageEvent` carries the engine's own token counts; it is consumed by the
  gateway and never forwarded;
- failures are raised as :class:`EngineFailure`; ``transient`` failures before any
  output make the gateway requeue the order;
- cancellation: the gateway calls ``aclose()`` on the iterator (or cancels the task
  iterating it). An engine must stop generating at once when that happens: the sim
  stops between tokens, the HTTP engine closes its upstream connection.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, final, runtime_checkable

Kind = Literal["chat", "completion"]


@dataclass(slots=True)
class GenerationRequest:
    """One attempt at one generation, as handed to an engine.

    ``body`` is the client's request body (already validated) with ``model`` set to
    the deployment's internal model name, ``stream`` true and
    ``stream_options.include_usage`` true; gateway-only fields (``max_price``,
    ``timeout``, ``detached``) are removed. Fields the gateway does not own (sampling
    parameters, the ``sim`` object) are left as the client sent them.
    """

    request_id: str
    kind: Kind
    body: dict[str, Any]
    attempt: int = 0
    """0 for the first attempt of this request, 1 after the first requeue, ..."""
    stream: bool = True
    """False when the client asked for one answer, not a stream: an engine may then
    produce the whole answer at once (the ``openai`` engine asks its upstream for a
    non-streamed answer) and yield it as one chunk per choice whose ``delta`` is the
    message, then its usage. The body is the same either way."""
    traceparent: str | None = None
    """The W3C ``traceparent`` to hand on to an HTTP upstream (the client's, or this
    attempt's span when bourse traces), or None."""


@final
@dataclass(slots=True)
class ChunkEvent:
    """One OpenAI-shaped stream chunk; ``tokens`` is the engine's count of
    completion tokens it carries (1 for one token; used when usage is missing)."""

    chunk: dict[str, Any]
    tokens: int = 1
    more: bool = False
    """True when the engine already holds the next chunk and yields it without waiting
    for I/O (they arrived together): the relay may write both in one send."""


@final
@dataclass(slots=True)
class UsageEvent:
    prompt_tokens: int
    completion_tokens: int
    details: Mapping[str, Any] = field(default_factory=dict)
    """Extra usage keys from the engine, e.g. ``prompt_tokens_details``."""


EngineEvent = ChunkEvent | UsageEvent


class EngineFailure(Exception):
    """An engine could not produce (the rest of) a generation.

    ``transient`` is true for failures that another attempt may not meet: connect
    errors, upstream 5xx and 429, a first-byte timeout. ``status`` is the HTTP status
    the gateway reports when it gives up (400 for an engine's refusal such as a
    context-length error, 502 otherwise); ``code`` the OpenAI error code; ``kind`` a
    word for the operator's metrics (``connect``, ``timeout``, ``status``, ``refused``,
    ``stream``, ``empty`` (a stream closed before any output and ``[DONE]``: the run
    makes it a refusal when the prompt is over the engine's context), ``interrupted``
    (``[DONE]`` after output without a ``finish_reason``), ``malformed``, ``stall``
    (the run's stall clock), else ``other``). ``upstream``: what the engine itself
    answered, for the operator's log line (its HTTP status and a bounded body, the API
    key scrubbed), where the failure is an answer of the engine's.
    """

    def __init__(
        self,
        message: str,
        *,
        transient: bool,
        status: int = 502,
        code: str = "upstream_error",
        error_type: str = "upstream_error",
        kind: str = "other",
        upstream: str = "",
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.upstream = upstream
        self.message = message
        self.transient = transient
        self.status = status
        self.code = code
        self.error_type = error_type


class Engine(Protocol):
    """A deployment's engine. One instance per deployment.

    Its life: :meth:`start` once when the gateway starts, then any number of
    :meth:`generate` calls, concurrently, then :meth:`aclose` at shutdown. An engine
    class subclasses this port and overrides what applies to it; the defaults fit an
    engine with nothing to load (the ``sim`` and ``openai`` engines):

    ============  ================================================  ===========
    member        meaning                                           default
    ============  ================================================  ===========
    ``generate``  one generation (required)                         (none)
    ``start``     load what serving needs (a model), off the loop   nothing
    ``loaded``    true once ``start`` has finished loading          ``True``
    ``broken``    why it can never serve (its model failed to       ``None``
                  load), else ``None``; a product whose engines
                  are all broken answers 503 at once
    ``aclose``    release pooled resources at shutdown              nothing
    ``answers_    a non-streamed request's answer comes whole, its  ``False``
    whole``       wait bounded by the engine (no stall clock)
    ============  ================================================  ===========

    An engine that can also count prompt tokens exactly implements :class:`TokenCounter`.
    """

    def generate(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        """Start a generation; iterate the result; ``aclose()`` it to cancel."""
        ...

    async def start(self) -> None:
        """Load what the engine needs before it can serve; called once, in the running
        loop, before the gateway takes requests. A failure to load is not raised: the
        engine reports it through :attr:`broken` and the rest of the gateway serves on."""
        return None

    @property
    def loaded(self) -> bool:
        """True once the engine is ready to serve (its model is loaded)."""
        return True

    @property
    def broken(self) -> str | None:
        """Why this engine can never serve (e.g. its model file is missing), or None."""
        return None

    async def aclose(self) -> None:
        """Release pooled resources at shutdown."""
        return None

    @property
    def answers_whole(self) -> bool:
        """True when a request that is not streamed (``GenerationRequest.stream`` false)
        gets its whole answer in one wait that the engine bounds itself (the ``openai``
        engine's unary answers, on the chat API only): the gateway's stall clock does not
        time that wait. By
        default false: chunks come one by one and every gap is timed."""
        return False


@runtime_checkable
class TokenCounter(Protocol):
    """Optional engine capability: the exact prompt size, to refuse a prompt that
    cannot fit before it enters the book. Probed with ``isinstance`` once per engine
    (the ``llamacpp`` engine has it); the count is asked for only once :attr:`Engine.loaded`."""

    @property
    def context_length(self) -> int: ...

    async def count_prompt_tokens(self, kind: Kind, body: dict[str, Any]) -> int | None: ...


@final
@dataclass(slots=True)
class Probe:
    """What one probe of an engine's upstream found (:class:`Probed`)."""

    reason: str | None
    """Why the deployment cannot serve (one line, no address or secret), or None: it serves."""
    flavor: str
    """The kind of server it is (``vllm``, ``llama.cpp``, ``llama-cpp-python``, ``openai``)."""
    slots: int | None = None
    """The sequences the engine says it runs at once, or None where it does not say."""
    waiting: int | None = None
    """Requests the engine says it has queued itself (behind bourse's back), or None."""
    context_length: int | None = None
    """The engine's own context length, where it says it."""


@runtime_checkable
class Probed(Protocol):
    """Optional engine capability: its upstream can be checked (the ``openai`` engine).
    The gateway probes it at start and every ``probe_interval_s``; a probe never raises."""

    @property
    def flavor(self) -> str: ...

    @property
    def upstream(self) -> str:
        """The server it fronts (its root URL): deployments on one server share it."""
        ...

    async def probe(self) -> Probe: ...
