"""What the webhook tests share: a table resolver (names never reach a real resolver)
and an httpx transport that connects to loopback only (any other destination is
recorded and refused), so no test connects outside this machine even if the guard
under test were broken."""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass, field

import httpx

from bourse.ports.webhooks import Address


class TableResolver:
    """Maps test names to address lists; a name's n-th lookup gets the n-th list (the last
    one repeats). Unknown names do not resolve: nothing reaches a real resolver."""

    def __init__(self) -> None:
        self.answers: dict[str, list[list[Address]]] = {}
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, name: str, *answers: list[Address]) -> None:
        with self.lock:
            self.answers[name] = list(answers)

    def lookups(self, name: str) -> int:
        with self.lock:
            return self.calls.get(name, 0)

    async def __call__(self, host: str, port: int) -> list[Address]:
        with self.lock:
            answers = self.answers.get(host)
            if answers is None:
                raise OSError(f"{host}: not in the test table")
            n = self.calls.get(host, 0)
            self.calls[host] = n + 1
            return answers[min(n, len(answers) - 1)]


@dataclass
class LoopbackOnly(httpx.AsyncBaseTransport):
    """Connects to 127.0.0.0/8 and ::1 only; any other destination is recorded and refused
    (or answered ``fake_status`` without a connection)."""

    refused: list[httpx.Request] = field(default_factory=list)
    fake_status: int | None = None
    real: httpx.AsyncHTTPTransport = field(default_factory=httpx.AsyncHTTPTransport)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            loopback = ipaddress.ip_address(request.url.host).is_loopback
        except ValueError:  # a name: the sender must connect to an address
            loopback = False
        if loopback:
            return await self.real.handle_async_request(request)
        self.refused.append(request)
        if self.fake_status is not None:
            return httpx.Response(self.fake_status, request=request)
        raise httpx.ConnectError("the test transport connects to loopback only", request=request)

    async def aclose(self) -> None:
        await self.real.aclose()
