"""The webhook port: deliver one signed POST to a checked address; the caller retries."""

from __future__ import annotations

import ipaddress
from typing import Protocol

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class WebhookSender(Protocol):
    async def resolve(self, host: str, port: int) -> list[Address]:
        """Every address ``host`` resolves to (the name service the sender connects with).
        Raises OSError when it does not resolve."""
        ...

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        """POST ``body`` to an address of ``url`` that the target check allows, resolved
        once and connected to as checked; the HTTP status. Raises OSError-like errors when
        unreachable or refused."""
        ...

    async def aclose(self) -> None: ...
