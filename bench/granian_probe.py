"""What bourse's server does that granian's ASGI does not, checked on the wire: the
same gateway app under ``bourse serve`` (uvicorn with bourse's protocol) and under
granian (``bench.granian_app``), one probe each (issue 40, item 1).

    PYTHONPATH=src:. .venv/bin/python -m bench.granian_probe

- drain: a stream running (sim, ~4 s), then SIGTERM to the server: does a new request
  get 503 ``draining`` (or a refused connection), does the running stream finish,
  and how the process exits;
- a 100 KB header (``max_header_bytes`` is 64 KB): the status;
- a request head sent halfway and left (``header_timeout_s`` = 2 s here): answered or
  closed after 4 s, or still open;
- a connection that sends nothing (``keep_alive_timeout_s`` = 2 s here): closed after
  4 s, or still open.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from typing import Any

import httpx

from bench.common import gateway_process
from bench.granian_app import granian

CONFIG = """[server]
log_level = "warning"
header_timeout_s = 2
keep_alive_timeout_s = 2
[products.bench]
[[products.bench.deployments]]
engine = "sim"
slots = 8
floor = 0.10
ttft_ms = 0
tokens_per_s = 5
output_tokens = 20
"""


def _host_port(base: str) -> tuple[str, int]:
    hp = base.split("//")[1].split("/")[0]
    return hp.split(":")[0], int(hp.split(":")[1])


def _closed_within(sock: socket.socket, seconds: float) -> str:
    sock.settimeout(seconds)
    try:
        data = sock.recv(4096)
    except TimeoutError:
        return f"still open after {seconds:.0f} s"
    except OSError as exc:
        return f"reset ({exc.__class__.__name__})"
    if not data:
        return "closed, no answer"
    return "answered " + data.split(b"\r\n", 1)[0].decode("latin-1", "replace")


def wire(base: str) -> dict[str, str]:
    host, port = _host_port(base)
    out: dict[str, str] = {}
    with socket.create_connection((host, port)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        out["100 KB header"] = _closed_within(s, 4)
    with socket.create_connection((host, port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        out["head sent halfway"] = _closed_within(s, 4)
    with socket.create_connection((host, port)) as s:
        out["idle new connection"] = _closed_within(s, 4)
    return out


def drain(base: str, key: str, proc: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    h = {"authorization": f"Bearer {key}"}
    body = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    frames: list[str] = []
    first = threading.Event()

    def stream() -> None:
        try:
            with httpx.stream("POST", base + "/chat/completions", json=body, headers=h, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        frames.append(line)
                        first.set()
        except httpx.HTTPError as exc:
            frames.append(f"ERROR {exc.__class__.__name__}")
        first.set()

    t = threading.Thread(target=stream)
    t.start()
    first.wait(10)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        r = httpx.post(base + "/chat/completions", json={**body, "stream": False}, headers=h, timeout=10)
        out["new request after SIGTERM"] = f"{r.status_code} {r.text[:80]}"
    except httpx.HTTPError as exc:
        out["new request after SIGTERM"] = f"no answer ({exc.__class__.__name__})"
    t.join(40)
    last = frames[-1] if frames else "none"
    out["running stream"] = f"{len(frames)} data frames, last {last[:60]!r}"
    try:
        rc = proc.wait(30)
    except Exception:
        rc = None
    out["process"] = f"exit {rc} {time.monotonic() - t0:.1f} s after SIGTERM"
    return out


def main() -> None:
    for name in ("uvicorn (bourse serve)", "granian ASGI"):
        started = gateway_process(CONFIG) if name.startswith("uvicorn") else granian(CONFIG)
        with started as (base, key, proc):
            results = wire(base)
            results |= drain(base, key, proc)
        print(name)
        for k, v in results.items():
            print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
