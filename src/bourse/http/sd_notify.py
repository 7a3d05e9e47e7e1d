"""The service manager's notifications of ``bourse serve`` (systemd's ``sd_notify``
protocol, no dependency): what the server tells the manager, and when.

When ``$NOTIFY_SOCKET`` names a socket (a path, or ``@name`` in the abstract
namespace), :class:`Notifier` sends each message as one datagram there; without the
variable it does nothing. A socket that is missing, refused or full is logged once at
WARNING and never stops ``serve``. :class:`ServiceNotes` says, around the server's
lifecycle (:class:`~bourse.http.server.GatewayServer` calls it):

- ``READY=1`` once the server listens and ``/readyz`` would answer 200 (some product
  can serve), or :data:`READY_WAIT_S` after it listens when none can yet (the
  ``STATUS=`` line then names why), so a manager's start timeout never kills a gateway
  whose engines are still loading;
- ``RELOADING=1`` (with ``MONOTONIC_USEC=``) when SIGHUP's reload starts, ``READY=1``
  when it is done;
- ``STOPPING=1`` when a stop signal starts the drain;
- ``STATUS=`` lines with each of them.

A ``Type=notify`` unit (``deploy/systemd/bourse.service``) is started when
``READY=1`` arrives and knows that a stop is draining rather than hanging.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger("bourse")

NOTIFY_SOCKET = "NOTIFY_SOCKET"
READY_WAIT_S = 30.0
"""The longest ``READY=1`` waits, once the server listens, for a product that can
serve (below systemd's default start timeout, 90 s)."""
POLL_S = 0.1
"""How often readiness is looked at meanwhile."""


def socket_address(value: str | None) -> str | bytes | None:
    """The address a ``$NOTIFY_SOCKET`` value names: a path, an abstract name (``@``
    becomes the leading NUL byte), or None (unset, empty, or a kind not spoken here)."""
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


class Notifier:
    """Sends notification messages to the service manager's socket, if there is one."""

    def __init__(self, value: str | None) -> None:
        self.value = value
        self.address = socket_address(value)
        self._warned = False
        if value and self.address is None:
            self._warn(f"not a socket path or an @abstract name: {value!r}")

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Notifier:
        return cls((os.environ if env is None else env).get(NOTIFY_SOCKET))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """One message of ``KEY=value`` lines; whether it was sent (never raises)."""
        if self.address is None:
            return False
        text = "\n".join(field.replace("\n", " ") for field in fields)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(text.encode(), socket.MSG_DONTWAIT, self.address)
        except OSError as exc:
            self._warn(exc.strerror or str(exc))
            return False
        return True

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s=%s: cannot notify the service manager (%s); serving all the same",
                        NOTIFY_SOCKET, self.value, why)  # fmt: skip


class ServiceNotes:
    """What the server's lifecycle tells the service manager (the module's list).
    ``ready``: whether some product can serve now (``/readyz``'s 200 but for the drain);
    ``unready``: why not, for the ``STATUS=`` line; ``serving``: the status while serving."""

    def __init__(
        self,
        notifier: Notifier,
        ready: Callable[[], bool],
        unready: Callable[[], str],
        serving: str,
        *,
        ready_wait_s: float = READY_WAIT_S,
    ) -> None:
        self.notifier = notifier
        self.ready = ready
        self.unready = unready
        self.serving = serving
        self.ready_wait_s = ready_wait_s
        self.announced = False
        """Whether ``READY=1`` was sent (a reload before it does not send it)."""

    async def started(self) -> None:
        """The server listens: ``READY=1`` once a product can serve (or the wait is over)."""
        if not self.notifier.enabled:
            return
        deadline = time.monotonic() + self.ready_wait_s
        while not self.ready():
            if time.monotonic() >= deadline:
                self.announced = True
                self.notifier.send("READY=1", f"STATUS={self.serving}; not ready: {self.unready()}")
                log.warning("not ready %g s after start (%s); told the service manager READY=1 all the same",
                            self.ready_wait_s, self.unready())  # fmt: skip
                return
            await asyncio.sleep(POLL_S)
        self.announced = True
        self.notifier.send("READY=1", f"STATUS={self.serving}")

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notifier.send(
            "RELOADING=1", f"MONOTONIC_USEC={usec}", "STATUS=reloading the config file (SIGHUP)"
        )

    def reloaded(self) -> None:
        if self.announced:
            self.notifier.send("READY=1", f"STATUS={self.serving}")
        else:
            self.notifier.send(f"STATUS={self.serving}")

    def stopping(self) -> None:
        self.notifier.send("STOPPING=1", "STATUS=draining, then stopping")
