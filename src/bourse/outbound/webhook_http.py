"""Webhook delivery over HTTP (httpx): the target checked and pinned, no redirects
followed, short timeouts.

Each POST resolves the URL's host once (through ``resolve``, the system resolver by
default), checks every address with :func:`bourse.services.webhooks.check_target`
and connects to a checked address itself: the request goes to ``http(s)://<address>``
with the original ``Host`` header and, over TLS, the original name as SNI (the
certificate is verified against the name). No second lookup happens, so a name that
is re-pointed between the check and the connection (DNS rebinding) still reaches
only the checked address. Connections are not kept alive, so one verified for one
name is never reused for another on the same address.
"""

from __future__ import annotations

import httpx

from bourse.domain.errors import GatewayError
from bourse.ports.webhooks import Address
from bourse.services.webhooks import Resolve, Target, check_target, system_resolve


class WebhookRefused(OSError):
    """The target's host resolved to an address webhooks may not reach."""


class HttpWebhookSender:
    def __init__(
        self,
        timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        allow_private: bool = False,
        allow_loopback: bool = False,
        resolve: Resolve = system_resolve,
    ) -> None:
        self._client = httpx.AsyncClient(
            timeout=timeout_s, follow_redirects=False, trust_env=False, transport=transport,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=0),
        )  # fmt: skip
        self._resolve = resolve
        self._allow_private = allow_private
        self._allow_loopback = allow_loopback

    async def resolve(self, host: str, port: int) -> list[Address]:
        return await self._resolve(host, port)

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        try:
            target = await check_target(
                url, allow_private=self._allow_private, allow_loopback=self._allow_loopback,
                resolve=self._resolve,
            )  # fmt: skip
        except GatewayError as exc:
            raise WebhookRefused(exc.message) from None
        last: httpx.HTTPError | None = None
        for address in target.addresses:
            try:
                request = _pinned(self._client, target, address, url, body, headers)
                r = await self._client.send(request, stream=True)  # the answer's body is not read
            except httpx.ConnectError as exc:  # the next address, if any
                last = exc
                continue
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                raise OSError(f"webhook delivery failed: {type(exc).__name__}") from None
            await r.aclose()
            return r.status_code
        raise OSError(f"webhook delivery failed: {type(last).__name__}")

    async def aclose(self) -> None:
        await self._client.aclose()


def _pinned(
    client: httpx.AsyncClient,
    target: Target,
    address: Address,
    url: str,
    body: bytes,
    headers: dict[str, str],
) -> httpx.Request:
    """The POST to ``url`` addressed to ``address`` (Host and SNI keep the name)."""
    pinned = httpx.URL(url).copy_with(host=str(address))
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else None
    return client.build_request(
        "POST", pinned, content=body, headers={**headers, "host": target.host_header}, extensions=extensions
    )
