"""What a run's end is made of: its :class:`~bourse.services.billing.Closing` (what the
billing settles: usage, receipt, price) and its :class:`~bourse.ports.observer.RunReport`
(what the observer hears), each from the run's terms, meter and book state, read once.
"""

from __future__ import annotations

from typing import Any

from bourse.domain.book import Admission, Order
from bourse.domain.charging import Outcome
from bourse.ports.observer import RunReport
from bourse.services.billing import Closing
from bourse.services.run_events import Finished
from bourse.services.run_meter import Meter
from bourse.services.run_state import STREAMING, Phase
from bourse.services.run_terms import Terms


def closing_of(
    terms: Terms, meter: Meter, phase: Phase, order: Order | None, cleared: Admission | None, outcome: Outcome
) -> Closing:
    """The run's closing as it ends (now) with ``outcome``, in ``phase`` (its last before DONE)."""
    usage = usage_of(terms, meter, phase, order, cleared)
    policy = terms.ask.market.policy
    receipt: dict[str, Any] = {"latency_ms": round(meter.latency_ms(), 3)}
    if policy.receipt_ttft:
        receipt["ttft_ms"] = None if meter.ttft_ms is None else round(meter.ttft_ms, 3)
    receipt["outcome"] = outcome
    caller = terms.caller
    return Closing(
        request_id=terms.request_id,
        kind=terms.ask.kind,
        endpoint=terms.route,
        product=terms.ask.market.product,
        created_at=terms.created_at,
        account_id=terms.account_id,
        key_id=terms.grant.key_id,
        hold_id=terms.hold_id,
        quote=terms.quote,
        policy=policy,
        outcome=outcome,
        produced=meter.generated > 0 or bool(usage["completion_tokens"]),
        price=terms.ask.bid if cleared is None else cleared.price,
        usage=usage,
        receipt=receipt,
        correlation_id=None if caller is None else caller.correlation_id,
    )


def usage_of(
    terms: Terms, meter: Meter, phase: Phase, order: Order | None, cleared: Admission | None
) -> dict[str, Any]:
    """The engine's usage, or the gateway's own count (``usage_estimated``); with ``x_market``."""
    ev = meter.engine_usage
    tokens = meter.generated
    if ev is not None:
        usage: dict[str, Any] = {
            "prompt_tokens": ev.prompt_tokens,
            "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        }
        usage.update(ev.details)
    else:
        prompt = terms.prompt.estimated_tokens if tokens or phase is STREAMING else 0
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": tokens,
            "total_tokens": prompt + tokens,
            "usage_estimated": True,
        }
    if meter.reasoning:
        _reasoning_details(usage, meter.reasoning)
    bid = terms.ask.bid if order is None else order.bid  # a raised deadline order's: the last
    usage["x_market"] = {
        "bid": bid,
        "start_bid": bid if order is None or order.start_bid is None else order.start_bid,
        "deadline_s": terms.ask.deadline_s,
        "cleared_price": None if cleared is None else cleared.price,
        "level": None if cleared is None else cleared.level,
        "position_at_entry": order.position_at_entry if order else None,
        "queued_ms": None if meter.queued_ms is None else round(meter.queued_ms, 3),
        "requeues": order.requeues if order else 0,
        "deployment": None if cleared is None else cleared.deployment,
    }
    return usage


def report_of(
    terms: Terms,
    meter: Meter,
    order: Order | None,
    cleared: Admission | None,
    client_left: bool,
    fin: Finished,
    closing: Closing,
) -> RunReport:
    """The observer's report of a settled run."""
    caller, usage, error, stream = terms.caller, fin.usage, fin.error, terms.ask.stream
    if stream and caller is not None:
        status = 200  # the head went out when the order entered the book
    elif error is not None:
        status = error.status
    else:
        status = 499 if client_left else 200
    return RunReport(
        method=None if caller is None else "POST",
        route=terms.route,
        status=status,
        outcome=fin.outcome,
        request_id=terms.request_id,
        correlation_id=None if caller is None else caller.correlation_id,
        key_id=terms.grant.key_id,
        product=terms.ask.market.product,
        deployment=None if cleared is None else cleared.deployment,
        stream=stream,
        detached=caller is None,
        error=None if error is None else error.code,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        cost_micros=fin.cost_micros,
        quote_micros=terms.quote.micros,
        bid=terms.ask.bid if order is None else order.bid,
        cleared_price=None if cleared is None else cleared.price,
        queued_ms=None if meter.queued_ms is None else round(meter.queued_ms, 3),
        ttft_ms=None if meter.ttft_ms is None else round(meter.ttft_ms, 3),
        latency_ms=closing.receipt["latency_ms"],
        requeues=0 if order is None else order.requeues,
    )


def _reasoning_details(usage: dict[str, Any], relayed: int) -> None:
    """``completion_tokens_details.reasoning_tokens`` in ``usage``: the engine's own, else
    the gateway's count of the reasoning it relayed (one token per reasoning chunk)."""
    details = usage.get("completion_tokens_details")
    details = dict(details) if isinstance(details, dict) else {}
    given = details.get("reasoning_tokens")
    if not (isinstance(given, int) and given > 0):
        details["reasoning_tokens"] = relayed
    usage["completion_tokens_details"] = details
