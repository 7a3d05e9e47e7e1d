"""GET /v1/market/{product}/quote (issue 38, item 2): the lowest bid predicted to be
admitted within ``within_s`` seconds, the predicted wait at it and at the level, and
how well the predictions did lately. Public, like the market views: no key.

A quote is a prediction from the book's recent history, not a promise: the answer says
so in its ``note``.
"""

from __future__ import annotations

import math
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import invalid_request, model_not_found
from bourse.http.deps import Services
from bourse.http.responses import JSON
from bourse.services.market import Market
from bourse.services.market_forecast import QUOTE_HORIZON_S
from bourse.wire.requests import check_id

MAX_WITHIN_S = 86_400.0
"""The longest wait a quote is asked about (a day)."""
MAX_TOKENS = 100_000_000
NOTE = (
    "A quote is a prediction, not a promise: the book's recent history says an order at `bid` "
    "should start within `within_s` (its predicted wait `wait_s`, stretched by `margin`, how much "
    "longer than predicted the recent waits were, fits); orders that arrive later with higher bids, "
    "runs longer than those seen, or a deployment failing can make it wait longer. `forecast` says "
    "how well the predictions did lately."
)


def within(request: Request) -> float:
    """``within_s``: a number of seconds over 0, at most :data:`MAX_WITHIN_S`."""
    raw = request.query_params.get("within_s")
    if raw is None:
        raise invalid_request("within_s: required (seconds, e.g. within_s=5)", param="within_s")
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and 0 < v <= MAX_WITHIN_S):
        raise invalid_request(
            f"within_s: expected a number of seconds over 0 and at most {MAX_WITHIN_S:g}, got {raw!r}",
            param="within_s",
        )
    return v


def tokens(request: Request) -> int | None:
    """``tokens``: the order's tokens (prompt and output), to price the quote; optional."""
    raw = request.query_params.get("tokens")
    if raw is None:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_TOKENS:
        raise invalid_request(
            f"tokens: expected an integer from 1 to {MAX_TOKENS}, got {raw!r}", param="tokens"
        )
    return n


async def quote_doc(name: str, m: Market, within_s: float, n: int | None) -> dict[str, Any]:
    """The quote of ``name`` for a start within ``within_s`` (``n``: its tokens)."""
    outlook = m.outlook
    state = await outlook.fresh_state()
    now = outlook.now()
    q = outlook.forecast.quote(within_s, now, state)
    score = outlook.score()
    level = state.view.level if state.view is not None else m.level()
    horizon = max(QUOTE_HORIZON_S, 4 * within_s)
    at_level = outlook.forecast.wait_at(level, now, state, horizon=horizon)
    return {
        "object": "bourse.quote",
        "product": name,
        "within_s": within_s,
        "bid": q.bid,
        "wait_s": _r(q.wait_s),
        "level": level,
        "wait_at_level_s": _r(at_level),
        "top_bid": q.top_bid,
        "wait_at_top_bid_s": _r(q.top_wait_s),
        "tokens": n,
        "max_cost_usd": None if q.bid is None or n is None else round(q.bid * n / 1e6, 9),
        "unit": "USD per 1M tokens",
        "margin": round(score.margin, 3),
        "forecast": score.doc(),
        "note": NOTE,
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def routes(services: Services) -> list[Route]:
    markets = services.completions.markets

    async def quote(request: Request) -> Response:
        name = check_id(request.path_params["product"], "product")
        m = markets.get(name)
        if m is None:
            raise model_not_found(name)
        return JSON(await quote_doc(name, m, within(request), tokens(request)))

    return [Route("/v1/market/{product}/quote", quote, methods=["GET"])]
