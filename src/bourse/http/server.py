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
stopping. A stop still under way :data:`STUCK_S` after the drain ended prints every
thread's stack to stderr, so a shutdown that hangs until the service manager kills it
says where it hung; a process whose exit is still held :data:`EXIT_S` after the server
shut down (a name lookup in flight) exits 0 at once, saying what held it.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Protocol

import uvicorn

from bourse.http.sd_notify import ServiceNotes

log = logging.getLogger("bourse")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
RELOAD = signal.SIGHUP
"""Read the config file again and apply its live terms (floors, slots, default bids)."""
STUCK_S = 30.0
"""Once the drain has ended, the server's shutdown (idle connections closed, the
services stopped) takes well under a second, and its own bounds add up to about 23 s
(uvicorn's 5 s for requests still open, 10 s for the runs' last tasks, the traces'
flush and export); a stop still under way this much later prints every thread's stack
to stderr (:mod:`faulthandler`), before a service manager's usual 45 s run out."""
EXIT_S = 3.0
"""Once the server has shut down (the services stopped: every hold closed, the stores
closed), what is left of the exit is the loop's teardown, which waits for every name
lookup still in flight: a lookup cannot be cancelled, and a DNS server that does not
answer holds it for the resolver's whole timeout (10-30 s; podman's aardvark-dns does
not answer for that long while a container on its network starts or stops), past a
service manager's stop timeout. A process still alive this long after the server shut
down logs it with every thread's stack and exits 0 at once."""


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
        *,
        bound_exit: bool = False,
    ) -> None:
        super().__init__(config)
        self._bound_exit = bound_exit
        """The process is this server's (``bourse serve``): its exit is bounded (:data:`EXIT_S`)."""
        self._drain = drain
        self._draining: asyncio.Task[None] | None = None
        self._reload = reload
        self._reloading: asyncio.Task[None] | None = None
        self._reload_again = False
        self._notes = notes
        self._announcing: asyncio.Task[None] | None = None
        self.signalled_at: float | None = None
        """When the first stop signal came (``time.monotonic()``)."""

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's serve; once it has shut down after a start, the process's exit is
        bounded (:data:`EXIT_S`) if it is this server's."""
        try:
            await super().serve(sockets)
        finally:
            faulthandler.cancel_dump_traceback_later()
        if self.started and self._bound_exit:
            exit_unless_gone(EXIT_S)

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
            self.signalled_at = time.monotonic()
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
            faulthandler.dump_traceback_later(STUCK_S, exit=False)


def exit_unless_gone(after_s: float) -> None:
    """Exit the process with status 0 in ``after_s`` seconds unless it has exited by
    then, logging why with every thread's stack (:data:`EXIT_S`)."""

    def exit_now() -> None:
        try:  # nothing here may keep the process from exiting
            log.warning(
                "the exit was still held %.1f s after the server shut down (a name lookup or another "
                "thread still running, after the services' stop returned): exiting now; the threads were:",
                after_s,
            )
            for handler in logging.getLogger().handlers:
                handler.flush()
            faulthandler.dump_traceback(all_threads=True)
        except Exception:  # stderr closed, a handler that fails: exit all the same
            pass
        finally:
            os._exit(0)

    timer = threading.Timer(after_s, exit_now)
    timer.daemon = True
    timer.start()
