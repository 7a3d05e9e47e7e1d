"""Public views of the exchange: GET /v1/models, /v1/market, /v1/market/{product}."""

from __future__ import annotations

import math
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import model_not_found
from bourse.http.deps import Services
from bourse.http.responses import JSON
from bourse.services.market import Market


def _buckets(m: Market) -> list[dict[str, Any]]:
    """Orders waiting, by price bucket (bids rounded down to two significant digits)."""
    counts: dict[float, int] = {}
    for o in m.book.waiting_orders():
        if o.bid <= 0:
            key = 0.0
        else:
            mag = 10 ** (math.floor(math.log10(o.bid)) - 1)
            key = round(math.floor(o.bid / mag) * mag, 10)
        counts[key] = counts.get(key, 0) + 1
    return [{"price": p, "orders": n} for p, n in sorted(counts.items(), reverse=True)]


def market_view(name: str, m: Market, *, depth: bool) -> dict[str, Any]:
    busy = m.book.busy_slots()
    total = m.book.total_slots()
    now = m.now()
    out: dict[str, Any] = {
        "object": "bourse.market",
        "product": name,
        "level": m.level(),
        "floor": m.book.min_floor,
        "default_bid": m.default_bid,
        "slots": {"busy": busy, "free": total - busy, "total": total},
        "waiting": m.book.waiting,
        "best_bid": m.book.best_bid(),
        "admitted_total": m.admitted_total,
        "deployments": [
            {
                "name": d.name,
                "floor": d.floor,
                "slots": d.slots,
                "busy": d.busy,
                "healthy": d.breaker.available(now),
                "breaker": d.breaker.state,
            }
            for d in m.book.deployments
        ],
    }
    if depth:
        out["book"] = _buckets(m)
        out["recent_clears"] = [
            {"ago_s": round(now - c.at, 3), "price": c.price, "bid": c.bid, "deployment": c.deployment}
            for c in reversed(m.recent)
        ]
    return out


def routes(services: Services) -> list[Route]:
    markets = services.completions.markets

    async def models(request: Request) -> Response:
        data = []
        for name, m in markets.items():
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "bourse",
                    "description": m.description,
                    "context_length": m.context_length,
                    "max_output_tokens": m.max_output_tokens,
                    "pricing": {
                        "unit": "USD per 1M tokens",
                        "floor": m.book.min_floor,
                        "level": m.level(),
                        "default_bid": m.default_bid,
                    },
                    "policy": m.policy.name,
                }
            )
        return JSON({"object": "list", "data": data})

    async def market_all(request: Request) -> Response:
        return JSON({"object": "list", "data": [market_view(n, m, depth=False) for n, m in markets.items()]})

    async def market_one(request: Request) -> Response:
        name = request.path_params["product"]
        m = markets.get(name)
        if m is None:
            raise model_not_found(name)
        return JSON(market_view(name, m, depth=True))

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/market", market_all, methods=["GET"]),
        Route("/v1/market/{product}", market_one, methods=["GET"]),
    ]
