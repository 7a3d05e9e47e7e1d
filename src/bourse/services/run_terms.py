"""A run's terms: what was asked and quoted, fixed before the run is built.

:class:`Ask` is a request checked against its product (``CompletionService.prepare``,
no I/O); :class:`Grant` what the rate limiter granted; :class:`Terms` both with the
request's identity, its measured prompt, its quote and hold: the whole of what the
run was asked to do, which nothing changes once the run exists (its engine body's
``model`` is set per attempt to the admitted deployment's model name, in place).
"""

from __future__ import annotations

from typing import Any

from bourse.domain.values import immutable
from bourse.ports.engine import Kind
from bourse.ports.limits import KeyLimits
from bourse.ports.observer import Caller
from bourse.services.billing import Quote
from bourse.services.market import Market
from bourse.wire.prompt import PromptSize


@immutable
class Ask:
    """A request checked against its product: what its run will ask the book and the engine."""

    market: Market
    kind: Kind
    body: dict[str, Any]
    """The engine's body: gateway fields removed, ``stream`` and ``include_usage`` on."""
    bid: float
    """The most it may pay a million tokens (the quote's price): its fixed bid, or a
    deadline order's ceiling."""
    timeout_s: float
    stream: bool
    include_usage: bool
    """The client gets a usage chunk (asked for, or policy ``usage_chunk = always``)."""
    max_output_tokens: int
    deadline_s: float | None = None
    """A deadline order's deadline (its ``timeout_s`` too): its bid starts low and is
    raised up to ``bid`` (:mod:`bourse.services.deadline`); None: a fixed bid."""


@immutable
class Grant:
    """What the rate limiter granted a run: given back with the tokens used when it ends."""

    key_id: str
    limits: KeyLimits
    tokens: int
    headers: dict[str, str]


@immutable
class Terms:
    """What one run was asked and quoted (a frozen record: see :mod:`bourse.domain.values`)."""

    ask: Ask
    request_id: str
    t0: float
    """The request's arrival (``time.perf_counter``)."""
    created_at: float
    """The run's creation (``time.time``): the chunks' ``created``, the usage record's time."""
    prompt: PromptSize
    quote: Quote
    account_id: str
    hold_id: str
    """The hold placed for this run (closed by its settlement)."""
    grant: Grant
    engine_stream: bool
    """False: the engine may answer at once (a relayed non-streamed request)."""
    caller: Caller | None
    """The HTTP request (None: a job's run)."""
    route: str
    """The route the client called (one of :data:`~bourse.services.billing.ROUTES`): a
    job's is its endpoint, a background response's ``/v1/responses``."""
