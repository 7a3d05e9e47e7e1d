"""The deployment smoke client of ``scripts/test-deploy``: against a served gateway
(a container, a compose replica), make an account and an API key through the admin
API, then send one chat request and one streamed one, and check both answers.

Standard library only, so that it runs under any Python 3.11 on the machine:
``python3 -m tests.deploy.smoke URL ADMIN_KEY PRODUCT [--account NAME]``. It prints
one line per step and exits 1 with the reason at the first step that fails. A 503
with ``retry-after`` (the gateway's "retry shortly": its book's Redis or its engine not
reachable for a moment) is retried, as the OpenAI SDKs do, up to :data:`RETRIES` times.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

TIMEOUT_S = 30
RETRIES = 3
"""503 answers retried a request (each after its ``retry-after``, at most :data:`WAIT_MAX_S`)."""
WAIT_MAX_S = 5.0


class SmokeFailure(Exception):
    """A step's answer was not the expected one."""


def _post(url: str, token: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )


def _open(url: str, token: str, body: dict[str, Any], retry: bool) -> Any:
    """urlopen of the POST; with ``retry``, a 503 with ``retry-after`` is asked again
    (:data:`RETRIES`); the last answer, or the last :class:`urllib.error.HTTPError`."""
    for attempt in range(RETRIES + 1):
        try:
            return urllib.request.urlopen(_post(url, token, body), timeout=TIMEOUT_S)
        except urllib.error.HTTPError as exc:
            after = exc.headers.get("retry-after")
            if not retry or exc.code != 503 or after is None or attempt == RETRIES:
                raise
            wait = min(float(after), WAIT_MAX_S)
            print(f"smoke: POST {url}: 503 {exc.read()[:200]!r}; again in {wait:g} s", flush=True)
            time.sleep(wait)
    raise AssertionError("unreachable")


def post_json(url: str, token: str, body: dict[str, Any], expect: int, retry: bool = False) -> dict[str, Any]:
    """POST ``body``; the JSON answer, or :class:`SmokeFailure` naming the status and body."""
    try:
        with _open(url, token, body, retry) as answer:
            status, raw = answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except OSError as exc:
        raise SmokeFailure(f"POST {url}: {exc}") from exc
    if status != expect:
        raise SmokeFailure(f"POST {url}: {status} (expected {expect}): {raw[:300]!r}")
    parsed: dict[str, Any] = json.loads(raw)
    return parsed


def sse_events(url: str, token: str, body: dict[str, Any]) -> Iterator[str]:
    """The ``data:`` payloads of a streamed answer, in order."""
    try:
        answer = _open(url, token, body, retry=True)
    except (urllib.error.HTTPError, OSError) as exc:
        raise SmokeFailure(f"POST {url} (stream): {exc}") from exc
    with answer:
        kind = answer.headers.get("content-type", "")
        if answer.status != 200 or not kind.startswith("text/event-stream"):
            raise SmokeFailure(f"POST {url} (stream): {answer.status} {kind!r}")
        for line in answer:
            text = line.decode().rstrip("\r\n")
            if text.startswith("data:"):
                yield text[5:].strip()


def api_key(base: str, admin_key: str, account: str, product: str) -> str:
    """A new account with $1.00 of credit and a key for ``product``."""
    post_json(f"{base}/admin/accounts", admin_key, {"id": account, "credit_usd": 1}, 201)
    made = post_json(f"{base}/admin/keys", admin_key, {"account": account, "products": [product]}, 201)
    key = made.get("key")
    if not isinstance(key, str) or not key.startswith("bk_"):
        raise SmokeFailure(f"POST /admin/keys answered no key: {made}")
    return key


def chat(base: str, key: str, product: str) -> str:
    """One chat completion, not streamed: its text (non-empty) and its cost."""
    body = {"model": product, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8}
    answer = post_json(f"{base}/v1/chat/completions", key, body, 200, retry=True)
    try:
        text = answer["choices"][0]["message"]["content"]
        cost = answer["usage"]["cost_micros"]
    except (KeyError, IndexError, TypeError) as exc:
        raise SmokeFailure(f"chat answer without {exc}: {answer}") from exc
    if not text or answer["choices"][0].get("finish_reason") not in ("stop", "length"):
        raise SmokeFailure(f"chat answer without text or finish: {answer}")
    return f"{len(text)} characters, {cost} micro-USD"


def stream(base: str, key: str, product: str) -> str:
    """One streamed chat completion: content chunks, then ``[DONE]`` last."""
    body = {
        "model": product,
        "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 8,
        "stream": True,
    }
    return check_stream(list(sse_events(f"{base}/v1/chat/completions", key, body)))


def check_stream(events: list[str]) -> str:
    """A stream's ``data:`` payloads: content chunks, ``[DONE]`` last; a summary line."""
    if not events or events[-1] != "[DONE]":
        raise SmokeFailure(f"stream did not end with [DONE]: {events[-3:]}")
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c.get("choices"))
    if not text:
        raise SmokeFailure(f"stream carried no content: {events}")
    return f"{len(chunks)} chunks, {len(text)} characters, then [DONE]"


def run(base: str, admin_key: str, product: str, account: str) -> None:
    key = api_key(base, admin_key, account, product)
    print(f"smoke: {base}: account {account!r} and its key made through the admin API", flush=True)
    print(f"smoke: {base}: chat: {chat(base, key, product)}", flush=True)
    print(f"smoke: {base}: stream: {stream(base, key, product)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="smoke", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("base", help="the gateway's root URL, e.g. http://127.0.0.1:18080")
    p.add_argument("admin_key")
    p.add_argument("product")
    p.add_argument("--account", default="smoke")
    args = p.parse_args(argv)
    try:
        run(args.base.rstrip("/"), args.admin_key, args.product, args.account)
    except SmokeFailure as exc:
        print(f"smoke: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
