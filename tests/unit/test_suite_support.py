"""The suite's own speed-up keeps doing what it says (:mod:`tests.support.ssl_contexts`,
installed by :mod:`tests.conftest`): httpx clients of the test process share one SSL
context per trust setting, and a client given its own context keeps it."""

from __future__ import annotations

import ssl

import httpx


def _context(client: httpx.Client) -> ssl.SSLContext:
    pool = client._transport._pool  # type: ignore[attr-defined]
    context: ssl.SSLContext = pool._ssl_context
    return context


def test_clients_with_the_default_trust_share_one_context_and_others_keep_their_own() -> None:
    own = ssl.create_default_context()
    with httpx.Client() as a, httpx.Client() as b, httpx.Client(verify=own) as c:
        assert _context(a) is _context(b)
        assert _context(c) is own
    with httpx.Client(verify=False) as d, httpx.Client(verify=False) as e:
        assert _context(d) is _context(e) is not _context(a)
        assert _context(d).verify_mode == ssl.CERT_NONE
