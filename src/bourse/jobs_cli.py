"""``bourse jobs …``: submit, watch, cancel and fetch detached jobs (over HTTP).

Failures (no key, a file that cannot be read or is not JSON, a server that cannot be
reached or does not answer JSON) are raised; :func:`bourse.cli.main` reports them in
one line, exit status 2."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import httpx

from bourse.cli_errors import CliError
from bourse.settings import read_environment

FINAL = {"succeeded", "failed", "canceled", "expired"}


def add_parser(sub: Any) -> None:
    j = sub.add_parser("jobs", help="detached jobs on a running gateway")
    j.add_argument("--url", help="the gateway (default $BOURSE_URL or http://127.0.0.1:8080)")
    j.add_argument("--api-key", help="default $BOURSE_API_KEY")
    acts = j.add_subparsers(dest="action", required=True)
    s = acts.add_parser(
        "submit", help="submit a job: FILE or - holds {endpoint, body, webhook_url?, ttl_s?} or a bare body"
    )
    s.add_argument("file")
    s.add_argument("--endpoint", default="/v1/chat/completions", help="for a bare request body")
    s.add_argument("--watch", action="store_true", help="watch it until it ends")
    w = acts.add_parser("watch", help="a live line until the job ends")
    w.add_argument("id")
    w.add_argument("--interval", type=float, default=0.5)
    c = acts.add_parser("cancel", help="cancel a job")
    c.add_argument("id")
    r = acts.add_parser("result", help="print the job's result (or error)")
    r.add_argument("id")
    j.set_defaults(func=run)


def _bar(done: int, total: int, width: int = 24) -> str:
    frac = 0.0 if total <= 0 else min(1.0, done / total)
    full = int(frac * width)
    return "[" + "#" * full + "." * (width - full) + f"] {frac * 100:5.1f}%"


def line(job: dict[str, Any]) -> str:
    status = job.get("status", "?")
    out = f"{job.get('id')} {status:9}"
    q = job.get("queue")
    if status == "queued" and q:
        out += f" position={q.get('position')} bid={q.get('bid')} level={q.get('level')}"
    p = job.get("progress")
    if status == "running" and p:
        tokens, total = int(p.get("tokens") or 0), int(p.get("max_tokens") or 0)
        out += f" tokens={tokens}" + (f" {_bar(tokens, total)}" if total else "")
    if status == "succeeded":
        usage = (job.get("result") or {}).get("usage") or {}
        out += f" tokens={usage.get('completion_tokens')} cost_micros={usage.get('cost_micros')}"
    if status == "failed":
        out += f" error={((job.get('error') or {}).get('error') or {}).get('message')}"
    return out


def _doc(r: httpx.Response) -> Any:
    """The JSON answer of ``r``; a server that does not answer JSON is a CLI failure."""
    try:
        return r.json()
    except ValueError:
        raise CliError(f"{r.request.url} answered {r.status_code} with a body that is not JSON") from None


def watch(client: httpx.Client, job_id: str, interval: float) -> int:
    tty = sys.stderr.isatty()
    last = ""
    while True:
        r = client.get(f"/v1/jobs/{job_id}")
        job = _doc(r)
        if r.status_code != 200:
            print(json.dumps(job), file=sys.stderr)
            return 1
        text = line(job)
        if tty:
            print("\r\033[K" + text, end="", file=sys.stderr, flush=True)
        elif text != last:
            print(text, file=sys.stderr, flush=True)
        last = text
        if job.get("status") in FINAL:
            if tty:
                print(file=sys.stderr)
            return 0 if job["status"] == "succeeded" else 1
        time.sleep(interval)


def run(args: argparse.Namespace) -> int:
    env = read_environment()
    url = (args.url or env.url or "http://127.0.0.1:8080").rstrip("/")
    key = args.api_key or env.api_key
    if not key:
        raise CliError("no API key: pass --api-key or set BOURSE_API_KEY")
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=30) as client:
        return _act(client, args)


def _read_job(path: str, endpoint: str) -> dict[str, Any]:
    """The job in FILE (or stdin for ``-``): {endpoint, body, …} or a bare request body."""
    if path == "-":
        text = sys.stdin.read()
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            raise CliError(f"{path} is not UTF-8 text") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise CliError(f"{path} is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CliError(f"{path}: expected a JSON object")
    return doc if "endpoint" in doc else {"endpoint": endpoint, "body": doc}


def _act(client: httpx.Client, args: argparse.Namespace) -> int:
    if args.action == "submit":
        r = client.post("/v1/jobs", json=_read_job(args.file, args.endpoint))
        job = _doc(r)
        print(json.dumps(job, indent=2))
        if r.status_code != 202:
            return 1
        return watch(client, job["id"], 0.5) if args.watch else 0
    if args.action == "watch":
        return watch(client, args.id, args.interval)
    if args.action == "cancel":
        r = client.post(f"/v1/jobs/{args.id}/cancel")
        print(json.dumps(_doc(r), indent=2))
        return 0 if r.is_success else 1
    r = client.get(f"/v1/jobs/{args.id}")
    job = _doc(r)
    if r.status_code != 200:
        print(json.dumps(job), file=sys.stderr)
        return 1
    print(json.dumps(job.get("result") or job.get("error") or job, indent=2))
    return 0 if job.get("status") == "succeeded" else 1
