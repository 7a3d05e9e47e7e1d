"""What the webhook tests share: a table resolver (names never reach a real resolver)
and an httpx transport that connects to loopback only (any other destination is
recorded and refused), so no test connects outside this machine even if the guard
under test were broken; and a webhook receiver on loopback that records each delivery
and checks its signature against the secret a test expects."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import threading
import time
from dataclasses import dataclass, field

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

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


@dataclass
class Delivery:
    path: str
    headers: dict[str, str]
    body: bytes

    def signed_with(self, secret: str) -> bool:
        """Whether the ``x-bourse-signature`` verifies with ``secret``."""
        header = self.headers.get("x-bourse-signature", "")
        parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
        if "t" not in parts or "v1" not in parts:
            return False
        mac = hmac.new(secret.encode(), parts["t"].encode() + b"." + self.body, hashlib.sha256).hexdigest()
        return hmac.compare_digest(mac, parts["v1"])


@dataclass
class Receiver:
    """A webhook receiver on 127.0.0.1 (``serve_app_in_thread(receiver.app())``): answers
    every POST 204 and records it; :meth:`wait` for a path's deliveries."""

    deliveries: list[Delivery] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> Starlette:
        async def hook(request: Request) -> Response:
            delivery = Delivery(request.url.path, dict(request.headers), await request.body())
            with self.lock:
                self.deliveries.append(delivery)
            return Response(status_code=204)

        return Starlette(routes=[Route("/{path:path}", hook, methods=["POST"])])

    def at(self, path: str) -> list[Delivery]:
        with self.lock:
            return [d for d in self.deliveries if d.path == path]

    def wait(self, path: str, n: int = 1, timeout_s: float = 20.0) -> list[Delivery]:
        deadline = time.monotonic() + timeout_s
        while len(self.at(path)) < n:
            assert time.monotonic() < deadline, f"{len(self.at(path))} deliveries to {path}, expected {n}"
            time.sleep(0.02)
        return self.at(path)
