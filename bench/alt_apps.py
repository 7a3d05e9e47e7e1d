"""Bare pass-through apps for ``bench/alternatives.py`` (no bourse in them): read the
request body, POST it to ``ALT_UPSTREAM``, return the answer. One ASGI app (for
uvicorn and granian's ASGI) and one RSGI app (granian's native interface), each with
an upstream client chosen by ``ALT_CLIENT`` (``aiohttp``: its ``ClientSession``;
``aiohttp-raw``: its connector and parser driven directly, as the ``openai`` engine
does; ``rnet``; ``pyreqwest``), each with one keep-alive pool. They run in the candidates' own virtual environment
(bench/.work/alt-venv), served as factories:

    uvicorn --factory bench.alt_apps:asgi_app ...
    granian --interface rsgi --factory bench.alt_apps:rsgi_app ...
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

Fetch = Callable[[bytes], Awaitable[bytes]]
JSON = "application/json"


def _fetcher() -> Callable[[], Awaitable[Fetch]]:
    """A lazy upstream client (made on the first request, inside the server's loop)."""
    url = os.environ["ALT_UPSTREAM"]
    kind = os.environ.get("ALT_CLIENT", "aiohttp")
    made: list[Fetch] = []

    async def get() -> Fetch:
        if not made:
            made.append(await {"aiohttp": _aiohttp, "aiohttp-raw": _aiohttp_raw, "rnet": _rnet,
                               "pyreqwest": _pyreqwest}[kind](url))  # fmt: skip
        return made[0]

    return get


async def _aiohttp(url: str) -> Fetch:
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=300))

    async def fetch(body: bytes) -> bytes:
        async with session.post(url, data=body, headers={"content-type": JSON}) as r:
            return await r.read()

    return fetch


async def _aiohttp_raw(url: str) -> Fetch:
    """aiohttp's connector and C response parser driven directly (no ClientSession)."""
    import asyncio

    import aiohttp
    import yarl
    from aiohttp.client_reqrep import ClientRequest

    u = yarl.URL(url)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=300)
    key = ClientRequest("POST", u.origin(), loop=asyncio.get_running_loop())
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    head = b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: " % (
        u.raw_path_qs.encode(), u.host_port_subcomponent.encode())  # fmt: skip

    async def fetch(body: bytes) -> bytes:
        conn = await connector.connect(key, [], timeout)
        try:
            proto = conn.protocol
            assert proto is not None and conn.transport is not None
            proto.set_response_params()
            conn.transport.write(b"%s%d\r\n\r\n%s" % (head, len(body), body))
            _, payload = await proto.read()
            data = await payload.read()
        except BaseException:
            conn.close()
            raise
        conn.release()
        return data

    return fetch


async def _rnet(url: str) -> Fetch:
    import rnet

    client = rnet.Client(pool_max_idle_per_host=1024, http1_only=True)

    async def fetch(body: bytes) -> bytes:
        r = await client.post(url, body=body, headers={"content-type": JSON})
        return bytes(await r.bytes())

    return fetch


async def _pyreqwest(url: str) -> Fetch:
    from pyreqwest.client import ClientBuilder

    client = ClientBuilder().pool_max_idle_per_host(1024).build()

    async def fetch(body: bytes) -> bytes:
        r = await client.post(url).header("content-type", JSON).body_bytes(body).build().send()
        return bytes(await r.bytes())

    return fetch


def asgi_app() -> Callable[..., Awaitable[None]]:
    client = _fetcher()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        data = await (await client())(body)
        headers = [(b"content-type", JSON.encode()), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    return app


def rsgi_app() -> Callable[..., Awaitable[None]]:
    client = _fetcher()

    async def app(scope: Any, proto: Any) -> None:
        body = await proto()
        data = await (await client())(body)
        proto.response_bytes(200, [("content-type", JSON)], data)

    return app
