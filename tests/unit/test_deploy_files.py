"""The deployment files against the code they deploy (issue 39): deploy/k8s's config
file loads as bourse's config, on PostgreSQL and Redis; the stop budgets (Kubernetes' grace period, systemd's
``TimeoutStopSec``) cover the longest drain the gateway can take; the preStop sleep
covers ``drain_grace_s``; the unit is ``Type=notify`` and reloads with SIGHUP.
``scripts/check-deploy`` checks the files' syntax with systemd's and Kubernetes' own tools."""

from __future__ import annotations

import re
from pathlib import Path

from bourse.cli import server_config
from bourse.services.drain import GRACE_S
from bourse.settings import ServerConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
UNIT = ROOT / "deploy" / "systemd" / "bourse.service"
BACKGROUND_WAIT_S = 10.0
"""What :meth:`bourse.container.Container.stop` gives requests' background tasks."""


def after_drain_timeout_s() -> float:
    """The longest a stop takes past ``drain_timeout_s`` (bourse.services.drain): the ended
    runs settle, the sweeper's closes finish, the sweep runs (each up to ``GRACE_S``); then
    the container's stop and uvicorn's graceful shutdown."""
    uvicorn_s = server_config(None, ServerConfig()).timeout_graceful_shutdown or 0
    return 3 * GRACE_S + BACKGROUND_WAIT_S + uvicorn_s


def one(pattern: str, text: str) -> str:
    found = re.findall(pattern, text, re.MULTILINE)
    assert len(found) == 1, (pattern, found)
    return str(found[0])


def test_the_k8s_config_loads_and_the_stop_budget_covers_the_longest_drain() -> None:
    config = load_config(K8S / "bourse.toml")
    assert config.products and config.cluster.key_prefix
    # an emptyDir data folder: the ledger and the book are shared, never SQLite in the pod
    assert (config.storage.database or "").startswith("postgresql://") and config.cluster.redis_url
    deployment = (K8S / "deployment.yaml").read_text()
    grace_period = int(one(r"^\s+terminationGracePeriodSeconds: (\d+)$", deployment))
    pre_stop = float(one(r'^\s+command: \["sleep", "(\d+)"\]$', deployment))
    assert pre_stop >= config.server.drain_grace_s
    longest = pre_stop + config.server.drain_timeout_s + after_drain_timeout_s()
    assert grace_period > longest, (grace_period, longest)


def test_the_unit_is_notify_reloads_with_sighup_and_outlasts_the_default_drain() -> None:
    unit = UNIT.read_text()
    assert one(r"^Type=(\S+)$", unit) == "notify"
    assert one(r"^ExecReload=(.+)$", unit) == "/bin/kill -HUP $MAINPID"
    stop_s = float(one(r"^TimeoutStopSec=(\d+)$", unit))
    assert stop_s > ServerConfig().drain_timeout_s + after_drain_timeout_s(), stop_s
    for key in ("ProtectSystem=strict", "NoNewPrivileges=yes", "DynamicUser=yes", "StateDirectory=bourse"):
        assert f"\n{key}\n" in unit, key


def test_the_secrets_are_a_template_never_values() -> None:
    example = (K8S / "secrets.env.example").read_text()
    assert re.search(r"^BOURSE_ADMIN_KEY=$", example, re.MULTILINE)
    assert re.search(r"^BOURSE_SECRET_KEY=$", example, re.MULTILINE)
    assert (K8S / ".gitignore").read_text().split() == ["secrets.env"]
