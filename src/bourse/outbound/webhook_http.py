"""Webhook delivery over HTTP (httpx): no redirects followed, short timeouts."""

from __future__ import annotations

import httpx


class HttpWebhookSender:
    def __init__(self, timeout_s: float = 10.0, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._client = httpx.AsyncClient(
            timeout=timeout_s, follow_redirects=False, trust_env=False, transport=transport,
            limits=httpx.Limits(max_connections=64),
        )  # fmt: skip

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        try:
            r = await self._client.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise OSError(f"webhook delivery failed: {type(exc).__name__}") from None
        return r.status_code

    async def aclose(self) -> None:
        await self._client.aclose()
