"""The webhook port: deliver one signed POST; the caller retries."""

from __future__ import annotations

from typing import Protocol


class WebhookSender(Protocol):
    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        """POST ``body``; the HTTP status. Raises OSError-like errors when unreachable."""
        ...

    async def aclose(self) -> None: ...
