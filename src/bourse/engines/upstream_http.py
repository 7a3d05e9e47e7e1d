"""The openai engine's upstream HTTP/1.1 client: aiohttp's connector (its keep-alive pool,
its limit) and its C response parser, driven directly, without ``ClientSession``.

A request takes a connection from the connector, writes its head and body in one write,
and waits on the connection's protocol for the response head (``ResponseHandler.read``:
the parsed head and a ``StreamReader`` of the body). That is what ``ClientSession``
does under its request machinery (a ``ClientRequest`` and a ``ClientResponse`` built a
request, header multidicts, cookies, traces, timers, middlewares), which costs about as
much CPU as the rest of the exchange: on a bare pass-through app the server spent 117
µs a request with ``ClientSession`` against 55 with this (docs/design.md, "The stack's
alternatives, measured").

Giving up is closing the connection: a request cancelled (or timed out) at any point
before it is read to its end closes its transport, so the upstream sees the client go
at once, whether it has answered its head or not. A response read to its end goes
back to the pool (:meth:`UpstreamResponse.release`) unless the upstream asked to close.

Its failures are aiohttp's (``ClientError`` and its ``ServerTimeoutError`` /
``ConnectionTimeoutError``), as ``ClientSession`` raises them; a malformed head is a
:class:`MalformedAnswer`. It leans on aiohttp's internals (``TCPConnector.connect`` with
a ``ClientRequest`` as the connection's key, and its ``_get`` of a pooled connection by
that request's ``connection_key``; ``ResponseHandler.set_response_params`` and
``read``), so pyproject.toml caps aiohttp below its next minor release, and
``tests/unit/engines/test_upstream_http.py`` checks it over real sockets.
"""

from __future__ import annotations

import asyncio

import aiohttp
import yarl
from aiohttp.client_proto import ResponseHandler
from aiohttp.client_reqrep import ClientRequest
from aiohttp.connector import Connection
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader

from bourse.engines.upstream_reads import lean

__all__ = ["MalformedAnswer", "Target", "UpstreamClient", "UpstreamResponse", "header_value"]

_READ_BUFSIZE = 2**16
"""As ``ClientSession``'s default: the body buffered before the socket's reads pause."""
_FORBIDDEN = str.maketrans("", "", "\r\n\x00")


class MalformedAnswer(aiohttp.ClientError):
    """The upstream's answer is not HTTP the parser can read (its message says why)."""


class Target:
    """A method and a URL, as the request line, ``host`` and the client's fixed headers
    (made once: the engine's generation routes are built once per client)."""

    __slots__ = ("head", "key", "method", "pool_key")

    def __init__(self, method: str, url: yarl.URL, key: ClientRequest, fixed: bytes) -> None:
        self.method = method
        self.key = key
        """The connector's key for the connection (host, port, TLS): an unsent ``ClientRequest``."""
        self.pool_key = key.connection_key
        """Its pool's key (a property the connector would compute again for each request)."""
        path = url.raw_path_qs or "/"
        self.head = f"{method} {path} HTTP/1.1\r\n".encode() + fixed


class UpstreamResponse:
    """A response whose head has arrived: its status, its headers, its body as aiohttp's
    ``StreamReader`` (``content``). End it with :meth:`release` once the body is read to
    its end, else with :meth:`close` (which drops the connection)."""

    __slots__ = ("_connection", "content", "headers", "status")

    def __init__(self, connection: Connection, status: int, headers: object, content: StreamReader) -> None:
        self._connection = connection
        self.status = status
        self.headers = headers
        self.content = content

    async def read(self) -> bytes:
        """The whole body (to its end; the connection then goes back with :meth:`release`)."""
        return await self.content.read()

    def release(self) -> None:
        """The body was read to its end: the connection goes back to the pool (closed instead
        if the upstream asked, or if anything of it is left unread)."""
        self._connection.release()

    def close(self) -> None:
        """Drop the connection: the upstream sees it close."""
        self._connection.close()


class UpstreamClient:
    """One keep-alive pool of up to ``max_connections`` (aiohttp's ``TCPConnector``, made
    inside the running loop on first use) and the headers sent with every request.
    ``connect_timeout_s`` bounds a new connection's TCP connect; ``read_timeout_s`` each
    silence of the upstream from the request's write on (``ServerTimeoutError``)."""

    def __init__(
        self,
        headers: dict[str, str],
        *,
        max_connections: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        keepalive_timeout_s: float = 30.0,
    ) -> None:
        self._fixed = "".join(f"{k}: {header_value(v)}\r\n" for k, v in headers.items())
        self._max_connections = max_connections
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self._read_timeout_s = read_timeout_s
        self._keepalive_timeout_s = keepalive_timeout_s
        self._connector: aiohttp.TCPConnector | None = None
        self._keys: dict[tuple[str, str | None, int | None], ClientRequest] = {}

    @property
    def connector(self) -> aiohttp.TCPConnector:
        """The pool (made on first use, inside the running loop)."""
        if self._connector is None:
            self._connector = lean(
                aiohttp.TCPConnector(
                    limit=self._max_connections, limit_per_host=0, keepalive_timeout=self._keepalive_timeout_s
                )
            )
        return self._connector

    def target(self, method: str, url: yarl.URL) -> Target:
        """``method`` on ``url`` (absolute, http or https), ready to send."""
        origin = (url.scheme, url.raw_host, url.port)
        key = self._keys.get(origin)
        if key is None:
            key = ClientRequest(method, url.origin(), loop=asyncio.get_running_loop(), trust_env=False)
            self._keys[origin] = key
        host = f"host: {key.headers['Host']}\r\n"
        # credentials in the URL (the key's origin has none), as ClientSession sent them;
        # the client's own authorization (an api_key) wins
        auth = aiohttp.BasicAuth.from_url(url)
        extra = ""
        if auth is not None and "authorization:" not in self._fixed.lower():
            extra = f"authorization: {header_value(auth.encode())}\r\n"
        return Target(method, url, key, (host + extra + self._fixed).encode())

    async def request(
        self, target: Target, body: bytes | None = None, headers: dict[str, str] | bytes | None = None
    ) -> UpstreamResponse:
        """Send ``target`` with ``body`` and ``headers`` (besides the client's: none of them
        may repeat one of the client's; or as header lines already, each value passed
        through :func:`header_value`), and wait for the response head. Cancelled or failed,
        it closes the connection it took. A GET whose connection drops before its head is
        sent once more (as ``ClientSession`` does for idempotent methods: a kept-alive
        connection the upstream closed as it was taken)."""
        head = target.head
        if isinstance(headers, bytes):
            head += headers
        elif headers:
            head += "".join(f"{k}: {header_value(v)}\r\n" for k, v in headers.items()).encode()
        if body is not None:
            head += b"content-length: %d\r\n\r\n%b" % (len(body), body)
        else:
            head += b"\r\n"
        if target.method == "GET":
            try:
                return await self._exchange(target, head)
            except aiohttp.ClientConnectorError:
                raise
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
                pass
        return await self._exchange(target, head)

    async def _exchange(self, target: Target, head: bytes) -> UpstreamResponse:
        connector = self.connector
        try:
            # a kept-alive connection of the pool first (what connect() does first, without
            # its key made again), else connect()'s wait for a slot and a new connection
            connection = await connector._get(target.pool_key, []) or await connector.connect(
                target.key, [], self._timeout
            )
        except TimeoutError as exc:
            raise aiohttp.ConnectionTimeoutError(f"Connection timeout to host {target.key.url}") from exc
        try:
            protocol = connection.protocol
            transport = connection.transport
            if protocol is None or transport is None:
                raise aiohttp.ServerDisconnectedError()
            protocol.set_response_params(
                read_until_eof=True, read_timeout=self._read_timeout_s, read_bufsize=_READ_BUFSIZE,
                timeout_ceil_threshold=connector._timeout_ceil_threshold,
            )  # fmt: skip
            transport.write(head)
            protocol.start_timeout()
            return await _head(connection, protocol)
        except BaseException:
            connection.close()
            raise

    async def close(self) -> None:
        """Close the pool's connections (a later request opens a new pool)."""
        self._keys.clear()
        connector, self._connector = self._connector, None
        if connector is not None:
            await connector.close()


async def _head(connection: Connection, protocol: ResponseHandler) -> UpstreamResponse:
    """The response's head, past any informational (1xx) answer."""
    while True:
        try:
            message, payload = await protocol.read()
        except HttpProcessingError as exc:
            raise MalformedAnswer(f"{exc.code}, message={exc.message!r}") from exc
        if not 100 <= message.code <= 199 or message.code == 101:
            return UpstreamResponse(connection, message.code, message.headers, payload)


def header_value(value: str) -> str:
    """A header value with no line breaks or NULs (they would end the header early)."""
    return value.translate(_FORBIDDEN) if "\r" in value or "\n" in value or "\x00" in value else value
