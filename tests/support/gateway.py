"""A served gateway for tests: a config (TOML text) in, a base URL and the
container out, on a real loopback port."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import openai

from bourse.container import Container, build
from bourse.settings import parse_config
from tests.support.servers import serve_app_in_thread


@dataclass
class Gateway:
    url: str
    container: Container

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def client(self, **kw: Any) -> openai.OpenAI:
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 30)
        return openai.OpenAI(base_url=self.v1, api_key=kw.pop("api_key", "test"), **kw)

    def engine(self, deployment: str) -> Any:
        return self.container.engines[deployment]


@contextmanager
def running_gateway(config_toml: str, env: dict[str, str] | None = None) -> Iterator[Gateway]:
    cfg = parse_config(tomllib.loads(config_toml), "<test config>", env=env or {})
    container = build(cfg)
    with serve_app_in_thread(container.app()) as url:
        yield Gateway(url, container)
