"""The dashboard's operator actions (``bourse.http.dashboard.roles.ACTIONS``): each one
mirrors an admin route of the app with its least role, each one is a dashboard route,
and no dashboard route that changes something escapes the table but the session's own
and a job's cancel (``OWN_ACTIONS``: its owner's, or an ``admin`` operator's)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from starlette.routing import Route

from bourse.container import build
from bourse.domain.errors import GatewayError
from bourse.http import admin, admin_market, dashboard
from bourse.http.admin_roles import LEAST_ROLE
from bourse.http.dashboard.roles import (
    ACTIONS,
    BY_NAME,
    OWN_ACTIONS,
    Action,
    OwnAction,
    allowed,
    check,
    check_complete,
)
from bourse.ports.operators import ROLES
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

    return table([*admin.routes(services), *admin_market.routes(services)]), table(dashboard.routes(services))


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


def test_the_admin_keys_session_is_an_owner_and_a_user_session_has_no_operator_action() -> None:
    operator, user = _session("owner", None), _session("user", "acme")
    assert allowed(operator) == [a.name for a in ACTIONS] + ["job.cancel"]
    assert allowed(user) == ["job.cancel"]  # their own jobs
    for a in ACTIONS:
        check(operator, a)
        with pytest.raises(GatewayError, match="operator") as err:
            check(user, a)
        assert (err.value.status, err.value.code) == (403, "admin_only")
    assert BY_NAME["account.credit"].need == "billing" and BY_NAME["key.update"].need == "admin"
    assert BY_NAME["key.list"].need == "viewer"


@pytest.mark.parametrize("role", ["viewer", "billing", "admin"])
def test_an_operator_session_acts_with_its_own_role(role: str) -> None:
    s = Session("sid", role, None, None, "", 0.0, 1e12, "op_1", "ada")  # type: ignore[arg-type]
    names = set(allowed(s))
    every: list[Action | OwnAction] = [*ACTIONS, *OWN_ACTIONS]
    for a in every:
        ok = a.name in names
        assert ok == (ROLES.index(role) >= ROLES.index(a.need)), (role, a)
        if ok:
            check(s, a)
            continue
        with pytest.raises(GatewayError) as err:
            check(s, a)
        assert (err.value.status, err.value.code) == (403, "insufficient_role")
        assert f"operator 'ada' has '{role}'" in err.value.message
    assert ("hold.settle" in names) == (role != "viewer") and ("job.cancel" in names) == (role == "admin")


def test_a_dashboard_write_with_no_role_cannot_be_built() -> None:
    async def endpoint(request: object) -> None: ...

    with pytest.raises(RuntimeError, match=r"/dashboard/api/holds/\{hold_id\}/burn"):
        check_complete([Route("/dashboard/api/holds/{hold_id}/burn", endpoint, methods=["POST"])])
