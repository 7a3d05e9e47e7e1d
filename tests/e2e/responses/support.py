"""Helpers of the Responses API tests: the products they run on (priced, so that every
charge shows), the raw typed-event stream of ``POST
/v1/responses`` (read strictly, every frame checked), response calls as one API key,
and waits on a background response.

Network rule: every URL these helpers reach is on 127.0.0.1.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.config import Dep, Product

FLOOR = 1.0
"""USD per 1M tokens: one micro-USD a token, so every charge is visible."""

PRODUCTS = [
    Product("fast", [Dep("fast-a", slots=4, floor=FLOOR, sim={"output_tokens": 6})]),
    Product("one", [Dep("one-a", slots=1, floor=FLOOR)]),
    Product("slow", [Dep("slow-a", slots=4, floor=FLOOR, sim={"tokens_per_s": 20, "output_tokens": 60})]),
    Product("fail", [Dep("fail-a", floor=FLOOR, sim={"fail_after_tokens": 3, "output_tokens": 10})]),
    Product("think", [Dep("think-a", floor=FLOOR, sim={"reasoning": True, "output_tokens": 5})]),
]
SERVER = {"quiet_interval_s": 0.2}

WAIT_S = 20.0
FINAL = ("completed", "incomplete", "failed", "cancelled")


@dataclass
class Frame:
    """One SSE frame: a comment, or a typed event (``event:`` line and JSON ``data``)."""

    comment: str | None = None
    event: str | None = None
    data: dict[str, Any] | None = None


def parse_frame(block: bytes) -> Frame:
    """One frame, read strictly and without the gateway's parser: ``: <comment>``, or
    exactly ``event: <type>`` and ``data: <json>`` whose ``type`` is that same name."""
    lines = block.decode().split("\n")
    if len(lines) == 1 and lines[0].startswith(": "):
        return Frame(comment=lines[0][2:])
    assert len(lines) == 2, f"not a typed event: {block!r}"
    assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
    name = lines[0][len("event: ") :]
    data = json.loads(lines[1][len("data: ") :])
    assert data["type"] == name, (name, data)
    assert isinstance(data["sequence_number"], int), data
    return Frame(event=name, data=data)


@dataclass
class EventStream:
    """An open streamed response; :meth:`frames` yields its frames as they arrive."""

    response: httpx.Response
    raw: bytes = b""
    seen: list[Frame] = field(default_factory=list)
    _buffer: bytes = b""
    _it: Iterator[bytes] | None = None

    @property
    def status(self) -> int:
        return self.response.status_code

    def frames(self) -> Iterator[Frame]:
        if self._it is None:
            self._it = self.response.iter_raw()
        for piece in self._it:
            self.raw += piece
            self._buffer += piece
            *blocks, self._buffer = self._buffer.split(b"\n\n")
            for block in blocks:
                frame = parse_frame(block)
                self.seen.append(frame)
                yield frame

    def until(self, pred: Callable[[Frame], bool]) -> Frame:
        for frame in self.frames():
            if pred(frame):
                return frame
        raise AssertionError(f"the stream ended first: {[(f.comment, f.event) for f in self.seen]}")

    @property
    def events(self) -> list[dict[str, Any]]:
        return [f.data for f in self.seen if f.data is not None]


@dataclass
class Caller:
    """Responses API calls as one API key on a gateway at ``url``."""

    url: str
    key: str
    account: str = ""

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}

    def create_raw(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(
            self.url + "/v1/responses", json=body, headers={**self.auth, **(headers or {})}, timeout=60
        )

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.create_raw(body)
        assert r.status_code == 200, (r.status_code, r.text)
        out: dict[str, Any] = r.json()
        return out

    @contextmanager
    def open_stream(self, body: dict[str, Any], timeout: float = 30.0) -> Iterator[EventStream]:
        """POST a streamed response; leaving the ``with`` closes the connection."""
        with httpx.Client(timeout=timeout) as client:
            req = client.build_request(
                "POST", self.url + "/v1/responses", json={**body, "stream": True}, headers=self.auth
            )
            resp = client.send(req, stream=True)
            try:
                yield EventStream(resp)
            finally:
                resp.close()

    def stream(self, body: dict[str, Any]) -> EventStream:
        with self.open_stream(body) as s:
            for _ in s.frames():
                pass
            return s

    def get_raw(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.auth, params=params, timeout=30)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        r = self.get_raw(f"/v1/responses/{response_id}")
        assert r.status_code == 200, (r.status_code, r.text)
        out: dict[str, Any] = r.json()
        return out

    def cancel(self, response_id: str) -> dict[str, Any]:
        r = httpx.post(self.url + f"/v1/responses/{response_id}/cancel", headers=self.auth, timeout=30)
        assert r.status_code == 200, (r.status_code, r.text)
        out: dict[str, Any] = r.json()
        return out

    def wait(
        self, response_id: str, pred: Callable[[dict[str, Any]], bool], timeout: float = WAIT_S
    ) -> tuple[dict[str, Any], list[str]]:
        """Poll the response until ``pred`` holds: (the response, the statuses seen in order)."""
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while True:
            doc = self.retrieve(response_id)
            if not seen or seen[-1] != doc["status"]:
                seen.append(doc["status"])
            if pred(doc):
                return doc, seen
            assert time.monotonic() < deadline, (
                f"{response_id}: not reached in {timeout}s; seen {seen}; {doc}"
            )
            time.sleep(0.02)

    def wait_final(self, response_id: str) -> tuple[dict[str, Any], list[str]]:
        return self.wait(response_id, lambda d: d["status"] in FINAL)


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def types_of(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]
