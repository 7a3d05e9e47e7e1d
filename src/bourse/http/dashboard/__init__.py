"""The web dashboard at ``/dashboard``: the exchange floor in a browser.

One page (``static/index.html`` with its script and style, served from inside the
package; no other origin is ever contacted) and the routes it calls:

- :mod:`.assets`: the page and its files, with a strict Content-Security-Policy;
- :mod:`.signin`: sign in with a key (a form), an HttpOnly SameSite=Strict session
  cookie, sign out;
- :mod:`.guard`: the session, origin, CSRF and role checks around every data route
  (each action's role: :data:`bourse.http.admin_roles.DASHBOARD_ACTIONS`);
- :mod:`.api`: markets, money (accounts, holds, spend; settle and release),
  requests, jobs (cancel), the CSV download;
- :mod:`.streams`: the live market and requests feeds (server-sent events).

The use cases behind them are :class:`bourse.services.dashboard.Dashboard`.
"""

from __future__ import annotations

from starlette.routing import Route

from bourse.http.dashboard import api, assets, signin, streams
from bourse.http.dashboard.guard import SIGN_IN, Guard, needing
from bourse.http.deps import Services


def routes(services: Services) -> list[Route]:
    dash = services.dashboard
    markets = services.completions.markets
    guard = Guard(dash.sessions)
    return [
        *assets.routes(),
        *_with_roles(signin.routes(guard, list(markets), services.max_json_depth)),
        *_with_roles(streams.routes(guard, dash, markets)),
        *_with_roles(api.routes(guard, dash, markets, services.max_json_depth)),
    ]


def _with_roles(plain: list[Route]) -> list[Route]:
    """Each action (a POST route but the sign-in) told the role it needs
    (:func:`~bourse.http.dashboard.guard.needing`); one missing from the table fails here."""
    out = []
    for r in plain:
        for method in r.methods or ():
            if method == "HEAD":
                continue
            endpoint = r.endpoint
            if method == "POST" and (method, r.path) != SIGN_IN:
                endpoint = needing(method, r.path, endpoint)
            out.append(Route(r.path, endpoint, methods=[method]))
    return out
