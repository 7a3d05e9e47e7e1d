"""A served gateway for tests: a config (TOML text) in, a base URL, keys and the
container out, on a real loopback port.

Each gateway gets its own data folder (SQLite) unless a database URL is given, an
admin key, and a funded test account with an API key that ``client()`` and
``headers`` use.
"""

from __future__ import annotations

import tempfile
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from bourse.container import Container, build
from bourse.settings import Environment, parse_config
from tests.support.ledgers import watched
from tests.support.servers import serve_app_in_thread

ADMIN_KEY = "bk_admin_test_key"


@dataclass
class Gateway:
    url: str
    container: Container
    api_key: str
    admin_key: str = ADMIN_KEY
    account: str = "test"
    data_dir: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    clients: list[openai.OpenAI] = field(default_factory=list)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"}

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_key}"}

    def client(self, **kw: Any) -> openai.OpenAI:
        """An SDK client with the test account's key (closed when the gateway stops)."""
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 30)
        c = openai.OpenAI(base_url=self.v1, api_key=kw.pop("api_key", self.api_key), **kw)
        self.clients.append(c)
        return c

    def close_clients(self) -> None:
        for c in self.clients:
            c.close()
        self.clients.clear()

    def engine(self, deployment: str) -> Any:
        return self.container.engines[deployment]

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, self.url + path, headers=self.admin_headers, timeout=30, **kw)

    def new_key(self, account: str | None = None, **limits: Any) -> str:
        r = self.admin("POST", "/admin/keys", json={"account": account or self.account, **limits})
        r.raise_for_status()
        key: str = r.json()["key"]
        return key

    def new_account(self, account: str, credit_usd: float) -> str:
        r = self.admin("POST", "/admin/accounts", json={"id": account, "credit_usd": credit_usd})
        r.raise_for_status()
        return self.new_key(account)

    def balance(self, account: str | None = None) -> int:
        r = self.admin("GET", f"/admin/accounts/{account or self.account}")
        r.raise_for_status()
        value: int = r.json()["balance_micros"]
        return value

    def ledger(self) -> dict[str, Any]:
        r = self.admin("GET", "/admin/ledger")
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out


def breaker_openings(gateway: Gateway | str) -> float:
    """How many times a breaker of the gateway (or the one at this base URL) opened, as
    its ``/metrics`` says (``bourse_breaker_transitions_total{state="open"}``)."""
    url = gateway if isinstance(gateway, str) else gateway.url
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "bourse_breaker_transitions_total" and s.labels.get("state") == "open"
    )


@contextmanager
def running_gateway(
    config_toml: str,
    env: dict[str, str] | None = None,
    *,
    database: str | None = None,
    data_dir: str | None = None,
    credit_usd: float = 1000.0,
) -> Iterator[Gateway]:
    cfg = parse_config(tomllib.loads(config_toml), "<test config>", env=env or {})
    with tempfile.TemporaryDirectory(prefix="bourse-test-") as tmp:
        folder = data_dir or tmp
        container = build(cfg, data_dir=folder, env=Environment(admin_key=ADMIN_KEY), database=database)
        container.announce = False
        with watched(folder, database), serve_app_in_thread(container.app()) as url:
            gw = Gateway(url, container, api_key="", data_dir=folder)
            if gw.admin("GET", f"/admin/accounts/{gw.account}").status_code == 404:
                gw.api_key = gw.new_account(gw.account, credit_usd)
            else:
                gw.api_key = gw.new_key(gw.account)
            try:
                yield gw
            finally:
                gw.close_clients()
