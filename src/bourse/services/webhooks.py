"""Webhook targets and signatures.

A target must be an http or https URL whose host resolves only to allowed addresses
(checked at submit and again before each delivery; the sender connects to the very
address it checked, so a name cannot be re-pointed between the check and the
connection). A malformed URL (an unclosed or invalid ``[...]`` literal, an empty or
over-long label, a character no host name has, a port outside 1-65535) is a 400
naming ``webhook_url``, found before any name is looked up.

Unless the operator allows more, an address must be globally reachable by the IANA
IPv4 and IPv6 special-purpose address registries (:func:`is_public`), a table of our
own rather than ``ipaddress``'s ``is_global``, whose table depends on the Python
version (3.11 takes ``64:ff9b:1::/48``, ``192.0.0.0/24``, ``3fff::/20`` or
``5f00::/16`` for global). An IPv6 address must be global unicast (``2000::/3``) or
the NAT64 well-known prefix ``64:ff9b::/96``; one that embeds an IPv4 address (mapped
``::ffff:a.b.c.d``, 6to4 ``2002::/16``, NAT64 ``64:ff9b::/96``) is allowed only if the
embedded address is. Teredo, IPv4-compatible ``::a.b.c.d`` and IPv4-translated
``::ffff:0:a.b.c.d`` addresses are refused. Numeric hosts are read as the C resolver
reads them (``2130706433``, ``0177.0.0.1``, ``0x7f.1`` are 127.0.0.1).

``allow_loopback`` lets targets on this machine through (127.0.0.0/8, ``::1`` and
their mapped form; tests and local receivers); ``allow_private`` lets any unicast
address through (intranets). The unspecified address and multicast are never
targets.

The signature header is ``x-bourse-signature: t=<unix>,v1=<hex HMAC-SHA256 of
"<t>.<body>">`` with the account's webhook secret.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from bourse.domain.errors import GatewayError, invalid_request
from bourse.domain.values import immutable
from bourse.ports.webhooks import Address

MAX_URL = 2048

Resolve = Callable[[str, int], Awaitable[list[Address]]]
"""``(host, port)`` -> every address of ``host``; OSError when it does not resolve."""

_NUMERIC_V4 = re.compile(r"^[0-9a-fA-FxX.]+$")
_LABEL = re.compile(r"^[A-Za-z0-9_-]{1,63}$")
"""One label of a host name once IDNA-encoded (``_`` too: some resolvers serve it)."""
MAX_HOST = 253
"""The longest host name (RFC 1035), without its final dot."""


def _v4(*nets: str) -> tuple[ipaddress.IPv4Network, ...]:
    return tuple(ipaddress.IPv4Network(n) for n in nets)


def _v6(*nets: str) -> tuple[ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.IPv6Network(n) for n in nets)


# The IANA IPv4 Special-Purpose Address Registry: the blocks that are not globally
# reachable (multicast 224.0.0.0/4 is refused on its own), and the ones inside them
# that are. 192.88.99.0/24 (6to4 relay anycast) is deprecated (RFC 7526): no target.
_V4_NOT_GLOBAL = _v4(
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15",
    "198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4",
)  # fmt: skip
_V4_GLOBAL_INSIDE = _v4("192.0.0.9/32", "192.0.0.10/32")
# IPv6: only global unicast (2000::/3) is routed on the internet; inside it, the IANA
# IPv6 Special-Purpose Address Registry's blocks that are not globally reachable
# (2001::/23 holds Teredo 2001::/32, benchmarking 2001:2::/48 and ORCHID 2001:10::/28),
# and the ones inside those that are (anycast, AMT, AS112, ORCHIDv2, drone ids).
_V6_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")
_V6_NOT_GLOBAL = _v6("2001::/23", "2001:db8::/32", "3fff::/20")
_V6_GLOBAL_INSIDE = _v6(
    "2001:1::1/128", "2001:1::2/128", "2001:1::3/128", "2001:3::/32", "2001:4:112::/48", "2001:20::/28",
    "2001:30::/28",
)  # fmt: skip
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
"""The NAT64 well-known prefix: the IPv4 address in its last 32 bits is the destination
(the local-use ``64:ff9b:1::/48`` is outside ``2000::/3``: refused)."""
_6TO4 = ipaddress.IPv6Network("2002::/16")
# IPv6 forms that carry an IPv4 address in their last 32 bits and have no property of
# their own in ``ipaddress`` (mapped, 6to4 and Teredo do)
_V4_IN_LOW_BITS = (
    ipaddress.IPv6Network("::/96"),  # IPv4-compatible (deprecated)
    _NAT64,
    ipaddress.IPv6Network("::ffff:0:0:0/96"),  # IPv4-translated (SIIT)
)


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


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one reaches (through mapping, 6to4, Teredo, NAT64...)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if int(ip) > 1 and any(ip in net for net in _V4_IN_LOW_BITS):  # not :: nor ::1
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(ip: Address) -> bool:
    """Whether ``ip`` is globally reachable by the IANA special-purpose address registries
    (an IPv6 address that embeds an IPv4 one through NAT64 or 6to4: whether that one is)."""
    if isinstance(ip, ipaddress.IPv4Address):
        if ip.is_multicast:
            return False
        return not any(ip in net for net in _V4_NOT_GLOBAL) or any(ip in net for net in _V4_GLOBAL_INSIDE)
    if ip.ipv4_mapped is not None:
        return is_public(ip.ipv4_mapped)
    if ip in _NAT64:
        return is_public(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    if ip not in _V6_GLOBAL_UNICAST:
        return False
    if ip in _6TO4:
        return ip.sixtofour is not None and is_public(ip.sixtofour)
    return not any(ip in net for net in _V6_NOT_GLOBAL) or any(ip in net for net in _V6_GLOBAL_INSIDE)


def address_allowed(ip: Address, *, allow_private: bool, allow_loopback: bool) -> bool:
    """Whether a webhook may connect to ``ip`` (see the module docstring)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # the same host as the IPv4 address
            return address_allowed(ip.ipv4_mapped, allow_private=allow_private, allow_loopback=allow_loopback)
        inner = embedded_ipv4(ip)
        if inner is not None and not address_allowed(
            inner, allow_private=allow_private, allow_loopback=False
        ):
            return False
    if ip.is_unspecified or ip.is_multicast:
        return False
    if ip.is_loopback:
        return allow_loopback or allow_private
    if allow_private:
        return True
    return is_public(ip)


async def system_resolve(host: str, port: int) -> list[Address]:
    """The system resolver (``getaddrinfo``), every TCP address of ``host``."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except ValueError:  # its IDNA step (UnicodeError): a name :func:`check_target` lets through
        raise OSError(f"{host!r} is not a name the resolver takes") from None
    return [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]


def literal_address(host: str) -> Address | None:
    """``host`` as an address if it is one, read as the C resolver reads numbers."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if _NUMERIC_V4.match(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


@immutable
class Target:
    """A checked webhook target: where to connect, and what to say in ``Host``/SNI."""

    scheme: str
    host: str
    port: int
    addresses: tuple[Address, ...]
    """Every address the host resolved to, all allowed; connect to these only."""
    host_header: str


def _refuse(why: str) -> GatewayError:
    return invalid_request(f"webhook_url: {why}", param="webhook_url")


def _shown(text: str) -> str:
    """``text`` quoted for a message, at most 80 characters of it."""
    return repr(text if len(text) <= 80 else text[:80] + "...")


def _parse(url: str) -> tuple[str, str, int, str]:
    """``(scheme, host, port, netloc)`` of a well-formed http(s) URL; 400 for anything else.
    The host is checked here rather than left to the resolver, which raises UnicodeError
    or ValueError (not OSError) for an empty or over-long label."""
    if len(url) > MAX_URL:
        raise _refuse(f"longer than {MAX_URL} characters")
    if any(c.isspace() or not c.isprintable() for c in url):  # urlsplit drops tabs and newlines
        raise _refuse("contains whitespace or control characters")
    try:
        parts = urlsplit(url)
    except ValueError:  # an unclosed or invalid [...] literal
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise _refuse("expected an http:// or https:// URL with a host")
    netloc = parts.netloc
    if "@" in netloc:
        raise _refuse("credentials in the URL are not allowed")
    host, port_text = _split_netloc(netloc)
    if not netloc.startswith("["):  # Host and SNI carry the ASCII (IDNA) form of a name
        netloc = host + (f":{port_text}" if port_text else "")
    if port_text:
        if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
            raise _refuse(f"the port {_shown(port_text)} is not valid (1 to 65535)")
        port = int(port_text)
    else:
        port = 443 if parts.scheme == "https" else 80
    return parts.scheme, host, port, netloc


def _split_netloc(netloc: str) -> tuple[str, str]:
    """The host and the port text of ``netloc``, the host checked: an IPv6 address in
    ``[...]`` (a zone as ``%25…``), an IPv4 address or a host name (its ASCII form)."""
    if netloc.startswith("["):
        end = netloc.find("]")
        inner, rest = (netloc[1:end], netloc[end + 1 :]) if end > 0 else ("", "")
        address = inner.replace("%25", "%", 1)
        try:
            ipaddress.IPv6Address(address)
        except ValueError:
            raise _refuse(f"{_shown(netloc)} is not an IPv6 address in [...]") from None
        if rest and not rest.startswith(":"):
            raise _refuse(f"unexpected {_shown(rest)} after the address {_shown(netloc[: end + 1])}")
        return address.lower(), rest[1:]
    host, _, port_text = netloc.partition(":")
    if ":" in port_text:
        raise _refuse("an IPv6 address must be written in [...]")
    host = host.lower()
    if literal_address(host) is None:
        host = _checked_name(host)
    return host, port_text


def _checked_name(host: str) -> str:
    """``host`` as ASCII (IDNA); 400 unless it is a host name the resolver can take: at
    most 253 characters, labels of 1 to 63 letters, digits, ``-`` or ``_`` (one final
    dot allowed)."""
    if not host:
        raise _refuse("expected an http:// or https:// URL with a host")
    name = host[:-1] if host.endswith(".") else host
    try:
        ascii_name = name.encode("idna").decode("ascii")
    except UnicodeError:
        ascii_name = ""  # an empty label, one over 63 characters, or a character IDNA refuses
    if (
        not ascii_name
        or len(ascii_name) > MAX_HOST
        or not all(_LABEL.match(label) for label in ascii_name.split("."))
    ):
        raise _refuse(
            f"the host {_shown(host)} is not a valid host name (at most {MAX_HOST} characters; "
            "labels of 1 to 63 letters, digits, '-' or '_', separated by single dots)"
        )
    return ascii_name.lower() + ("." if host.endswith(".") else "")


async def check_target(
    url: str, *, allow_private: bool, allow_loopback: bool = False, resolve: Resolve = system_resolve
) -> Target:
    """The target of ``url``; 400 unless it is an http(s) URL whose host resolves
    (once, through ``resolve``) only to allowed addresses."""
    scheme, host, port, netloc = _parse(url)
    literal = literal_address(host)
    if literal is not None:
        addrs = [literal]
    else:
        try:
            addrs = await resolve(host, port)
        except OSError:
            addrs = []
        if not addrs:
            raise invalid_request(f"webhook_url: the host {host!r} does not resolve", param="webhook_url")
    for ip in addrs:
        if not address_allowed(ip, allow_private=allow_private, allow_loopback=allow_loopback):
            raise invalid_request(
                f"webhook_url: {host} resolves to {ip}, a private, loopback, link-local or otherwise "
                "non-public address; webhooks go to public addresses only (an operator may allow "
                "private ones in [jobs])",
                param="webhook_url",
            )
    return Target(scheme, host, port, tuple(addrs), netloc)
