"""The ``bourse`` command line: ``serve`` and ``sim-upstream`` (``admin`` and ``jobs``
live in their own modules), and :func:`main`, which turns an expected failure (a file
that cannot be read, a server that cannot be reached, an answer or a file that is not
JSON, :class:`~bourse.cli_errors.CliError`) into one line on stderr and exit status 2,
never a traceback (the line: :mod:`bourse.cli_errors`).

``serve`` sets up logging as soon as it has read its config, and writes its own lines
through it (:func:`~bourse.observability.logs.say`): with ``log_format = "json"`` every
line on stderr is an object, the first one included."""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bourse.cli_errors import EXIT_FAILURE, failure_line

if TYPE_CHECKING:
    import uvicorn

    from bourse.http.sd_notify import ServiceNotes
    from bourse.services.market import Market
    from bourse.settings import Config, ServerConfig
    from bourse.workers import WorkerLink

GC_YOUNG_THRESHOLD = 50_000
"""Net allocations of tracked objects between two young collections (CPython's
default is 700). A request frees what it made by reference counting (no cycles, see
``tests/http/test_no_cycles.py``), so a young collection under load finds no garbage:
it only walks the live objects of the requests in flight (~1 µs each) and moves them
on. The count that triggers it rises with every swing of that live set: with 256
requests waiting 50 ms upstream (bench scenario (c)) a threshold of 7,000 started ten
collections a second, ~10 % of the gateway's CPU; at 20,000 and up, none in five
seconds (c=256), and two at c=512 with 25,000. Cyclic garbage, were there any, waits
for at most this many allocations."""


def settle_heap() -> None:
    """What is built before serving (modules, models, the app) lives as long as the
    process: collect once, keep it out of every later pass (``gc.freeze``), and collect
    the youngest generation only after :data:`GC_YOUNG_THRESHOLD` allocations."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)


def _serve(args: argparse.Namespace) -> int:
    from bourse.observability.logs import configure_logging, say
    from bourse.observability.tracing import missing_extra
    from bourse.settings import (
        ConfigError,
        declared_log_format,
        drain_grace_of,
        load_config,
        read_environment,
    )

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        configure_logging("info", declared_log_format(args.config))
        for line in exc.lines():
            say(line, logging.ERROR)
        return EXIT_FAILURE
    server = config.server
    configure_logging(server.log_level, server.log_format)
    # httpx (webhook delivery) logs every request it sends at INFO; bourse reports
    # failures itself (the upstream client of the openai engine is aiohttp)
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    # the config's other problem, known before anything is written to the data folder
    missing = missing_extra() if server.tracing else None
    if missing is not None:
        say(ConfigError(config.source, [missing]).lines()[0], logging.ERROR)
        return EXIT_FAILURE
    try:  # and the environment's (read again where the drain is made)
        drain_grace_of(server, read_environment())
    except ValueError as exc:
        say(str(exc), logging.ERROR)
        return EXIT_FAILURE
    try:
        return _serve_config(args, config)
    except Exception as exc:  # main's one line, in the log's format
        say(failure_line(exc), logging.ERROR)
        return EXIT_FAILURE


def _serve_config(args: argparse.Namespace, config: Config) -> int:
    from bourse.observability.logs import say

    host = args.host or config.server.host
    port = config.server.port if args.port is None else args.port
    if args.workers != 1:
        return _serve_workers(args, config, host, port)
    # the port first: a start that cannot listen writes nothing (no data folder, no key)
    try:
        sock = listen(host, port)
    except OSError as exc:
        say(f"cannot listen on {host}:{port}: {exc.strerror or exc}", logging.ERROR)
        return EXIT_FAILURE
    with sock:
        return _serve_on(args, config, sock)


def _serve_workers(args: argparse.Namespace, config: Config, host: str, port: int) -> int:
    """``--workers N``: N replicas of one cluster on one port (bourse.workers)."""
    from contextlib import ExitStack

    from bourse.observability.logs import say
    from bourse.settings import read_environment
    from bourse.workers import cluster_problem, listen_workers

    env = read_environment()
    database = args.database or env.database or config.storage.database
    problem = cluster_problem(args.workers, env.redis_url or config.cluster.redis_url, database)
    if problem is not None:
        say(problem, logging.ERROR)
        return EXIT_FAILURE
    try:
        socks = listen_workers(host, port, args.workers)
    except OSError as exc:
        say(f"cannot listen on {host}:{port}: {exc.strerror or exc}", logging.ERROR)
        return EXIT_FAILURE
    with ExitStack() as stack:
        for sock in socks:
            stack.enter_context(sock)
        return _serve_on(args, config, socks[0], socks)


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when the host is an IPv6 address)."""
    from bourse.workers import tcp_listener

    return tcp_listener(host, port)


def _serve_on(
    args: argparse.Namespace, config: Config, sock: socket.socket, workers: Sequence[socket.socket] = ()
) -> int:
    from bourse.observability.logs import say
    from bourse.storage.folder_lock import FolderInUse, folder_lock
    from bourse.storage.private import private_folder

    # then the data folder: one serving process each (its workers share the lock),
    # locked before anything is written there
    data_dir = private_folder(Path(args.data_dir or "./data"))
    try:
        with folder_lock(data_dir):
            if workers:
                return _fork_workers(args, config, workers, data_dir)
            return _serve_locked(args, config, sock, data_dir)
    except FolderInUse as exc:
        say(str(exc), logging.ERROR)
        return EXIT_FAILURE


def _fork_workers(
    args: argparse.Namespace, config: Config, socks: Sequence[socket.socket], data_dir: Path
) -> int:
    """The folder's first-start writes once (not raced by the workers), then the workers."""
    from bourse.container import instance_id
    from bourse.observability.logs import say
    from bourse.services.accounts import admin_key_hash
    from bourse.settings import read_environment
    from bourse.storage.private import SecretBox, key_notices
    from bourse.workers import WorkerChannels, run_workers

    env = read_environment()
    instance_id(data_dir)
    try:
        SecretBox.for_folder(data_dir, env.secret_key)
    except ValueError as exc:  # not a Fernet key
        say(str(exc), logging.ERROR)
        return EXIT_FAILURE
    _, generated = admin_key_hash(data_dir, env.admin_key)
    for line in key_notices(data_dir, generated, None, terminal=sys.stderr.isatty()):
        say(line)
    channels = WorkerChannels(len(socks))  # /metrics: each worker asks the others for their series
    try:
        return run_workers(
            socks, lambda sock, n: _serve_locked(args, config, sock, data_dir, n, channels.link(n))
        )
    finally:
        channels.close()


def _serve_locked(
    args: argparse.Namespace,
    config: Config,
    sock: socket.socket,
    data_dir: Path,
    worker: int = 0,
    link: WorkerLink | None = None,
) -> int:
    from bourse.container import build, sealing_problem, unreachable_services
    from bourse.http.server import GatewayServer
    from bourse.observability.logs import say
    from bourse.services.accounts import demo_rule
    from bourse.settings import drain_grace_of, read_environment

    server = config.server
    if threading.current_thread() is threading.main_thread():  # until the server handles it
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _allow_open_files(server.max_connections + 1024)
    env = read_environment()
    grace_s = drain_grace_of(server, env)  # checked before the data folder was touched
    problems = unreachable_services(config, env, args.database)
    if problems:
        for problem in problems:
            say(problem, logging.ERROR)
        return EXIT_FAILURE
    try:
        container = build(
            config, data_dir=data_dir, env=env, database=args.database, worker=worker, link=link
        )
    except ValueError as exc:
        say(str(exc), logging.ERROR)
        return EXIT_FAILURE
    container.data_dir = data_dir
    container.config_path = args.config
    container.adopt_secret_key = args.adopt_secret_key
    container.demo = demo_rule(
        asked=args.demo or server.demo,
        built_in_config=args.config is None,
        single_node=container.store.single_node,
    )
    refused = sealing_problem(container)
    if refused is not None:
        say(refused, logging.ERROR)
        return EXIT_FAILURE
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/v1"
    say(f"serving {', '.join(config.products)} on {url}", url=url, products=list(config.products))
    app = container.app()
    settle_heap()
    # SIGTERM and SIGINT drain the gateway before the server stops (then exit 0)
    # and SIGHUP reads the config file again (bourse.live_terms); a service manager is
    # told each ($NOTIFY_SOCKET; with --workers, by worker 0: NotifyAccess=all)
    notes = service_notes(container.completions.markets, f"serving {', '.join(config.products)} on {url}")
    uvicorn_server = GatewayServer(
        server_config(app, server),
        container.drainer(grace_s),
        container.reload,
        notes if worker == 0 else None,
        bound_exit=True,
    )
    uvicorn_server.run(sockets=[sock])
    if uvicorn_server.signalled_at is not None:
        say(f"stopped {time.monotonic() - uvicorn_server.signalled_at:.1f} s after the signal")
    return 0 if uvicorn_server.started else 3


def service_notes(markets: Mapping[str, Market], serving: str) -> ServiceNotes:
    """What ``serve`` tells a service manager on ``$NOTIFY_SOCKET`` (bourse.http.sd_notify):
    ready when ``/readyz`` would answer 200."""
    from bourse.http.app import readiness
    from bourse.http.sd_notify import Notifier, ServiceNotes

    def unready() -> str:
        products, unavailable = readiness(markets)
        reasons = [f"{u['deployment']}: {u['reason']}" for u in unavailable]
        return "; ".join(reasons) or f"no product can serve ({', '.join(products)})"

    return ServiceNotes(
        Notifier.from_environment(), lambda: any(readiness(markets)[0].values()), unready, serving
    )


def _allow_open_files(wanted: int) -> None:
    """Raise the soft limit on open files towards ``wanted`` (connections, files, upstreams)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            logging.getLogger("bourse").warning("cannot raise the open-files limit above %d", soft)


def server_config(app: Any, server: ServerConfig) -> uvicorn.Config:
    """The uvicorn configuration of ``bourse serve``: its connection limits from ``[server]``."""
    import uvicorn

    from bourse.http.connections import ConnectionLimits, bounded_protocol

    limits = ConnectionLimits(
        header_timeout_s=server.header_timeout_s,
        body_timeout_s=server.body_timeout_s,
        keep_alive_timeout_s=server.keep_alive_timeout_s,
        max_connections=server.max_connections,
        max_header_bytes=server.max_header_bytes,
    )
    return uvicorn.Config(
        app,
        http=bounded_protocol(limits),
        log_level="warning" if server.log_level != "debug" else "debug",
        log_config=None,  # uvicorn's records go to bourse's handler, in its format
        access_log=False,
        # bourse never reads the client address: skip the X-Forwarded-* middleware
        proxy_headers=False,
        timeout_graceful_shutdown=5,
        server_header=False,
    )


def _sim_upstream(args: argparse.Namespace) -> int:
    from bourse.engines.sim import SimSettings
    from bourse.engines.sim_server import serve_sim_upstream

    try:
        settings = SimSettings.from_mapping(
            {
                k: v
                for k, v in (("ttft_ms", args.ttft_ms), ("tokens_per_s", args.tokens_per_s))
                if v is not None
            }
        )
    except ValueError as exc:
        print(f"bourse sim-upstream: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"bourse sim-upstream: http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    serve_sim_upstream(args.host, args.port, settings)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bourse", description="An OpenAI-compatible inference exchange.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the gateway")
    s.add_argument("--config", help="TOML config file (default: built-in simulated products)")
    s.add_argument("--host", help="address to bind (default from config, 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default from config, 8080)")
    s.add_argument("--data-dir", help="folder for the ledger and state (default ./data)")
    s.add_argument(
        "--database",
        help="postgresql://… to share a database between replicas (default: SQLite in the data folder)",
    )
    s.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes serving the port as one exchange (more than 1 needs [cluster] and PostgreSQL)",
    )
    s.add_argument(
        "--adopt-secret-key",
        action="store_true",
        help="make this gateway's BOURSE_SECRET_KEY the one that seals the database's webhook secrets, "
        "giving up those sealed with a lost key (docs/replicas.md)",
    )
    s.add_argument(
        "--demo",
        action="store_true",
        help="make the account 'demo' with $5.00 of credit and a key if it is missing (default: only on the "
        "first start without --config on SQLite; [server] demo = true does the same)",
    )
    s.set_defaults(func=_serve)
    u = sub.add_parser("sim-upstream", help="run a standalone OpenAI-compatible simulated engine")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=9100)
    u.add_argument("--ttft-ms", type=float, help="delay before the first token")
    u.add_argument("--tokens-per-s", type=float, help="token rate (0: as fast as possible)")
    u.set_defaults(func=_sim_upstream)
    from bourse.admin_cli import add_parser as add_admin
    from bourse.jobs_cli import add_parser as add_jobs

    add_admin(sub)
    add_jobs(sub)
    return p


def _prog(args: Any) -> str:
    command = getattr(args, "command", None)
    return "bourse" if command in (None, "serve") else f"bourse {command}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        rc: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        print(f"{_prog(args)}: {failure_line(exc)}", file=sys.stderr, flush=True)
        return EXIT_FAILURE
    return rc


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
