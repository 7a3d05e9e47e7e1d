"""Webhook targets: every address form that reaches a non-public host is refused, at
submit and again before delivery, and delivery connects to the address it checked.

Network rule, kept even if the guard under test were broken: names never reach a real
resolver (a table resolver maps each test name to the address under test) and the
sender's transport refuses every destination outside 127.0.0.0/8 and ::1 (it records
the attempt instead of connecting). The only real connections go to a receiver on
127.0.0.1.

Before the fix, carrier-grade NAT (``100.64.0.0/10``, with the metadata address
100.100.100.200), 6to4 ``2002::/16`` embedding 127.0.0.1 or 169.254.169.254, IPv4-compatible,
NAT64 and IPv4-translated forms, site-local, multicast and benchmarking addresses passed
both checks, and the sender looked the name up again when it connected.
"""

from __future__ import annotations

import ipaddress
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import GatewayError
from bourse.outbound.webhook_http import HttpWebhookSender
from bourse.ports.webhooks import Address
from bourse.services.webhooks import address_allowed, check_target
from tests.faults.webhook_rig import LoopbackOnly, TableResolver
from tests.support.gateway import Gateway, running_gateway
from tests.support.servers import serve_app_in_thread

FORBIDDEN: list[tuple[str, str, str]] = [
    # (case, host as written in the URL, the address it reaches)
    ("loopback", "127.0.0.1", "127.0.0.1"),
    ("loopback-net", "127.1.2.3", "127.1.2.3"),
    ("loopback-decimal", "2130706433", "127.0.0.1"),
    ("loopback-octal", "0177.0.0.1", "127.0.0.1"),
    ("loopback-hex", "0x7f.0.0.1", "127.0.0.1"),
    ("loopback-short", "127.1", "127.0.0.1"),
    ("ipv6-loopback", "[::1]", "::1"),
    ("mapped-loopback", "[::ffff:127.0.0.1]", "::ffff:127.0.0.1"),
    ("mapped-metadata", "[::ffff:169.254.169.254]", "::ffff:169.254.169.254"),
    ("mapped-private", "[::ffff:10.0.0.1]", "::ffff:10.0.0.1"),
    ("6to4-loopback", "[2002:7f00:1::]", "2002:7f00:1::"),
    ("6to4-metadata", "[2002:a9fe:a9fe::1]", "2002:a9fe:a9fe::1"),
    ("6to4-cgnat", "[2002:6464:64c8::]", "2002:6464:64c8::"),
    ("teredo-loopback", "[2001:0:4136:e378:8000:63bf:80ff:fffe]", "2001:0:4136:e378:8000:63bf:80ff:fffe"),
    ("v4-compatible-loopback", "[::7f00:1]", "::7f00:1"),
    ("nat64-metadata", "[64:ff9b::a9fe:a9fe]", "64:ff9b::a9fe:a9fe"),
    ("nat64-loopback", "[64:ff9b::7f00:1]", "64:ff9b::7f00:1"),
    ("translated-metadata", "[::ffff:0:a9fe:a9fe]", "::ffff:0:a9fe:a9fe"),
    ("cgnat", "100.64.0.1", "100.64.0.1"),
    ("cgnat-metadata", "100.100.100.200", "100.100.100.200"),
    ("cgnat-last", "100.127.255.254", "100.127.255.254"),
    ("metadata", "169.254.169.254", "169.254.169.254"),
    ("link-local", "169.254.0.1", "169.254.0.1"),
    ("ipv6-link-local", "[fe80::1]", "fe80::1"),
    ("ipv6-link-local-zone", "[fe80::1%25eth0]", "fe80::1"),
    ("private-10", "10.0.0.1", "10.0.0.1"),
    ("private-172", "172.16.0.1", "172.16.0.1"),
    ("private-192", "192.168.1.1", "192.168.1.1"),
    ("unique-local", "[fc00::1]", "fc00::1"),
    ("aws-ipv6-metadata", "[fd00:ec2::254]", "fd00:ec2::254"),
    ("site-local", "[fec0::1]", "fec0::1"),
    ("unspecified", "0.0.0.0", "0.0.0.0"),
    ("unspecified-short", "0", "0.0.0.0"),
    ("ipv6-unspecified", "[::]", "::"),
    ("multicast", "224.0.0.1", "224.0.0.1"),
    ("ipv6-multicast", "[ff02::1]", "ff02::1"),
    ("broadcast", "255.255.255.255", "255.255.255.255"),
    ("reserved", "240.0.0.1", "240.0.0.1"),
    ("benchmarking", "198.18.0.1", "198.18.0.1"),
    ("documentation", "192.0.2.1", "192.0.2.1"),
    ("ipv6-documentation", "[2001:db8::1]", "2001:db8::1"),
    # special-purpose ranges that Python 3.11's ``is_global`` takes for global (the IANA
    # IPv4 and IPv6 special-purpose address registries say they are not)
    ("nat64-local-use-metadata", "[64:ff9b:1::a9fe:a9fe]", "64:ff9b:1::a9fe:a9fe"),
    ("nat64-local-use-public", "[64:ff9b:1::808:808]", "64:ff9b:1::808:808"),
    ("nat64-local-use-end", "[64:ff9b:1:ffff:ffff:ffff:ffff:ffff]", "64:ff9b:1:ffff:ffff:ffff:ffff:ffff"),
    ("ietf-protocol-dummy", "192.0.0.8", "192.0.0.8"),
    ("ietf-protocol", "192.0.0.100", "192.0.0.100"),
    ("ietf-protocol-last", "192.0.0.255", "192.0.0.255"),
    ("mapped-ietf-protocol", "[::ffff:192.0.0.100]", "::ffff:c000:64"),
    ("6to4-ietf-protocol", "[2002:c000:64::1]", "2002:c000:64::1"),
    ("nat64-ietf-protocol", "[64:ff9b::c000:64]", "64:ff9b::c000:64"),
    ("6to4-relay-anycast", "192.88.99.1", "192.88.99.1"),
    ("this-network", "0.1.2.3", "0.1.2.3"),
    ("benchmarking-last", "198.19.255.254", "198.19.255.254"),
    ("ipv6-documentation-3fff", "[3fff::1]", "3fff::1"),
    ("srv6-sid", "[5f00::1]", "5f00::1"),
    ("ipv6-dummy-prefix", "[100:0:0:1::1]", "100:0:0:1::1"),
    ("ipv6-discard", "[100::1]", "100::1"),
    ("ipv6-unallocated", "[4000::1]", "4000::1"),
    ("ipv6-ietf-reserved", "[::1:2:3:4]", "::1:2:3:4"),
    ("v4-compatible-public", "[::808:808]", "::808:808"),
    ("translated-public", "[::ffff:0:808:808]", "::ffff:0:808:808"),
    ("teredo-public", "[2001:0:4136:e378:8000:63bf:f7f7:f7f7]", "2001:0:4136:e378:8000:63bf:f7f7:f7f7"),
    ("ipv6-benchmarking", "[2001:2::1]", "2001:2::1"),
    ("orchid-deprecated", "[2001:10::1]", "2001:10::1"),
    ("ipv6-ietf-protocol", "[2001:100::1]", "2001:100::1"),
]
PUBLIC = [
    "8.8.8.8", "2001:4860:4860::8888", "64:ff9b::808:808", "2002:808:808::", "::ffff:8.8.8.8",
    # globally reachable by the registries, inside blocks that are not
    "192.0.0.9", "192.0.0.10", "2001:1::1", "2001:3::1", "2001:4:112::1", "2001:20::1",
    "192.31.196.1", "192.52.193.1", "192.175.48.1", "2620:4f:8000::1",
]  # fmt: skip
"""Public addresses: allowed by the guard; the test transport never connects to them."""
IDS = [case for case, _, _ in FORBIDDEN]
CONFIG = """
[products.one]
[[products.one.deployments]]
engine = "sim"
slots = 8

[jobs]
webhook_attempts = 2
webhook_backoff_s = 0.05
sweep_interval_s = 0.1
"""


def _ip(text: str) -> Address:
    return ipaddress.ip_address(text)


async def _no_dns(host: str, port: int) -> list[Address]:
    raise AssertionError(f"a literal address must not be looked up ({host})")


# -- the guard itself ------------------------------------------------------------------------


@pytest.mark.parametrize(("case", "host", "address"), FORBIDDEN, ids=IDS)
def test_the_guard_refuses_every_non_public_form(case: str, host: str, address: str) -> None:
    ip = _ip(address)
    assert not address_allowed(ip, allow_private=False, allow_loopback=False), case
    with pytest.raises(GatewayError) as info:
        anyio.run(lambda: check_target(f"http://{host}:8080/hook", allow_private=False, resolve=_no_dns))
    assert info.value.status == 400 and info.value.param == "webhook_url", info.value
    # the same address behind a name
    table = TableResolver()
    table.add("target.test", [_ip("8.8.8.8"), ip])
    with pytest.raises(GatewayError):
        anyio.run(lambda: check_target("https://target.test/hook", allow_private=False, resolve=table))


def test_the_guard_allows_public_addresses_and_loopback_only_when_asked() -> None:
    for text in PUBLIC:
        assert address_allowed(_ip(text), allow_private=False, allow_loopback=False), text
    for text in ("127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1"):
        assert address_allowed(_ip(text), allow_private=False, allow_loopback=True), text
    # embedding 127.0.0.1 in a routed IPv6 form does not make it this machine
    for text in ("2002:7f00:1::", "::7f00:1", "64:ff9b::7f00:1", "2001:0:4136:e378:8000:63bf:80ff:fffe"):
        assert not address_allowed(_ip(text), allow_private=False, allow_loopback=True), text
    # never the unspecified address (it reaches this machine) nor multicast
    for text in ("0.0.0.0", "::", "224.0.0.1", "ff02::1"):
        assert not address_allowed(_ip(text), allow_private=True, allow_loopback=True), text
    target = anyio.run(
        lambda: check_target("http://2130706433:9/x", allow_private=False, allow_loopback=True)
    )
    assert target.addresses == (_ip("127.0.0.1"),), target


# -- the sender: resolve once, connect to what was checked ----------------------------------


def test_the_sender_connects_to_the_checked_address_with_the_name_in_host_and_sni() -> None:
    table = TableResolver()
    table.add("public.test", [_ip("8.8.8.8")])
    transport = LoopbackOnly(fake_status=204)
    sender = HttpWebhookSender(transport=transport, resolve=table)

    async def run() -> int:
        try:
            return await sender.post("https://public.test:8443/hook?x=1", b"{}", {"x-test": "1"})
        finally:
            await sender.aclose()

    assert anyio.run(run) == 204
    assert table.lookups("public.test") == 1, "one lookup per delivery"
    [sent] = transport.refused  # answered by the fake, never connected
    assert (sent.url.host, sent.url.port, sent.url.raw_path) == ("8.8.8.8", 8443, b"/hook?x=1"), sent.url
    assert sent.headers["host"] == "public.test:8443", sent.headers
    assert sent.extensions.get("sni_hostname") == "public.test", sent.extensions


@pytest.mark.parametrize(("case", "host", "address"), FORBIDDEN, ids=IDS)
def test_the_sender_refuses_a_name_that_now_resolves_to_a_forbidden_address(
    case: str, host: str, address: str
) -> None:
    table = TableResolver()
    table.add("rebind.test", [_ip(address)])
    transport = LoopbackOnly(fake_status=204)
    sender = HttpWebhookSender(transport=transport, resolve=table)

    async def run() -> None:
        try:
            with pytest.raises(OSError):
                await sender.post("http://rebind.test:8080/hook", b"{}", {})
            with pytest.raises(OSError):
                await sender.post(f"http://{host}:8080/hook", b"{}", {})
        finally:
            await sender.aclose()

    anyio.run(run)
    assert transport.refused == [], [str(r.url) for r in transport.refused]


# -- a served gateway: refused at submit, refused at delivery --------------------------------


@dataclass
class Rig:
    gw: Gateway
    table: TableResolver
    transport: LoopbackOnly
    http: httpx.Client

    def submit(self, webhook_url: str) -> httpx.Response:
        doc = {"endpoint": "/v1/chat/completions", "webhook_url": webhook_url,
               "body": {"model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}  # fmt: skip
        return self.http.post("/v1/jobs", json=doc)

    def webhook_state(self, job_id: str) -> str:
        db = Path(self.gw.data_dir) / "bourse.db"
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            row = conn.execute("SELECT webhook_state FROM jobs WHERE id = ?", (job_id,)).fetchone()
        assert row is not None, job_id
        return str(row[0])


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    with running_gateway(CONFIG) as gw:
        table, transport = TableResolver(), LoopbackOnly()
        gw.container.jobs.sender = HttpWebhookSender(transport=transport, resolve=table)
        auth = {"authorization": f"Bearer {gw.api_key}"}
        with httpx.Client(base_url=gw.url, headers=auth, timeout=30) as http:
            yield Rig(gw, table, transport, http)
        assert transport.refused == [], [str(r.url) for r in transport.refused]


def _assert_refused(r: httpx.Response, what: str) -> None:
    assert r.status_code == 400, (what, r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == "webhook_url", (what, err)


def test_every_form_is_refused_at_submit(rig: Rig) -> None:
    for case, host, address in FORBIDDEN:
        _assert_refused(rig.submit(f"http://{host}:8080/hook/{case}"), case)
        rig.table.add(f"{case}.test", [_ip(address)])
        _assert_refused(rig.submit(f"http://{case}.test:8080/hook"), case + " (by name)")
        # one forbidden address among public ones is enough
        rig.table.add(f"mixed-{case}.test", [_ip("8.8.8.8"), _ip(address)])
        _assert_refused(rig.submit(f"https://mixed-{case}.test/hook"), case + " (among others)")
    assert rig.transport.refused == []


def test_every_form_is_refused_before_delivery(rig: Rig) -> None:
    """Names that resolved to a public address at submit resolve to the address under test
    when the job ends: no delivery is attempted, the webhook ends ``failed``."""
    jobs: dict[str, str] = {}
    for case, _, address in FORBIDDEN:
        name = f"late-{case}.test"
        rig.table.add(name, [_ip("8.8.8.8")], [_ip(address)])
        r = rig.submit(f"http://{name}:8080/hook")
        assert r.status_code == 202, (case, r.text)
        jobs[case] = r.json()["id"]
    deadline = time.monotonic() + 30
    pending = dict(jobs)
    while pending and time.monotonic() < deadline:
        pending = {c: j for c, j in pending.items() if rig.webhook_state(j) != "failed"}
        time.sleep(0.05)
    assert not pending, {c: rig.webhook_state(j) for c, j in pending.items()}
    for case in jobs:
        assert rig.table.lookups(f"late-{case}.test") >= 2, case
    assert rig.transport.refused == [], [str(r.url) for r in rig.transport.refused]


def test_a_loopback_receiver_gets_the_pinned_delivery_when_loopback_is_allowed() -> None:
    got: list[tuple[str, str]] = []

    async def hook(request: Request) -> Response:
        got.append((request.headers["host"], request.url.path))
        return Response(status_code=204)

    receiver = Starlette(routes=[Route("/hook", hook, methods=["POST"])])
    with serve_app_in_thread(receiver) as url:
        port = int(url.rsplit(":", 1)[1])
        table = TableResolver()
        table.add("hooks.test", [_ip("127.0.0.1")])
        transport = LoopbackOnly()
        sender = HttpWebhookSender(transport=transport, resolve=table, allow_loopback=True)

        async def run() -> int:
            try:
                return await sender.post(f"http://hooks.test:{port}/hook", b"{}", {})
            finally:
                await sender.aclose()

        assert anyio.run(run) == 204
    assert got == [(f"hooks.test:{port}", "/hook")], got
    assert transport.refused == []
