"""How a run's engine attempt failed, as the run tells it: the engine's own failure or
the stall the clock ended (:func:`engine_failure`), an empty stream that was a refusal
of an over-long prompt (:func:`empty_refusal`), and the error the client is given
(:func:`engine_error` by the policy, :func:`after_output` once output began).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from bourse.domain.errors import GatewayError
from bourse.domain.policy import Policy
from bourse.ports.engine import EngineEvent, EngineFailure, TokenCounter
from bourse.services.run_terms import Ask
from bourse.services.stall_clock import StallClock
from bourse.wire.prompt import PromptSize

log = logging.getLogger("bourse.completion")


async def close_quietly(it: AsyncIterator[EngineEvent]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # the engine is being cancelled; its error is moot
            pass


async def engine_failure(
    exc: EngineFailure | asyncio.CancelledError,
    clock: StallClock,
    it: AsyncIterator[EngineEvent],
    product: str,
) -> EngineFailure:
    """The engine's failure, or the stall the clock ended; any other cancellation
    goes on (the consumer's: the run is abandoned)."""
    if isinstance(exc, EngineFailure):
        return exc
    if not clock.caused():
        raise exc
    await close_quietly(it)
    assert clock.stall_s is not None
    return EngineFailure(
        f"The engine produced no token for {clock.stall_s:g} s (the stall timeout of "
        f"'{product}'); the generation was ended.",
        transient=True,  # a retry when nothing was produced yet; final after output
        kind="stall",
    )


async def empty_refusal(
    ask: Ask, prompt: PromptSize, request_id: str, deployment: str, failure: EngineFailure
) -> EngineFailure:
    """An upstream stream closed empty (no output, no ``[DONE]``): a refusal of the
    request when its prompt is over the engine's context (llama-cpp-python answers
    such a prompt so), counted by the engine's tokenizer if it has one, else by the
    gateway's estimate against the product's context length; else ``failure``
    (transient, counted once per request on the breaker)."""
    engine, context, n = ask.market.engines.get(deployment), ask.market.context_length, None
    if isinstance(engine, TokenCounter) and engine.loaded and engine.context_length > 0:
        try:  # (an engine that does not know its context says 0: the product's stands)
            n = await engine.count_prompt_tokens(ask.kind, ask.body)
        except Exception:  # the count is a best effort: the failure stays what it was
            log.warning("counting the prompt of %s on %s failed", request_id, deployment, exc_info=True)
        context = engine.context_length
    counted = "" if n is not None else "about "
    if n is None:
        n = prompt.estimated_tokens
    if n < context:
        return failure
    return EngineFailure(
        f"The prompt is {counted}{n} tokens; the engine of '{ask.market.product}' has a context of {context} "
        "tokens and closed the stream without an answer. Shorten the prompt.",
        transient=False,
        status=400,
        code="context_length_exceeded",
        error_type="invalid_request_error",
        kind="refused",
        upstream="HTTP 200, an event stream closed before any event (body b'')",
    )


def after_output(err: GatewayError, streaming: bool) -> GatewayError:
    """``err`` as the end of this run: once output began, ``x-should-retry: false``
    (sent again, the request would run, and by its policy be charged, again)."""
    if not streaming or err.headers.get("x-should-retry") == "false":
        return err
    headers = {k: v for k, v in err.headers.items() if k != "x-should-retry"}
    return GatewayError(
        err.status, err.code, err.message, param=err.param, error_type=err.error_type, headers=headers,
        retry=False,
    )  # fmt: skip


def engine_error(policy: Policy, err: GatewayError) -> GatewayError:
    """An engine failure as the client sees it: the policy may name its code and type."""
    code, error_type = policy.engine_error(err.code, err.error_type)
    if (code, error_type) == (err.code, err.error_type):
        return err
    return GatewayError(
        err.status, code, err.message, param=err.param, error_type=error_type, headers=err.headers
    )
