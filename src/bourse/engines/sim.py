"""The ``sim`` engine: a deterministic, configurable fake LLM behind the engine port.

Owns :class:`SimSettings` (the deployment's knobs, overridable per request by the
body's ``sim`` object) and :class:`SimEngine`, which streams OpenAI-shaped chunks
made from :mod:`bourse.engines.simtext`: one token per chunk, the same text for the
same seed, optional reasoning and tool calls, and scripted failures, stalls and
missing usage so that every failure path of the gateway can be driven exactly.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import replace
from typing import Any

from bourse.domain.values import immutable
from bourse.engines.simtext import (
    VOCABULARY,
    count_prompt_tokens,
    natural_length,
    reasoning_seed,
    seed_of,
    sim_tokens,
)
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
from bourse.wire.sim import parse_sim

__all__ = ["REASONING_TOKENS", "SimEngine", "SimSettings"]

REASONING_TOKENS = 6
"""How many ``reasoning_content`` tokens precede the answer when ``reasoning`` is on."""

_TOOL_SALT = 0x7001
_COOPERATE_EVERY = 64


@immutable
class SimSettings:
    """How a sim deployment behaves. Every field can be overridden per request (within
    the bounds of :data:`bourse.wire.sim.SIM_KNOBS`, where the product allows it)."""

    ttft_ms: float = 0
    """Delay before the first chunk (and before a ``fail_before_output`` failure)."""
    tokens_per_s: float = 0
    """Pace after the first chunk; 0 means no delay between chunks."""
    max_output_tokens: int = 256
    """The engine's own output limit; an answer cut by it ends with ``length``."""
    fail_before_output: int = 0
    """K: attempts numbered below K fail (transient) before any output; -1: always."""
    fail_after_tokens: int | None = None
    """Raise a final failure after this many chunks were yielded."""
    stall_after_tokens: int | None = None
    """Sleep ``stall_s`` once after this many chunks were yielded."""
    stall_s: float = 0
    omit_usage: bool = False
    """End without a :class:`UsageEvent`."""
    tool_call: bool = False
    """Answer with a call to the first of the body's ``tools`` (chat only)."""
    reasoning: bool = False
    """Emit ``reasoning_content`` tokens before the answer (chat only)."""
    output_tokens: int | None = None
    """Force the answer's natural length (content tokens) instead of the seeded one."""
    context_length: int = 8192
    """The engine's context window: a prompt of as many tokens or more (as the sim counts
    them) is refused as an OpenAI-compatible server refuses it (400,
    ``context_length_exceeded``). The gateway sets its product's ``context_length``."""

    @classmethod
    def from_mapping(cls, mapping: object) -> SimSettings:
        """A deployment's settings from its config mapping (the operator's own: not held
        to the per-request bounds); ``ValueError`` names the bad key."""
        return replace(cls(), **parse_sim(mapping, bounded=False))

    def merged(self, overrides: object) -> SimSettings:
        """These settings with a request's ``sim`` object applied, each knob held to its
        per-request bound (:mod:`bourse.wire.sim`); ``ValueError`` names the bad key."""
        return replace(self, **parse_sim(overrides, bounded=True))


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _body_limit(body: Mapping[str, Any]) -> int | None:
    """The smaller of the body's ``max_tokens`` and ``max_completion_tokens``."""
    limits = [
        v
        for v in (_int_or_none(body.get("max_tokens")), _int_or_none(body.get("max_completion_tokens")))
        if v is not None
    ]
    return min(limits) if limits else None


def _first_tool_name(body: Mapping[str, Any]) -> str | None:
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools or not isinstance(tools[0], Mapping):
        return None
    function = tools[0].get("function")
    if not isinstance(function, Mapping):
        return None
    name = function.get("name")
    return name if isinstance(name, str) and name else None


def _tool_call(seed: int, name: str) -> tuple[str, list[str]]:
    """The call id and the arguments JSON split into fragments of 3 to 6 characters."""
    rng = random.Random(seed ^ _TOOL_SALT)
    call_id = f"call_{rng.getrandbits(96):024x}"
    arguments = f'{{"city": "{rng.choice(VOCABULARY)}", "days": {rng.randint(1, 14)}}}'
    fragments: list[str] = []
    at = 0
    while at < len(arguments):
        step = rng.randint(3, 6)
        fragments.append(arguments[at : at + step])
        at += step
    return call_id, fragments


def _chat_deltas(settings: SimSettings, body: Mapping[str, Any], seed: int) -> list[dict[str, Any] | str]:
    """Every chat delta of the natural (uncut) answer, one token each; a content delta
    after the first is its text alone (``{"content": text}`` is made as it is sent: a
    dict a token held for the whole stream was ~2.4 KB an open 16-token stream, bench (e))."""
    deltas: list[dict[str, Any] | str] = []
    if settings.reasoning:
        deltas.extend({"reasoning_content": t} for t in sim_tokens(reasoning_seed(seed), REASONING_TOKENS))
    tool_name = _first_tool_name(body) if settings.tool_call else None
    if tool_name is not None:
        call_id, fragments = _tool_call(seed, tool_name)
        header = {
            "index": 0,
            "id": call_id,
            "type": "function",
            "function": {"name": tool_name, "arguments": ""},
        }
        deltas.append({"tool_calls": [header]})
        deltas.extend({"tool_calls": [{"index": 0, "function": {"arguments": f}}]} for f in fragments)
    else:
        natural = settings.output_tokens if settings.output_tokens is not None else natural_length(seed)
        # Draw at most what the engine limit lets out; the body limit cuts later.
        count = min(natural, settings.max_output_tokens - len(deltas) + 1)
        deltas.extend(sim_tokens(seed, max(count, 0)))
    first = deltas[0]
    deltas[0] = {"role": "assistant", **(first if type(first) is dict else {"content": first})}
    return deltas


def _answer(settings: SimSettings, chat: bool, body: Mapping[str, Any]) -> tuple[list[Any], str]:
    """The pieces of the answer (chat deltas or completion texts, one token each), cut
    at the engine's and the body's limits, and its finish reason."""
    seed = seed_of(body)
    pieces: list[Any]
    if chat:
        pieces = _chat_deltas(settings, body, seed)
        last = pieces[-1]
        finish_reason = "tool_calls" if type(last) is dict and "tool_calls" in last else "stop"
    else:
        natural = settings.output_tokens if settings.output_tokens is not None else natural_length(seed)
        pieces = sim_tokens(seed, min(natural, settings.max_output_tokens + 1))
        finish_reason = "stop"
    limit = settings.max_output_tokens
    body_limit = _body_limit(body)
    if body_limit is not None and body_limit < limit:
        limit = max(body_limit, 1)
    if len(pieces) > limit:
        del pieces[limit:]
        finish_reason = "length"
    return pieces, finish_reason


def _check_context(settings: SimSettings, kind: Kind, body: Mapping[str, Any]) -> None:
    """Refuse a prompt that leaves no room in the context window, in the words of an
    OpenAI-compatible server (a final failure: another attempt would meet it again)."""
    n = count_prompt_tokens(kind, body)
    if n >= settings.context_length:
        what = "messages" if kind == "chat" else "prompt"
        raise EngineFailure(
            f"This model's maximum context length is {settings.context_length} tokens. However, your "
            f"{what} resulted in {n} tokens. Please reduce the length of the {what}.",
            transient=False,
            status=400,
            code="context_length_exceeded",
            error_type="invalid_request_error",
        )


def _details(pieces: list[Any]) -> dict[str, Any]:
    """The usage details of an answer: its reasoning tokens, when it has any (as OpenAI
    reports them in ``completion_tokens_details``)."""
    reasoning = sum(1 for p in pieces if isinstance(p, dict) and "reasoning_content" in p)
    return {"completion_tokens_details": {"reasoning_tokens": reasoning}} if reasoning else {}


async def _before_output(settings: SimSettings, attempt: int) -> None:
    """The wait for the first chunk, and the scripted failure before any output."""
    if settings.ttft_ms > 0:
        await asyncio.sleep(settings.ttft_ms / 1000)
    k = settings.fail_before_output
    if k == -1 or attempt < k:
        raise EngineFailure("simulated failure before output", transient=True, status=502)


class SimEngine(Engine):
    """The simulated engine. ``stats`` counts generations started, completed (the
    last chunk was handed out) and cancelled (closed before that); failures count
    as neither completed nor cancelled. It has nothing to load: the port's defaults
    for ``start``, ``loaded``, ``broken`` and ``aclose`` apply."""

    def __init__(self, settings: SimSettings, model_name: str = "sim") -> None:
        self.settings = settings
        self.model_name = model_name
        self.stats: dict[str, int] = {
            "started": 0,
            "completed": 0,
            "cancelled": 0,
            "running": 0,
            "peak_running": 0,
        }

    def reset_stats(self) -> None:
        for key in self.stats:
            if key != "running":
                self.stats[key] = 0
        self.stats["peak_running"] = self.stats["running"]

    def _settings_for(self, body: Mapping[str, Any]) -> SimSettings:
        """The deployment's settings with the body's ``sim`` object applied."""
        overrides = body.get("sim")
        if overrides is None:
            return self.settings
        try:
            return self.settings.merged(overrides)
        except ValueError as exc:
            raise EngineFailure(
                str(exc),
                transient=False,
                status=400,
                code="invalid_request",
                error_type="invalid_request_error",
            ) from None

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[EngineEvent, None]:
        stats = self.stats
        stats["started"] += 1
        stats["running"] += 1
        if stats["running"] > stats["peak_running"]:
            stats["peak_running"] = stats["running"]
        finished = False
        try:
            body = request.body
            settings = self._settings_for(body)
            _check_context(settings, request.kind, body)
            pieces, finish_reason = _answer(settings, request.kind == "chat", body)
            await _before_output(settings, request.attempt)
            kind, request_id, model = request.kind, request.request_id, self.model_name
            chat = kind == "chat"
            created = int(time.time())
            delay = 1 / settings.tokens_per_s if settings.tokens_per_s > 0 else 0.0
            fail_at = settings.fail_after_tokens
            stall_at = settings.stall_after_tokens if settings.stall_s > 0 else None
            last = len(pieces) - 1
            for i, piece in enumerate(pieces):
                if i == fail_at:
                    raise EngineFailure(f"simulated failure after {i} tokens", transient=False, status=502)
                if i == stall_at:
                    await asyncio.sleep(settings.stall_s)
                if delay and i:
                    await asyncio.sleep(delay)
                elif not i % _COOPERATE_EVERY and i:
                    await asyncio.sleep(0)
                finished = i == last
                if chat and type(piece) is str:
                    piece = {"content": piece}
                chunk = stream_chunk(
                    kind, request_id, model, created, piece, finish_reason if finished else None
                )
                yield ChunkEvent(chunk, 1)
                del chunk, piece  # not held while waiting for the next token
            if not settings.omit_usage:
                yield UsageEvent(count_prompt_tokens(request.kind, body), len(pieces), _details(pieces))
        except (GeneratorExit, asyncio.CancelledError):
            if not finished:
                stats["cancelled"] += 1
            raise
        finally:
            stats["running"] -= 1
            if finished:
                stats["completed"] += 1
