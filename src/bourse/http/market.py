"""Public views of the exchange: GET /v1/models, /v1/models/{model}, /v1/market,
/v1/market/{product}."""

from __future__ import annotations

import math
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import model_not_found
from bourse.domain.market_quote import candidate_bids
from bourse.http.deps import Services
from bourse.http.responses import JSON
from bourse.ports.book import BookView, cleared
from bourse.services.market import Market
from bourse.wire.requests import check_id


def _buckets(bids: list[float]) -> list[dict[str, Any]]:
    """Orders waiting, by price bucket (bids rounded down to two significant digits)."""
    counts: dict[float, int] = {}
    for bid in bids:
        if bid <= 0:
            key = 0.0
        else:
            mag = 10 ** (math.floor(math.log10(bid)) - 1)
            key = round(math.floor(bid / mag) * mag, 10)
        counts[key] = counts.get(key, 0) + 1
    return [{"price": p, "orders": n} for p, n in sorted(counts.items(), reverse=True)]


async def market_view(name: str, m: Market, *, depth: bool) -> dict[str, Any]:
    return market_doc(name, m, await m.view(), depth=depth)


def _waits(m: Market, v: BookView, now: float) -> tuple[float | None, Any]:
    """(admissions per second lately, the predicted wait of a new order at a price)."""
    count = len(v.recent)
    span = now - v.recent[-1].at if v.recent else 0.0
    rate = count / span if count >= 2 and span > 0 else None

    def wait_at(price: float) -> float | None:
        w = m.outlook.wait_now(price)
        return None if w is None else round(w, 3)

    return (None if rate is None else round(rate, 3)), wait_at


CURVE_PRICES = 24
"""The most prices the dashboard's price-against-wait curve predicts at."""


def wait_curve(m: Market, v: BookView) -> list[dict[str, Any]]:
    """Price against expected wait (issue 38, item 2; the dashboard's market page): the
    predicted wait of a new order at each price that matters (the floors of the
    deployments taking orders, each bucket of the book and the price just above it;
    :func:`~bourse.domain.market_quote.candidate_bids`), at most :data:`CURVE_PRICES`
    of them spread over the range, lowest first. As in a quote, a higher price is never
    shown waiting longer than a lower one; ``wait_s`` None: no start predicted within
    the forecast's horizon. A prediction, as the quote is: not a promise."""
    floors = [d.floor for d in v.deployments if d.available is not False] or [m.min_floor]
    prices = candidate_bids(floors, [b["price"] for b in _buckets(v.bids)])
    if len(prices) > CURVE_PRICES:
        last = len(prices) - 1
        prices = [prices[round(i * last / (CURVE_PRICES - 1))] for i in range(CURVE_PRICES)]
    waits = [m.outlook.wait_now(p) for p in prices]
    for i in range(len(waits) - 2, -1, -1):  # none waits less than a higher price
        w, above = waits[i], waits[i + 1]
        waits[i] = None if w is None or above is None else max(w, above)
    return [
        {"price": p, "wait_s": None if w is None else round(w, 3)} for p, w in zip(prices, waits, strict=True)
    ]


def market_doc(name: str, m: Market, v: BookView, *, depth: bool) -> dict[str, Any]:
    """The market view of one product from a view of its book (``depth``: the book
    and the recent admissions too). ``expected_wait_s``: the predicted wait of a new
    order at the default bid (:mod:`bourse.domain.forecast`); ``waits``: the same at
    each price bucket of the book; ``forecast``: how well this replica's predictions
    did lately (:mod:`bourse.domain.forecast_score`)."""
    busy = sum(d.busy for d in v.deployments)
    total = sum(d.slots for d in v.deployments)
    now = time.time()
    rate, wait_at = _waits(m, v, now)
    out: dict[str, Any] = {
        "object": "bourse.market",
        "product": name,
        "level": v.level,
        "floor": m.min_floor,
        "default_bid": m.default_bid,
        "slots": {"busy": busy, "free": max(0, total - busy), "total": total},
        "waiting": v.waiting,
        "parked": v.parked,
        "best_bid": v.best_bid,
        "admitted_total": v.admitted_total,
        "admissions_per_s": rate,
        "expected_wait_s": wait_at(m.default_bid),
        "forecast": (v.forecast or m.outlook.score()).doc(),
        "deployments": [
            {
                "name": d.name,
                "floor": d.floor,
                "slots": d.slots,
                "busy": d.busy,
                "healthy": d.healthy,
                "breaker": d.breaker,
                "available": d.available,
                "reason": d.reason,
                "flavor": d.flavor,
            }
            for d in v.deployments
        ],
    }
    if depth:
        out["book"] = book = _buckets(v.bids)
        out["waits"] = [{"price": b["price"], "wait_s": wait_at(b["price"])} for b in book]
        out["recent_clears"] = [
            {
                "ago_s": round(max(0.0, now - c.at), 3),
                "price": c.price,
                "bid": c.bid,
                "deployment": c.deployment,
            }
            for c in cleared(v.recent)
        ]
    return out


def model_doc(name: str, m: Market) -> dict[str, Any]:
    """The OpenAI model object of one product (``id``, ``object``, ``created``,
    ``owned_by``) and bourse's own fields beside it, which the SDKs keep (openai-python:
    ``model_extra``): ``context_length`` (as OpenRouter names it), ``max_output_tokens``,
    ``pricing`` and the ``policy``. From the configuration alone: a product whose
    engines are down is still described."""
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "bourse",
        "description": m.description,
        "context_length": m.context_length,
        "max_output_tokens": m.max_output_tokens,
        "pricing": {
            "unit": "USD per 1M tokens",
            "floor": m.min_floor,
            "level": m.level(),
            "default_bid": m.default_bid,
        },
        "policy": m.policy.name,
    }


def routes(services: Services) -> list[Route]:
    markets = services.completions.markets

    async def models(request: Request) -> Response:
        return JSON({"object": "list", "data": [model_doc(n, m) for n, m in markets.items()]})

    async def model_one(request: Request) -> Response:
        # ``{model:path}``: a product may be named as a Hugging Face model is
        # ("org/name"), sent with its "/" as is or percent-encoded (the SDKs: %2F)
        name = check_id(request.path_params["model"], "model")
        m = markets.get(name)
        if m is None:
            raise model_not_found(name)
        return JSON(model_doc(name, m))

    async def market_all(request: Request) -> Response:
        return JSON(
            {"object": "list", "data": [await market_view(n, m, depth=False) for n, m in markets.items()]}
        )

    async def market_one(request: Request) -> Response:
        name = check_id(request.path_params["product"], "product")
        m = markets.get(name)
        if m is None:
            raise model_not_found(name)
        return JSON(await market_view(name, m, depth=True))

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model_one, methods=["GET"]),
        Route("/v1/market", market_all, methods=["GET"]),
        Route("/v1/market/{product}", market_one, methods=["GET"]),
    ]
