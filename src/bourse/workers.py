"""``bourse serve --workers N``: N processes serving one port as one exchange.

The serving process (the gateway) checks that the workers can share everything that
makes an exchange one (the book and rate limits in Redis, the ledger in PostgreSQL:
``[cluster]``), holds the data folder's lock, does the folder's first-start writes
(instance id, keys) once, opens N listening sockets on the port with
``SO_REUSEPORT`` (the kernel spreads connections over them), and forks one worker
per socket. Each worker is a replica of the cluster with an instance id of its own
(the folder's id and its number, so a restart resumes each worker's holds and jobs),
and they share the folder's lock. Without ``[cluster]`` there would be N books, each
believing it owns the slots: N > 1 is refused with one line.

Before forking, the gateway also makes each worker a Unix socket of its own (in a
private temporary folder, removed when the workers have ended): a worker scraped on
``/metrics`` asks the others for their series there (:class:`WorkerChannels`,
:mod:`bourse.observability.worker_metrics`).

SIGTERM or SIGINT to the gateway drains every worker, then it exits 0. A worker that
ends on its own ends the others too (the gateway's supervisor restarts the whole).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType

WORKER_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def cluster_problem(workers: int, redis_url: str | None, database: str | None) -> str | None:
    """Why ``workers`` processes cannot serve as one exchange here, or None."""
    if workers < 1:
        return "--workers must be 1 or more"
    if workers == 1:
        return None
    if not redis_url or not (database or "").startswith(("postgresql://", "postgres://")):
        return (
            f"--workers {workers} needs [cluster] redis_url and a PostgreSQL database, which the workers "
            "share (the book, the limits and the ledger); without them run one worker"
        )
    return None


def tcp_listener(host: str, port: int, *, reuse_port: bool = False, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when the host is an IPv6 address,
    IPv6 only), as ``socket.create_server`` makes it but with ``IPPROTO_TCP``: asyncio's
    own loop sets ``TCP_NODELAY`` on the connections it accepts only on such a socket
    (uvloop on every one), and without it a keep-alive client's every answer waits
    ~40 ms for the delayed ACK of the one before (Nagle's algorithm)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if os.name == "posix":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def listen_workers(host: str, port: int, workers: int) -> list[socket.socket]:
    """``workers`` listening sockets on one port (``SO_REUSEPORT``; port 0: the one
    the first socket gets)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(workers):
            s = tcp_listener(host, port, reuse_port=True)
            socks.append(s)
            port = s.getsockname()[1]
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


@dataclass(frozen=True, slots=True)
class WorkerLink:
    """Worker ``number``'s channel to the others: the socket it answers on, and theirs."""

    number: int
    listener: socket.socket
    peers: dict[int, str]
    """The other workers' numbers and socket paths."""


class WorkerChannels:
    """One listening Unix socket per worker, in a folder of the gateway's own (0700)."""

    def __init__(self, workers: int) -> None:
        self.folder = tempfile.mkdtemp(prefix="bourse-workers-")
        self.paths = [os.path.join(self.folder, f"{n}.sock") for n in range(workers)]
        self.listeners: list[socket.socket] = []
        try:
            for path in self.paths:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.listeners.append(sock)
                sock.bind(path)
                sock.listen(64)
        except BaseException:
            self.close()
            raise

    def link(self, number: int) -> WorkerLink:
        """Worker ``number``'s link (called in that worker: the others' sockets are closed)."""
        for n, sock in enumerate(self.listeners):
            if n != number:
                sock.close()
        peers = {n: path for n, path in enumerate(self.paths) if n != number}
        return WorkerLink(number, self.listeners[number], peers)

    def close(self) -> None:
        for sock in self.listeners:
            sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def run_workers(socks: Sequence[socket.socket], serve: Callable[[socket.socket, int], int]) -> int:
    """Fork one worker per socket running ``serve(sock, number)``; forward SIGTERM,
    SIGINT and SIGHUP (a reload) to them; wait for all. The exit status: 0, or the first failure's."""
    pids: dict[int, int] = {}
    for number, sock in enumerate(socks):
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child; measured by the e2e tests)
            os._exit(_child(socks, sock, number, serve))
        pids[pid] = number
    for sock in socks:
        sock.close()
    return _supervise(pids)


def _child(
    socks: Sequence[socket.socket],
    sock: socket.socket,
    number: int,
    serve: Callable[[socket.socket, int], int],
) -> int:  # pragma: no cover (runs in the forked worker)
    for other in socks:
        if other is not sock:
            other.close()
    os.setpgid(0, 0)  # a terminal's ^C reaches the gateway, which tells each worker once
    _die_with_parent()
    for sig in WORKER_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until its server reloads on it
    try:
        return serve(sock, number)
    except KeyboardInterrupt:
        return 130
    except BaseException:
        # through the log's handler: with log_format = "json" the traceback is one object
        logging.getLogger("bourse").exception("worker %d failed", number)
        return 3


def _die_with_parent() -> None:  # pragma: no cover (runs in the forked worker)
    """SIGTERM (a drain) when the gateway dies, however it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def _supervise(pids: dict[int, int]) -> int:
    live = dict(pids)
    stopping = False

    def tell(sig: int, _frame: FrameType | None = None) -> None:
        nonlocal stopping
        stopping = True
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def reload(sig: int, _frame: FrameType | None = None) -> None:
        for pid in live:  # each worker reads the config file again (bourse.live_terms)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    previous = {sig: signal.signal(sig, tell) for sig in WORKER_SIGNALS}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, reload)
    status = 0
    try:
        while live:
            pid, raw = os.waitpid(-1, 0)
            if live.pop(pid, None) is None:
                continue
            code = os.waitstatus_to_exitcode(raw)
            if code != 0 and status == 0:
                status = code if code > 0 else 128 - code
            if not stopping:  # a worker ended on its own: the exchange stops whole
                tell(signal.SIGTERM)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status
