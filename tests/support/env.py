"""A served gateway on one of two engine kinds, built from one description.

- ``sim``: the gateway's in-process simulated engine;
- ``openai``: the gateway's HTTP engine pointed at ``bourse sim-upstream``
  (``create_sim_app``) served on its own real port, one upstream per deployment,
  with the internal model name ``internal-name``.

:func:`start_env` builds either from the same :class:`~tests.support.config.Product`
list; :class:`Env` is the running gateway with a way to read each deployment's
engine counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from bourse.engines.sim import SimSettings
from bourse.engines.sim_server import create_sim_app
from tests.support.config import Dep, Product, config_toml, sim_keys
from tests.support.gateway import Gateway, running_gateway
from tests.support.servers import serve_app_in_thread

INTERNAL_MODEL = "internal-name"
UPSTREAM_MODEL = "sim-upstream"
ENGINE_KINDS = ("sim", "openai")


@dataclass
class Env:
    """A running gateway and a way to read each deployment's engine counters."""

    kind: str
    gateway: Gateway
    upstreams: dict[str, str]
    """deployment name -> sim-upstream base URL (openai kind only)"""

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def auth(self) -> dict[str, str]:
        """The test account's Authorization header."""
        return dict(self.gateway.headers)

    def client(self, **kw: Any) -> openai.OpenAI:
        """An SDK client with the test account's key (closed when the gateway stops)."""
        return self.gateway.client(**kw)

    def post(
        self, path: str, body: Any = None, *, content: Any = None, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        """An authenticated POST (raw JSON ``content`` or a ``body`` to encode)."""
        h = {**self.auth, **(headers or {})}
        if content is not None:
            h.setdefault("content-type", "application/json")
            return httpx.post(self.url + path, content=content, headers=h, timeout=30)
        return httpx.post(self.url + path, json=body, headers=h, timeout=30)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.auth, timeout=30)

    def stats(self, dep: str) -> dict[str, int]:
        if self.kind == "sim":
            return dict(self.gateway.engine(dep).stats)
        r = httpx.get(self.upstreams[dep] + "/sim/stats", timeout=5)
        r.raise_for_status()
        data: dict[str, int] = r.json()
        return data

    def wait_stats(
        self, dep: str, pred: Callable[[dict[str, int]], bool], timeout: float
    ) -> tuple[dict[str, int], float]:
        """Poll the counters until ``pred`` holds or ``timeout`` passes; (last stats, seconds)."""
        t0 = time.monotonic()
        while True:
            s = self.stats(dep)
            waited = time.monotonic() - t0
            if pred(s) or waited > timeout:
                return s, waited
            time.sleep(0.01)


@contextmanager
def start_env(
    kind: str,
    products: list[Product],
    server: dict[str, Any] | None = None,
    cluster: dict[str, Any] | None = None,
) -> Iterator[Env]:
    """A served gateway with ``products`` on the ``sim`` engine or on ``openai`` in
    front of sim upstreams; ``cluster`` (e.g. a redis_url) puts its book in Redis."""
    upstreams: dict[str, str] = {}
    with ExitStack() as stack:

        def upstream_keys(d: Dep) -> dict[str, Any]:
            url = stack.enter_context(serve_app_in_thread(create_sim_app(SimSettings(**d.sim))))
            upstreams[d.name] = url
            return {"engine": "openai", "base_url": url + "/v1", "model": INTERNAL_MODEL}

        text = config_toml(
            products, server=server, cluster=cluster, engine_keys=sim_keys if kind == "sim" else upstream_keys
        )
        gw = stack.enter_context(running_gateway(text))
        yield Env(kind, gw, upstreams)
