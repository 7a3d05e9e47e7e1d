"""A malformed webhook URL is a 400 naming ``webhook_url``, at submit, before any hold,
never a 500: unclosed or invalid ``[...]`` literals, empty, leading-dot and 64-character
labels, characters no host name has, ports outside 1-65535; and a hypothesis property
over webhook URL strings (random and malformed hosts, ports, IPv6 literals) finds no
other answer, on the check itself and through a served gateway.

Names never reach a resolver that could look them up: the test resolver runs the C
resolver's own conversion of the name (``getaddrinfo`` with ``AI_NUMERICHOST``, which
encodes the name as the real lookup does and then answers only numeric hosts), so a
name that would make the real resolver raise something other than ``OSError`` is
found offline; the gateway's sender connects to loopback only.

Before the fix, ``http://a..b/``, ``http://.x/`` and a 64-character label raised
``UnicodeError`` from the resolver's IDNA step, ``http://[::1/`` and ``http://[zz]/``
``ValueError`` from ``urlsplit``: 500 ``internal_error``. ``http://[v1.x]/`` was looked
up as the name ``v1.x``, ``http://[::1]x/`` was read as ``[::1]``, and port 0 became 80.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bourse.domain.errors import GatewayError
from bourse.outbound.webhook_http import HttpWebhookSender
from bourse.ports.webhooks import Address
from bourse.services.webhooks import Target, check_target
from tests.faults.webhook_rig import LoopbackOnly
from tests.support.gateway import Gateway, running_gateway

CONFIG = """
[server]
log_level = "warning"

[products.one]
[[products.one.deployments]]
engine = "sim"
slots = 8

[jobs]
webhook_attempts = 1
sweep_interval_s = 0.2
"""

MALFORMED = [
    "http://a..b/",
    "http://[::1/",
    "http://[zz]/",
    "http://.x/",
    "http://" + "a" * 64 + ".example/",
    "http://" + "a" * 64 + "/",
    "http://" + ".".join(["abcdefghi"] * 26) + "/",  # 259 characters: over 253
    "http://[v1.x]/",
    "http://[::1]x/",
    "http://[::1]:x/",
    "http://[]/",
    "http://[/",
    "http://]/",
    "http://::1/",
    "http://a:b:c/",
    "http://x:0/",
    "http://x:65536/",
    "http://x:-1/",
    "http://x:+80/",
    "http://x:8%30/",
    "http://a b/",
    "http://a\tb/",
    "http://exa\nmple.test/",
    "http://x/\r\nx-injected: 1",
    "http://a%00b/",
    "http://a\x00b/",
    "http://a/b\x7f",
    "http://\u00e9\u0301" + "x" * 70 + "/",
    "http://xn--a.\u00fc/",
    "http://a_b$/",
    "http://@/",
    "http://user@x.test/",
    "http:x.test",
    "ftp://x.test/",
    "//x.test/",
    "",
]
"""Each one is a 400 naming ``webhook_url``."""


async def offline_resolve(host: str, port: int) -> list[Address]:
    """The C resolver's conversion of ``host`` (IDNA, as ``getaddrinfo`` does it), never a
    lookup: ``AI_NUMERICHOST`` answers numeric hosts only, so every name ends in OSError."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    return [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]


async def _public(host: str, port: int) -> list[Address]:
    return [ipaddress.ip_address("8.8.8.8")]


def _check(url: str) -> Target:
    return anyio.run(lambda: check_target(url, allow_private=False, resolve=offline_resolve))


@pytest.mark.parametrize("url", MALFORMED)
def test_the_check_answers_a_malformed_url_with_a_400(url: str) -> None:
    with pytest.raises(GatewayError) as info:
        _check(url)
    err = info.value
    assert err.status == 400 and err.param == "webhook_url", (url, err.status, err.message)
    assert err.message.startswith("webhook_url: "), err.message
    assert len(err.message) < 400, err.message  # the URL is not echoed at length


def test_well_formed_urls_still_pass() -> None:
    for url, host, port in [
        ("https://8.8.8.8/hook", "8.8.8.8", 443),
        ("http://[2001:4860:4860::8888]:8080/h?x=1#f", "2001:4860:4860::8888", 8080),
        ("http://8.8.8.8:/h", "8.8.8.8", 80),
        ("HTTPS://8.8.8.8:65535", "8.8.8.8", 65535),
    ]:
        target = _check(url)
        assert (target.host, target.port) == (host, port), (url, target)
    # a name's Host and SNI are its ASCII form
    target = anyio.run(
        partial(check_target, "https://B\u00fccher.example:8443/h", allow_private=False, resolve=_public)
    )
    assert (target.host, target.host_header) == ("xn--bcher-kva.example", "xn--bcher-kva.example:8443"), (
        target
    )
    # a name passes the syntax check and is then looked up (here: offline, so it does not resolve)
    for url in ["https://hooks.example.com./h", "http://a-b_c.example:1/", "http://b\u00fccher.example/"]:
        with pytest.raises(GatewayError) as info:
            _check(url)
        assert "does not resolve" in info.value.message, (url, info.value.message)


def test_nothing_is_read_past_a_literal_and_port_0_is_not_80() -> None:
    """Allowed targets (loopback, allowed here) written wrongly are refused, not repaired."""
    for url in ["http://[::1]x/", "http://127.0.0.1:0/", "http://[::1]:0/", "http://[::1]]/"]:
        with pytest.raises(GatewayError) as info:
            anyio.run(
                partial(check_target, url, allow_private=False, allow_loopback=True, resolve=offline_resolve)
            )
        assert info.value.param == "webhook_url", (url, info.value.message)


# -- a hypothesis property over URL strings ---------------------------------------------------

_printable = st.characters(blacklist_categories=("Cc", "Cf", "Cn", "Co", "Cs", "Zs", "Zl", "Zp"))
"""Characters that pass the whitespace and control check, so that the host is what is tried."""
_label = st.one_of(
    st.text(st.sampled_from("abcxyz019-_"), min_size=0, max_size=8),
    st.text(_printable, min_size=0, max_size=6),
    st.sampled_from(["a" * 63, "a" * 64, "xn--", "xn--ls8h", "\u00fc", "\u00df", "\u0301", "%41", "*"]),
)
_name = st.lists(_label, min_size=1, max_size=5).map(".".join)
_v6 = st.ip_addresses(v=6).map(str)
_bracketed = st.one_of(
    _v6.map(lambda a: f"[{a}]"),
    st.tuples(_v6, st.text(_printable, max_size=6)).map(lambda t: f"[{t[0]}%25{t[1]}]"),
    st.tuples(_v6, st.text(_printable, max_size=6)).map(lambda t: f"[{t[0]}]{t[1]}"),
    _v6.map(lambda a: f"[{a}"),
    st.text(_printable, max_size=10).map(lambda t: f"[{t}]"),
    _v6,  # unbracketed
)
_host = st.one_of(
    _name,
    _bracketed,
    st.ip_addresses(v=4).map(str),
    st.integers(min_value=-1, max_value=2**33).map(str),
    st.text(_printable, max_size=20),
)
_port = st.one_of(
    st.just(""),
    st.just(":"),
    st.integers(min_value=-5, max_value=70_000).map(lambda p: f":{p}"),
    st.text(_printable, max_size=6).map(lambda t: ":" + t),
)
_urls = st.one_of(
    st.tuples(
        st.sampled_from(["http://", "https://", "HTTP://", "http://user@", "ftp://", "http:/", "http:"]),
        _host,
        _port,
        st.text(_printable, max_size=12).map(lambda t: "/" + t),
    ).map("".join),
    st.tuples(st.sampled_from(["http://", "https://"]), _host, _port).map("".join),
    st.text(max_size=40).map(lambda t: "http://" + t),
    st.text(max_size=40),
)


def _answers_well(url: str) -> None:
    try:
        target = _check(url)
    except GatewayError as exc:
        assert exc.status == 400 and exc.param == "webhook_url", (url, exc.status, exc.message)
        return
    assert target.addresses and 1 <= target.port <= 65535, (url, target)


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(url=_urls)
@example(url="http://[::1]:99999/")
@example(url="http://[fe80::1%25\u00e9]/")
def test_the_check_finds_every_url_valid_or_a_400(url: str) -> None:
    _answers_well(url)


# -- through a served gateway: 400 before any hold, never a 500 -----------------------------


@dataclass
class Rig:
    gw: Gateway
    transport: LoopbackOnly
    http: httpx.Client

    def submit(self, webhook_url: str) -> httpx.Response:
        doc = {"endpoint": "/v1/chat/completions", "webhook_url": webhook_url,
               "body": {"model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}  # fmt: skip
        return self.http.post("/v1/jobs", json=doc)

    def holds(self) -> int:
        r = self.gw.admin("GET", "/admin/holds", params={"account": self.gw.account, "limit": 1000})
        assert r.status_code == 200, r.text
        return len(r.json()["data"])


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    with running_gateway(CONFIG) as gw:
        transport = LoopbackOnly(fake_status=204)  # a public literal is "delivered" without a connection
        gw.container.jobs.sender = HttpWebhookSender(transport=transport, resolve=offline_resolve)
        with httpx.Client(base_url=gw.url, headers=gw.headers, timeout=30) as http:
            yield Rig(gw, transport, http)
        for sent in transport.refused:
            assert not ipaddress.ip_address(sent.url.host).is_loopback, sent.url


@pytest.mark.parametrize("url", MALFORMED)
def test_a_malformed_url_is_a_400_at_submit_before_any_hold(rig: Rig, url: str) -> None:
    before = rig.holds()
    r = rig.submit(url)
    assert r.status_code == 400, (url, r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == "webhook_url" and err["code"] == "invalid_request", (url, err)
    assert rig.holds() == before, "a hold was placed for a submit that was refused"


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(url=_urls)
def test_no_webhook_url_gets_a_500_from_the_gateway(rig: Rig, url: str) -> None:
    r = rig.submit(url)
    assert r.status_code in (202, 400), (url, r.status_code, r.text)
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "webhook_url", (url, r.text)
