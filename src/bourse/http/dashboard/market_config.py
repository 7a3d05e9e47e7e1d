"""The live market's configuration from the dashboard (issue 37): what an operator
reads and changes of the products on the market page, each route an admin route of
:mod:`bourse.http.admin_market` under a session instead of a bearer key
(:data:`bourse.http.dashboard.roles.ACTIONS`).

- ``GET /dashboard/api/market``: the version in force, every product's table
  (``market.read``: any operator);
- ``PUT /dashboard/api/products/{product}``: add a product or replace it whole
  (``market.product.put``);
- ``PATCH /dashboard/api/products/{product}``: some of its terms and its deployments'
  (a floor, slots, the default bid; ``market.product.edit``);
- ``DELETE /dashboard/api/products/{product}``: take it off the exchange
  (``market.product.delete``).

The writes take the admin route's body (``dry_run`` answers the change's lines and
changes nothing, so the page shows the diff before applying), make the same change
(:func:`~bourse.http.admin_market.change_product`) through the same
:class:`~bourse.ports.market.MarketAdmin`, audited with the session's actor
(:meth:`~bourse.services.dashboard.Dashboard.actor`), and need the admin route's least
role (``admin``; a user session: 403). The guard's action checks come first: same
origin, the CSRF token.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.http.admin_market import change_product, market_doc
from bourse.http.dashboard.guard import Guard, Handler
from bourse.http.dashboard.roles import BY_NAME, needing
from bourse.http.responses import JSON
from bourse.ports.market import MarketAdmin
from bourse.services.dashboard import Dashboard
from bourse.services.sessions import Session


def routes(guard: Guard, dash: Dashboard, desk: MarketAdmin, max_depth: int) -> list[Route]:
    async def market(request: Request, s: Session) -> Response:
        return JSON(market_doc(await desk.current()))

    async def product(request: Request, s: Session) -> Response:
        return JSON(await change_product(desk, request, dash.actor(s), max_depth))

    handlers: dict[str, Handler] = {
        "market.read": market,
        "market.product.put": product,
        "market.product.edit": product,
        "market.product.delete": product,
    }
    out = []
    for name, handler in handlers.items():
        action = BY_NAME[name]
        wrap = guard.read if action.method == "GET" else guard.action
        out.append(Route(action.path, wrap(needing(name, handler)), methods=[action.method]))
    return out
