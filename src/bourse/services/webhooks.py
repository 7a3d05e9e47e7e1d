"""Webhook targets and signatures.

A target must be http or https. Unless the operator allows it, every address the
host resolves to must be public: private, loopback, link-local, multicast,
reserved and unspecified ranges are refused (checked at submit and again before
each delivery, against DNS rebinding). The signature header is
``x-bourse-signature: t=<unix>,v1=<hex HMAC-SHA256 of "<t>.<body>">`` with the
account's webhook secret.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import socket
from urllib.parse import urlsplit

from bourse.domain.errors import invalid_request

MAX_URL = 2048


def sign(secret: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(secret: str, header: str, body: bytes) -> bool:
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        t = int(parts["t"])
    except (KeyError, ValueError):
        return False
    return hmac.compare_digest(sign(secret, t, body), header)


def _public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


async def check_target(url: str, *, allow_private: bool, allow_loopback: bool = False) -> None:
    """400 unless ``url`` is an http(s) URL whose host resolves only to allowed addresses."""
    if len(url) > MAX_URL:
        raise invalid_request(f"webhook_url: longer than {MAX_URL} characters", param="webhook_url")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise invalid_request(
            "webhook_url: expected an http:// or https:// URL with a host", param="webhook_url"
        )
    if parts.username or parts.password:
        raise invalid_request("webhook_url: credentials in the URL are not allowed", param="webhook_url")
    host = parts.hostname
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise invalid_request("webhook_url: the port is not valid", param="webhook_url") from None
    try:
        addrs = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:
            raise invalid_request(
                f"webhook_url: the host {host!r} does not resolve", param="webhook_url"
            ) from None
        addrs = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
    if allow_private:
        return
    for ip in addrs:
        if allow_loopback and ip.is_loopback:
            continue
        if not _public(ip):
            raise invalid_request(
                f"webhook_url: {host} resolves to {ip}, a private, loopback or link-local address; "
                "webhooks go to public addresses only (an operator may allow private ones in [jobs])",
                param="webhook_url",
            )
