"""The dashboard's operator actions (``bourse.http.dashboard.roles.ACTIONS``): each one
mirrors an admin route of the app with its least role, each one is a dashboard route,
and no dashboard route that changes something escapes the table but the session's own
and a job's cancel (its owner's or an operator's)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from starlette.routing import Route

from bourse.container import build
from bourse.domain.errors import GatewayError
from bourse.http import admin, dashboard
from bourse.http.admin_roles import LEAST_ROLE
from bourse.http.dashboard.roles import ACTIONS, BY_NAME, allowed, check
from bourse.services.sessions import Session
from bourse.settings import Environment, parse_config

SIM = '[products.sim-fast]\n[[products.sim-fast.deployments]]\nengine = "sim"\n'
NOT_ACTIONS = {
    ("POST", "/dashboard/api/session"),
    ("POST", "/dashboard/api/session/end"),
    ("POST", "/dashboard/api/jobs/{job_id}/cancel"),
}


def _routes(tmp_path: Path) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    config = parse_config(tomllib.loads(SIM), "<test>", env={})
    services = build(config, data_dir=tmp_path, env=Environment(admin_key="bk_admin_x"))

    def table(routes: list[Route]) -> set[tuple[str, str]]:
        return {(m, r.path) for r in routes for m in r.methods or () if m != "HEAD"}

    return table(admin.routes(services)), table(dashboard.routes(services))


def test_every_action_mirrors_an_admin_route_and_is_a_dashboard_route(tmp_path: Path) -> None:
    admin_routes, dash_routes = _routes(tmp_path)
    for a in ACTIONS:
        assert a.mirrors in admin_routes and a.mirrors in LEAST_ROLE, a
        assert (a.method, a.path) in dash_routes, a
        assert a.mirrors == (a.method, "/admin" + a.path.removeprefix("/dashboard/api")), a
    writes = {(m, p) for m, p in dash_routes if m != "GET"}
    assert writes - NOT_ACTIONS == {(a.method, a.path) for a in ACTIONS if a.method != "GET"}


def _session(role: str, account: str | None) -> Session:
    return Session("sid", role, account, None if account is None else "key_x", "", 0.0, 1e12)  # type: ignore[arg-type]


def test_an_operator_session_is_an_owner_and_a_user_session_has_no_action() -> None:
    operator, user = _session("operator", None), _session("user", "acme")
    assert allowed(operator) == [a.name for a in ACTIONS]
    assert allowed(user) == []
    for a in ACTIONS:
        check(operator, a)
        with pytest.raises(GatewayError, match="operator") as err:
            check(user, a)
        assert (err.value.status, err.value.code) == (403, "admin_only")
    assert BY_NAME["account.credit"].need == "billing" and BY_NAME["key.update"].need == "admin"
    assert BY_NAME["key.list"].need == "viewer"
