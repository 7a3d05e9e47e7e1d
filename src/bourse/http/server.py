"""The HTTP server of ``bourse serve``: uvicorn, with the gateway's own signal handling.

uvicorn, told to stop, closes its listening socket at once, gives what still runs
``timeout_graceful_shutdown`` seconds, cancels the rest (a traceback per request, no
frame to the client) and then re-raises the signal, so the process dies of it.
:class:`GatewayServer` handles SIGTERM and SIGINT itself instead: the first one starts
the drain (:class:`~bourse.services.drain.Drain`) while the server keeps accepting
(new requests get 503 ``draining``); when the drain is done the server shuts down as
uvicorn does (every connection is idle by then) and ``serve`` returns, so the process
exits 0. A second signal ends the drain's wait for running generations at once.
SIGHUP runs the gateway's reload (:mod:`bourse.live_terms`: the config file's floors,
slots and default bids applied live), one at a time; it never stops the server.
Each of these is told to a service manager listening on ``$NOTIFY_SOCKET``
(:class:`~bourse.http.sd_notify.ServiceNotes`): ready once it listens, reloading,
stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Generator
from typing import Protocol

import uvicorn

from bourse.http.sd_notify import ServiceNotes

log = logging.getLogger("bourse")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
RELOAD = signal.SIGHUP
"""Read the config file again and apply its live terms (floors, slots, default bids)."""


class Drainer(Protocol):
    def __call__(self) -> Awaitable[None]: ...

    def hurry(self) -> None: ...


class GatewayServer(uvicorn.Server):
    """A uvicorn server that drains the gateway before it stops."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drainer,
        reload: Callable[[], Awaitable[None]] | None = None,
        notes: ServiceNotes | None = None,
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining: asyncio.Task[None] | None = None
        self._reload = reload
        self._reloading: asyncio.Task[None] | None = None
        self._reload_again = False
        self._notes = notes
        self._announcing: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start (the app's lifespan, then listening); then ``READY=1`` is told
        once a product can serve."""
        await super().startup(sockets)
        if self.started and self._notes is not None and not self.should_exit:
            self._announcing = asyncio.get_running_loop().create_task(self._notes.started())

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """The loop's handlers for SIGTERM and SIGINT while serving (uvicorn's are not
        installed, and no signal is raised again at the end)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.on_signal, sig)
        loop.add_signal_handler(RELOAD, self.on_reload)
        try:
            yield
        finally:
            for sig in (*SIGNALS, RELOAD):
                loop.remove_signal_handler(sig)

    def on_reload(self) -> None:
        """SIGHUP: one reload at a time; one more after it if another came meanwhile."""
        if self._reload is None or self._draining is not None:
            log.warning("SIGHUP: ignored (%s)", "draining" if self._draining else "nothing to reload")
            return
        if self._reloading is not None and not self._reloading.done():
            self._reload_again = True
            return
        self._reloading = asyncio.get_running_loop().create_task(self._reload_loop(self._reload))

    async def _reload_loop(self, reload: Callable[[], Awaitable[None]]) -> None:
        if self._notes is not None:
            self._notes.reloading()
        while True:
            self._reload_again = False
            try:
                await reload()
            except Exception:
                log.exception("SIGHUP: the reload failed; the terms in force are unchanged where it stopped")
            if not self._reload_again:
                break
        if self._notes is not None and self._draining is None:
            self._notes.reloaded()

    def on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._draining is None:
            log.warning("%s: draining, then stopping", name)
            if self._announcing is not None:
                self._announcing.cancel()
            if self._notes is not None:
                self._notes.stopping()
            self._draining = asyncio.get_running_loop().create_task(self._drain_then_stop(self._drain))
        else:
            log.warning("%s again: running generations are ended now", name)
            self._drain.hurry()

    async def _drain_then_stop(self, drain: Callable[[], Awaitable[None]]) -> None:
        try:
            await drain()
        except Exception:
            log.exception("the drain failed; stopping")
        finally:
            self.should_exit = True
