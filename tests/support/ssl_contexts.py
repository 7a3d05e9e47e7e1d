"""One SSL context per trust setting for the httpx clients of the test process.

httpx builds a new :class:`ssl.SSLContext` for every client (the CA bundle read and
parsed: ~20 ms of CPU), and ``httpx.get``/``post``/``request`` and every SDK client
build a client per call: the suite makes thousands, all to loopback over plain HTTP.
:func:`share_ssl_contexts` makes the clients built with the default trust (``verify``
True or False, no client certificate) share the context the first one built, for
the same ``SSL_CERT_FILE``/``SSL_CERT_DIR``: the same trust, built once. Anything else
(a context or a CA path given, a client certificate) is built as httpx builds it.
"""

from __future__ import annotations

import os
import ssl
import threading
from collections.abc import Callable
from typing import Any

import httpx._transports.default as transports

Factory = Callable[..., ssl.SSLContext]
NAME = "create_ssl_context"
"""What httpx's transports call to build a client's context (from ``httpx._config``)."""


def share_ssl_contexts() -> Callable[[], None]:
    """Install the shared contexts in httpx's transports; the function that undoes it."""
    original: Factory = getattr(transports, NAME)
    built: dict[tuple[bool, bool, str | None, str | None], ssl.SSLContext] = {}
    lock = threading.Lock()

    def shared(verify: Any = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
        if cert is not None or not isinstance(verify, bool):
            return original(verify=verify, cert=cert, trust_env=trust_env)
        key = (verify, trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        with lock:
            context = built.get(key)
            if context is None:
                context = built[key] = original(verify=verify, cert=None, trust_env=trust_env)
        return context

    setattr(transports, NAME, shared)

    def undo() -> None:
        setattr(transports, NAME, original)

    return undo
