"""The gateway in process: the real container and ASGI app, driven through
``httpx.ASGITransport`` (no socket, no thread).

:func:`in_process_gateway` builds the container from a config (TOML text) with a
SQLite store in a given folder, runs the app's ASGI lifespan (so start-up and
shut-down are the real ones), funds a test account and yields an
:class:`InProcessGateway` whose calls are answered in the test's own event loop.

``httpx.ASGITransport`` (httpx 0.28) runs the app to the end of its response before
returning it: a streamed answer arrives whole, so a test reads every frame of a
complete stream, but not when each frame was sent, and its client never leaves
early. :meth:`InProcessGateway.sse_leaving` calls the app directly instead and sends
``http.disconnect`` once the stream carried a given number of data frames; or, as
bourse's own server does (``watched``), tells the relay through the connection's watch
(:class:`ConnectionWatch`).
"""

from __future__ import annotations

import asyncio
import tomllib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from starlette.types import ASGIApp, Message, Scope

from bourse.container import Container, build
from bourse.settings import Environment, parse_config
from tests.support.bodies import streamed
from tests.support.gateway import ADMIN_KEY
from tests.support.ledgers import watched
from tests.support.sse import SSEResult, read_result

BASE_URL = "http://bourse.test"
"""The base URL of in-process requests (never resolved: the transport calls the app)."""


@asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """Run ``app``'s ASGI lifespan: start-up on entry, shut-down on exit; a start-up
    or shut-down the app reports as failed raises."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()

    async def receive() -> Message:
        return await inbox.get()

    async def send(message: Message) -> None:
        await outbox.put(message)

    async def run() -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        await app(scope, receive, send)

    task = asyncio.create_task(run())

    async def step(event: str) -> None:
        await inbox.put({"type": f"lifespan.{event}"})
        reply = asyncio.create_task(outbox.get())
        await asyncio.wait({reply, task}, return_when=asyncio.FIRST_COMPLETED)
        if not reply.done():
            reply.cancel()
            task.result()  # the app's own error, if it raised
            raise RuntimeError(f"the app ended its lifespan during {event}")
        message = reply.result()
        if message["type"] != f"lifespan.{event}.complete":
            raise RuntimeError(f"lifespan {event} failed: {message.get('message', message)}")

    await step("startup")
    try:
        yield
    finally:
        await step("shutdown")
        await task


class ConnectionWatch:
    """``extensions["bourse.client_present"]["watch"]`` of a connection in process, as
    bourse's server has it (:meth:`bourse.http.connections.BoundedHttpToolsProtocol.watch`):
    :meth:`lose` calls the watcher back once, from the event loop as the connection's
    ``connection_lost`` would; a watcher set after that is called at once."""

    def __init__(self) -> None:
        self.on_lost: Callable[[], None] | None = None
        self.lost = False
        self.watchers = 0
        """How many times a watcher was set."""

    def __call__(self, on_lost: Callable[[], None] | None) -> None:
        if on_lost is not None:
            self.watchers += 1
            if self.lost:
                on_lost()
                return
        self.on_lost = on_lost

    def lose(self) -> None:
        asyncio.get_running_loop().call_soon(self._lost)

    def _lost(self) -> None:
        self.lost = True
        on_lost, self.on_lost = self.on_lost, None
        if on_lost is not None:
            on_lost()

    def extensions(self) -> dict[str, Any]:
        """The scope's ``extensions`` with this watch."""
        return {"bourse.client_present": {"watch": self}}


@dataclass
class InProcessGateway:
    """The app in process, a client on it, and the funded test account's key."""

    container: Container
    app: ASGIApp
    client: httpx.AsyncClient
    api_key: str
    admin_key: str = ADMIN_KEY
    account: str = "test"

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"}

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_key}"}

    async def post(
        self,
        path: str,
        body: Any = None,
        *,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        auth: bool = True,
    ) -> httpx.Response:
        """A POST as the test account (``auth=False``: without a key); ``content`` is
        sent as it is, else ``body`` as JSON."""
        h = {**(self.headers if auth else {}), **(headers or {})}
        if content is not None:
            h.setdefault("content-type", "application/json")
            return await self.client.post(path, content=content, headers=h)
        return await self.client.post(path, json=body, headers=h)

    async def get(self, path: str, *, headers: dict[str, str] | None = None) -> httpx.Response:
        return await self.client.get(path, headers={**self.headers, **(headers or {})})

    async def sse(
        self,
        body: dict[str, Any],
        *,
        path: str = "/v1/chat/completions",
        headers: dict[str, str] | None = None,
    ) -> SSEResult:
        """A streamed request (``stream: true`` and the default conversation unless
        ``body`` says otherwise), read whole."""
        r = await self.post(path, streamed(body), headers=headers)
        return read_result(r.status_code, r.headers, r.content)

    def stream_scope(
        self,
        body: dict[str, Any],
        *,
        path: str = "/v1/chat/completions",
        watch: ConnectionWatch | None = None,
    ) -> tuple[Scope, bytes]:
        """The scope of a streamed request as the test account (``stream: true`` and the
        default conversation unless ``body`` says otherwise), and its body; with the
        connection's ``watch`` in its extensions, as bourse's server gives it."""
        raw = orjson.dumps(streamed(body))
        headers = [
            (b"authorization", f"Bearer {self.api_key}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
        ]
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": headers, "client": ("127.0.0.1", 1), "server": ("bourse.test", 80),
        }  # fmt: skip
        if watch is not None:
            scope["extensions"] = watch.extensions()
        return scope, raw

    async def sse_leaving(
        self,
        body: dict[str, Any],
        data_frames: int,
        *,
        path: str = "/v1/chat/completions",
        watched: bool = False,
    ) -> SSEResult:
        """A streamed request whose client disconnects once ``data_frames`` data frames
        arrived (0: at the first frame of any kind); what it received until then. The
        app must write nothing more once the client is gone. ``watched``: the scope
        carries the connection's watch, as on bourse's own server, and the relay must
        hear of the disconnect from it: it must not wait on ``receive`` once the
        request's body is read."""
        watch = ConnectionWatch() if watched else None
        scope, raw = self.stream_scope(body, path=path, watch=watch)
        left = asyncio.Event()
        requested = False
        listened = False
        start: Message = {}
        received = bytearray()
        late: list[Message] = []

        async def receive() -> Message:
            nonlocal requested, listened
            if not requested:
                requested = True
                return {"type": "http.request", "body": raw, "more_body": False}
            listened = True
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if left.is_set():
                late.append(message)
                return
            received.extend(message.get("body", b""))
            if received.count(b"data: ") >= data_frames and received.endswith(b"\n\n"):
                left.set()
                if watch is not None:
                    watch.lose()

        await self.app(scope, receive, send)
        assert not late, f"written after the client left: {late}"
        if watch is not None:
            assert watch.watchers == 1 and not listened, "the relay listened on receive, not to the watch"
        head = httpx.Headers([(k.decode(), v.decode()) for k, v in start.get("headers", [])])
        return read_result(start.get("status", 0), head, bytes(received))

    async def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return await self.client.request(method, path, headers=self.admin_headers, **kw)

    async def new_key(self, account: str | None = None, **limits: Any) -> str:
        r = await self.admin("POST", "/admin/keys", json={"account": account or self.account, **limits})
        assert r.status_code == 201, r.text
        key: str = r.json()["key"]
        return key

    async def new_account(self, account: str, credit_usd: float) -> str:
        """A new account with ``credit_usd``; its first API key."""
        r = await self.admin("POST", "/admin/accounts", json={"id": account, "credit_usd": credit_usd})
        assert r.status_code == 201, r.text
        return await self.new_key(account)

    async def balance(self, account: str | None = None) -> int:
        r = await self.admin("GET", f"/admin/accounts/{account or self.account}")
        assert r.status_code == 200, r.text
        value: int = r.json()["balance_micros"]
        return value


@asynccontextmanager
async def in_process_gateway(
    config_toml: str, data_dir: Path, *, credit_usd: float = 1000.0
) -> AsyncIterator[InProcessGateway]:
    """The gateway of ``config_toml`` in process, its SQLite ledger in ``data_dir``
    (watched: a suite's ledger check runs on it once the gateway has stopped)."""
    cfg = parse_config(tomllib.loads(config_toml), "<test config>", env={})
    container = build(cfg, data_dir=data_dir, env=Environment(admin_key=ADMIN_KEY))
    container.announce = False
    app = container.app()
    with watched(data_dir, None):
        async with lifespan(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
                gw = InProcessGateway(container, app, client, api_key="")
                gw.api_key = await gw.new_account(gw.account, credit_usd)
                yield gw
