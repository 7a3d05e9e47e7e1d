"""The web dashboard at ``/dashboard``: the exchange floor in a browser.

One page (``static/index.html`` with its script and style, served from inside the
package; no other origin is ever contacted) and the routes it calls:

- :mod:`.assets`: the page and its files, with a strict Content-Security-Policy;
- :mod:`.signin`: sign in with a key (a form), an HttpOnly SameSite=Strict session
  cookie, sign out;
- :mod:`.guard`: the session, origin and CSRF checks around every data route;
- :mod:`.api`: markets, money (accounts, holds, spend; settle and release),
  requests, jobs (cancel), the CSV download;
- :mod:`.manage`: accounts and keys managed by an operator (the admin API's use cases;
  who may do which: :mod:`.roles`);
- :mod:`.market_config`: the live market's products, floors, slots and default bids
  read and changed by an operator (the admin market routes' changes);
- :mod:`.streams`: the live market and requests feeds (server-sent events).

The use cases behind them are :class:`bourse.services.dashboard.Dashboard`.
"""

from __future__ import annotations

from starlette.routing import Route

from bourse.http.dashboard import api, assets, manage, market_config, signin, streams
from bourse.http.dashboard.guard import Guard
from bourse.http.dashboard.roles import check_complete
from bourse.http.deps import Services


def routes(services: Services) -> list[Route]:
    dash = services.dashboard
    markets = services.completions.markets
    guard = Guard(dash.sessions)
    return check_complete(
        [
            *assets.routes(),
            *signin.routes(guard, markets.keys(), services.max_json_depth),
            *streams.routes(guard, dash, markets),
            *api.routes(guard, dash, markets, services.max_json_depth),
            *manage.routes(guard, dash, services.max_json_depth),
            *market_config.routes(guard, dash, services.desk, services.max_json_depth),
        ]
    )
