"""An upstream that passes a gateway's start probe, then fails its requests as a dead one
does: for tests of what requests meet (the breaker, connect errors, requeues) on a
deployment whose probe said it was fine (``probe_interval_s = 0``: probed at start only).

:class:`DyingUpstream` listens on a free port of 127.0.0.1 and answers ``GET …/models``
with a list naming its model (the probe); any other GET is 404; every other request's
connection is closed at once (counted in ``accepted``), after its head is read. Then
:meth:`~DyingUpstream.refuse` closes the port (connections refused) and
:meth:`~DyingUpstream.silence` makes connects to it go unanswered.
"""

from __future__ import annotations

import json
import socket
import threading


class DyingUpstream:
    def __init__(self, model: str) -> None:
        self.model = model
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port: int = self.sock.getsockname()[1]
        self.accepted = 0
        """Connections of requests other than a GET (closed at once)."""
        self._accepting = True
        self._fillers: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, name="dying-upstream", daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _serve(self) -> None:
        while self._accepting:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        head = b""
        try:
            while b"\r\n\r\n" not in head and (chunk := conn.recv(65536)):
                head += chunk
        except OSError:
            return
        method, _, rest = head.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        if method != b"GET":
            self.accepted += 1
            return  # closed at once, unanswered
        if path.endswith(b"/models"):
            status = b"200 OK"
            body = json.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]}).encode()
        else:
            status, body = b"404 Not Found", b'{"detail":"Not Found"}'
        head_out = (
            b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
        )  # fmt: skip
        try:
            conn.sendall(head_out + body)
        except OSError:
            pass

    def _stop_accepting(self) -> None:
        self._accepting = False
        self._thread.join(timeout=10)

    def refuse(self) -> None:
        """From now on nothing listens on the port: connections are refused (it stays
        bound, not listening, so that nobody else takes it)."""
        self._stop_accepting()
        self.sock.close()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))

    def silence(self) -> None:
        """From now on connects get no answer: its accept queue (one place) is full, so
        the kernel drops further SYNs."""
        self._stop_accepting()
        self.sock.listen(0)
        self._fillers.append(socket.create_connection(("127.0.0.1", self.port)))

    def close(self) -> None:
        self._stop_accepting()
        for filler in self._fillers:
            filler.close()
        self.sock.close()

    def __enter__(self) -> DyingUpstream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
