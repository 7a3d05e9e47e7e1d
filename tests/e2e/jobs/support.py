"""Helpers of the detached-job tests: submit and poll jobs as one API key, hold a
product's only slot with a slow stream, and run ``bourse serve`` as a real process.

Network rule: every URL these helpers reach is on 127.0.0.1.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from tests.e2e.money.support import As, new_caller, read_until
from tests.support.bodies import USER
from tests.support.gateway import Gateway
from tests.support.sse import SSEStream, open_sse

WAIT_S = 20.0
"""Generous bound on any wait for a job to reach a state."""

_n = 0


def unique(prefix: str) -> str:
    global _n
    _n += 1
    return f"{prefix}-{os.getpid()}-{_n}"


def chat_body(model: str, *, seed: int = 7, tokens: int = 10, **extra: Any) -> dict[str, Any]:
    """A chat body whose answer is exactly ``tokens`` tokens (sim), same text for a seed."""
    return {"model": model, "messages": USER, "seed": seed, "max_tokens": tokens,
            "sim": {"output_tokens": tokens}, **extra}  # fmt: skip


def text_body(model: str, *, seed: int = 7, tokens: int = 10, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "Once upon a time", "seed": seed, "max_tokens": tokens,
            "sim": {"output_tokens": tokens}, **extra}  # fmt: skip


@dataclass
class Jobs:
    """Job calls as one API key (``url`` is the gateway's base URL)."""

    url: str
    key: str
    account: str = ""

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}

    def submit_raw(self, doc: Any, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(
            self.url + "/v1/jobs", json=doc, headers={**self.auth, **(headers or {})}, timeout=30
        )

    def submit(
        self, body: dict[str, Any], endpoint: str = "/v1/chat/completions", **extra: Any
    ) -> dict[str, Any]:
        r = self.submit_raw({"endpoint": endpoint, "body": body, **extra})
        assert r.status_code == 202, (r.status_code, r.text)
        job: dict[str, Any] = r.json()
        assert r.headers.get("x-request-id") == job["request_id"], (dict(r.headers), job)
        return job

    def get_raw(self, job_id: str) -> httpx.Response:
        return httpx.get(self.url + f"/v1/jobs/{job_id}", headers=self.auth, timeout=30)

    def get(self, job_id: str) -> dict[str, Any]:
        r = self.get_raw(job_id)
        assert r.status_code == 200, (r.status_code, r.text)
        out: dict[str, Any] = r.json()
        return out

    def cancel_raw(self, job_id: str) -> httpx.Response:
        return httpx.post(self.url + f"/v1/jobs/{job_id}/cancel", headers=self.auth, timeout=30)

    def cancel(self, job_id: str) -> dict[str, Any]:
        r = self.cancel_raw(job_id)
        assert r.status_code == 200, (r.status_code, r.text)
        out: dict[str, Any] = r.json()
        return out

    def list(self, **params: Any) -> dict[str, Any]:
        r = httpx.get(self.url + "/v1/jobs", headers=self.auth, params=params, timeout=30)
        assert r.status_code == 200, (r.status_code, r.text)
        out: dict[str, Any] = r.json()
        return out

    def wait(
        self, job_id: str, pred: Callable[[dict[str, Any]], bool], timeout: float = WAIT_S, what: str = ""
    ) -> dict[str, Any]:
        """Poll the job until ``pred`` holds; fail with the states seen otherwise."""
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while True:
            job = self.get(job_id)
            if not seen or seen[-1] != job["status"]:
                seen.append(job["status"])
            if pred(job):
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: {what or 'condition'} not reached in {timeout}s; "
                                     f"states seen {seen}; last {job}")  # fmt: skip
            time.sleep(0.03)

    def wait_status(self, job_id: str, *statuses: str, timeout: float = WAIT_S) -> dict[str, Any]:
        return self.wait(job_id, lambda j: j["status"] in statuses, timeout, what=f"status in {statuses}")


def caller(gw: Gateway, prefix: str, credit_usd: float = 10.0, **limits: Any) -> tuple[As, Jobs]:
    """A new funded account with a key: (money view, job calls)."""
    me = new_caller(gw, unique(prefix), credit_usd, **limits)
    return me, Jobs(gw.url, me.key, me.account)


@contextmanager
def slot_held(gw: Gateway, model: str, *, tokens: int = 400) -> Iterator[SSEStream]:
    """A slow stream (the gateway's default account) that holds one slot of ``model``
    from its first token until the ``with`` ends (then it disconnects: the slot frees)."""
    body = {"model": model, "messages": USER, "max_tokens": tokens,
            "sim": {"output_tokens": tokens, "tokens_per_s": 20}}  # fmt: skip
    with open_sse(gw, body) as s:
        assert s.status == 200, s.response.read()
        read_until(s, data_chunks=1)
        yield s


def direct(gw_url: str, key: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    """The same request answered directly, not streamed."""
    r = httpx.post(gw_url + path, json={**body, "stream": False},
                   headers={"authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, (r.status_code, r.text)
    out: dict[str, Any] = r.json()
    return out


def content_of(doc: dict[str, Any]) -> str:
    ch = doc["choices"][0]
    if "message" in ch:
        return str(ch["message"]["content"])
    return str(ch["text"])


def tokens_of(doc: dict[str, Any]) -> tuple[int, int, int]:
    u = doc["usage"]
    return int(u["prompt_tokens"]), int(u["completion_tokens"]), int(u["total_tokens"])


def usage_records(url: str, key: str) -> list[dict[str, Any]]:
    """Every usage record of the key's account (all pages)."""
    out: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 100}
        if after:
            params["after"] = after
        r = httpx.get(
            url + "/v1/usage", params=params, headers={"authorization": f"Bearer {key}"}, timeout=30
        )
        assert r.status_code == 200, r.text
        page = r.json()
        out.extend(page["data"])
        after = page.get("next_after")
        if not page.get("has_more") or not after:
            return out


# -- bourse serve as a process -------------------------------------------------------------
