"""The alternatives of issue 17, side by side in one run: the HTTP server, the
upstream client and the request decoder, measured on bare pass-through apps
(``bench/alt_apps.py``: read the body, POST it upstream, return the answer; no
bourse logic), so each figure is the stack's own cost.

    .venv/bin/python -m bench.alternatives [--seconds 8] [--conns 64] [--rounds 2] [--only NAME,NAME]

The candidates live in their own virtual environment, ``bench/.work/alt-venv``
(``--setup`` makes it: granian, pyreqwest, rnet, msgspec beside uvicorn[standard],
aiohttp, pydantic). The upstream is nginx answering a fixed chat completion; the
server under test is pinned to core 0, nginx and wrk (1 thread) to core 1, as the
harness pins. Each combination runs ``--rounds`` times, the order reversed each
round (a shared machine drifts); besides req/s it reports the server's CPU per
request (the process and its children, from /proc), which other load disturbs
less. The decoders are timed in process: a chat body into pydantic's model (as
bourse's ``extra="allow"``) against a msgspec Struct.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import cpu_s

HERE = Path(__file__).resolve().parent
WORK = HERE / ".work"
VENV = WORK / "alt-venv"
PACKAGES = [
    "granian[uvloop]",
    "pyreqwest",
    "rnet",
    "msgspec",
    "uvicorn[standard]",
    "aiohttp",
    "pydantic",
    "orjson",
]
ANSWER = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000, "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18},
})  # fmt: skip
BODY = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
STACKS = [  # (name, server, interface, client)
    ("uvicorn + aiohttp", "uvicorn", "asgi", "aiohttp"),
    ("uvicorn + pyreqwest", "uvicorn", "asgi", "pyreqwest"),
    ("uvicorn + aiohttp-raw", "uvicorn", "asgi", "aiohttp-raw"),
    ("uvicorn + rnet", "uvicorn", "asgi", "rnet"),
    ("granian ASGI + aiohttp", "granian", "asgi", "aiohttp"),
    ("granian ASGI + pyreqwest", "granian", "asgi", "pyreqwest"),
    ("granian RSGI + aiohttp", "granian", "rsgi", "aiohttp"),
    ("granian RSGI + pyreqwest", "granian", "rsgi", "pyreqwest"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def setup() -> None:
    if not (VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", *PACKAGES], check=True)


@contextmanager
def started(
    args: list[str], port: int, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(args, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=HERE.parent)  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{args[0]} did not start (exit {proc.poll()})") from None
                time.sleep(0.05)
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def nginx(port: int) -> list[str]:
    conf = WORK / "alt-nginx.conf"
    escaped = ANSWER.replace("'", "\\'")
    conf.write_text(f"""worker_processes 1;
daemon off;
pid {WORK}/alt-nginx.pid;
error_log {WORK}/alt-nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {WORK}/alt-nginx-body;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
    server {{
        listen 127.0.0.1:{port};
        location / {{ default_type application/json; return 200 '{escaped}'; }}
    }}
}}
""")
    return ["taskset", "-c", "1", "nginx", "-c", str(conf), "-e", str(WORK / "alt-nginx-error.log")]


def server_args(server: str, iface: str, port: int) -> list[str]:
    bin_ = VENV / "bin"
    if server == "uvicorn":
        return ["taskset", "-c", "0", str(bin_ / "uvicorn"), "--factory", "bench.alt_apps:asgi_app",
                "--host", "127.0.0.1", "--port", str(port), "--loop", "uvloop", "--http", "httptools",
                "--no-access-log", "--log-level", "warning", "--lifespan", "off"]  # fmt: skip
    target = "bench.alt_apps:asgi_app" if iface == "asgi" else "bench.alt_apps:rsgi_app"
    return ["taskset", "-c", "0", str(bin_ / "granian"), "--interface", iface, "--factory", target,
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--runtime-threads", "1",
            "--loop", "uvloop", "--no-ws", "--log-level", "warning", "--no-access-log"]  # fmt: skip


def wrk(port: int, conns: int, seconds: float) -> dict[str, float]:
    env = {**os.environ, "BENCH_BODY": BODY}
    args = ["taskset", "-c", "1", "wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s",
            "-s", str(HERE / "wrk_post.lua"), f"http://127.0.0.1:{port}/v1/chat/completions"]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, env=env, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("WRKJSON "))
    r = json.loads(line[len("WRKJSON ") :])
    errors = sum(r[k] for k in ("err_connect", "err_read", "err_write", "err_status", "err_timeout"))
    return {"rps": r["requests"] / (r["duration_us"] / 1e6), "p50_ms": r["p50_us"] / 1000,
            "p99_ms": r["p99_us"] / 1000, "requests": r["requests"], "errors": errors}  # fmt: skip


def measure(stack: tuple[str, str, str, str], upstream: int, o: argparse.Namespace) -> dict[str, float]:
    _, server, iface, client = stack
    port = free_port()
    env = {"ALT_UPSTREAM": f"http://127.0.0.1:{upstream}/v1/chat/completions", "ALT_CLIENT": client,
           "PYTHONPATH": str(HERE.parent)}  # fmt: skip
    with started(server_args(server, iface, port), port, env) as proc:
        wrk(port, o.conns, o.warmup)
        before = cpu_s(proc.pid)
        r = wrk(port, o.conns, o.seconds)
        r["cpu_us"] = (cpu_s(proc.pid) - before) / max(1, r["requests"]) * 1e6
        return r


DECODE = r"""
import json, timeit
import msgspec, pydantic
from typing import Any
body = json.dumps({"model": "bench", "messages": [{"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hi " * 40}], "max_tokens": 16, "temperature": 0.2, "stream": False,
    "max_price": 1.5, "user": "u-1"}).encode()
bad = json.dumps({"model": "bench", "messages": "nope"}).encode()
class Message(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    role: str
    content: str | list[Any] | None = None
class Chat(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    model: str
    messages: list[Message]
    max_tokens: int | None = None
    temperature: float | None = None
    stream: bool = False
    max_price: float | None = None
    user: str | None = None
class MMessage(msgspec.Struct):
    role: str
    content: str | list[Any] | None = None
class MChat(msgspec.Struct, forbid_unknown_fields=False):
    model: str
    messages: list[MMessage]
    max_tokens: int | None = None
    temperature: float | None = None
    stream: bool = False
    max_price: float | None = None
    user: str | None = None
dec = msgspec.json.Decoder(MChat)
def p_bad():
    try: Chat.model_validate_json(bad)
    except pydantic.ValidationError as e: e.errors()
def m_bad():
    try: dec.decode(bad)
    except msgspec.ValidationError as e: str(e)
n = 20000
for name, fn in (("pydantic (model_validate_json)", lambda: Chat.model_validate_json(body)),
                 ("msgspec (Struct decoder)", lambda: dec.decode(body)),
                 ("pydantic, invalid body", p_bad), ("msgspec, invalid body", m_bad)):
    best = min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6
    print(f"DECODE {name}\t{best:.2f}")
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--warmup", type=float, default=2)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated stack names (default: all)")
    ap.add_argument("--setup", action="store_true", help="make bench/.work/alt-venv first")
    ap.add_argument(
        "--json", action="store_true", help="end with one line: ALTJSON {...} (for bench.harness)"
    )
    o = ap.parse_args()
    WORK.mkdir(exist_ok=True)
    if o.setup or not (VENV / "bin" / "granian").exists():
        setup()
    stacks = [s for s in STACKS if not o.only or s[0] in o.only.split(",")]
    results: dict[str, list[dict[str, float]]] = {s[0]: [] for s in stacks}
    upstream = free_port()
    print(f"load {os.getloadavg()[0]:.1f}; wrk c={o.conns} {o.seconds:.0f}s; server on core 0, nginx + wrk on core 1",
          flush=True)  # fmt: skip
    with started(nginx(upstream), upstream):
        for rnd in range(o.rounds):
            for stack in stacks if rnd % 2 == 0 else list(reversed(stacks)):
                r = measure(stack, upstream, o)
                results[stack[0]].append(r)
                print(f"  {stack[0]:26} {r['rps']:8.0f} req/s  p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms"
                      f"  errors {r['errors']:.0f}  CPU {r['cpu_us']:5.0f} µs/req", flush=True)  # fmt: skip
    print(
        f"\n| stack (bare pass-through, c={o.conns}) | req/s (each run) | server CPU µs/req (each run) | p99 ms |"
    )
    print("|---|---|---|---|")
    for name, runs in results.items():
        rps = ", ".join(f"{r['rps']:,.0f}" for r in runs)
        cpu = ", ".join(f"{r['cpu_us']:.0f}" for r in runs)
        p99 = ", ".join(f"{r['p99_ms']:.1f}" for r in runs)
        print(f"| {name} | {rps} | {cpu} | {p99} |")
    out = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", DECODE], capture_output=True, text=True, check=True
    )
    print("\n| request decoding (one chat body, best of 5) | µs |\n|---|---|")
    decode: dict[str, float] = {}
    for line in out.stdout.splitlines():
        name, us = line[len("DECODE ") :].split("\t")
        decode[name] = float(us)
        print(f"| {name} | {float(us):.2f} |")
    if o.json:
        print("ALTJSON " + json.dumps({"conns": o.conns, "stacks": results, "decode": decode}))


if __name__ == "__main__":
    main()
