"""The raw SSE reader of the tests: frames as the client receives them.

:func:`open_sse` / :func:`collect_sse` POST a streamed request to a served gateway
(httpx streaming + :class:`bourse.wire.sse.SSEParser`) and report comment frames
and the arrival time of every frame. :func:`read_result` turns a complete body
(e.g. one answered in process) into the same :class:`SSEResult`, reading its frames
strictly, independently of the project's parser.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from bourse.wire.sse import SSEParser
from tests.support.bodies import streamed
from tests.support.env import Env
from tests.support.gateway import Gateway


@dataclass
class Frame:
    t: float
    """seconds from sending the request to receiving this frame"""
    data: str | None = None
    comment: str | None = None

    @property
    def is_done(self) -> bool:
        return self.data == "[DONE]"

    @property
    def json(self) -> dict[str, Any]:
        assert self.data is not None and not self.is_done, self
        obj: dict[str, Any] = json.loads(self.data)
        return obj


@dataclass
class SSEResult:
    status: int
    headers: httpx.Headers
    frames: list[Frame]
    raw: bytes
    body_json: Any = None
    """the JSON body when the answer was not an event stream"""

    @property
    def data_frames(self) -> list[Frame]:
        return [f for f in self.frames if f.data is not None]

    @property
    def chunks(self) -> list[dict[str, Any]]:
        """Every JSON data frame, in order ([DONE] excluded)."""
        return [f.json for f in self.data_frames if not f.is_done]

    @property
    def comments(self) -> list[str]:
        return [f.comment for f in self.frames if f.comment is not None]

    @property
    def content_chunks(self) -> list[dict[str, Any]]:
        return [c for c in self.chunks if c.get("choices")]

    def text(self) -> str:
        out = []
        for c in self.content_chunks:
            ch = c["choices"][0]
            out.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
        return "".join(out)

    def kinds(self) -> list[str]:
        """A compact sequence: 'c:<comment>' / 'data' / 'usage' / 'error' / 'DONE'."""
        out = []
        for f in self.frames:
            if f.comment is not None:
                out.append("c:" + f.comment)
            elif f.is_done:
                out.append("DONE")
            else:
                j = f.json
                if "error" in j:
                    out.append("error")
                elif j.get("choices") == []:
                    out.append("usage")
                else:
                    out.append("data")
        return out


def parse_frames(raw: bytes, t: float = 0.0) -> list[Frame]:
    """Every frame of a complete SSE body, all stamped ``t``, read strictly and without
    the parser under test: each frame is one line, ``data: <payload>`` or
    ``: <comment>``, ended by a blank line; anything else fails the test."""
    assert raw == b"" or raw.endswith(b"\n\n"), f"the body does not end with a blank line: {raw[-120:]!r}"
    frames: list[Frame] = []
    for block in raw.split(b"\n\n")[:-1]:
        line = block.decode()
        assert "\n" not in line and "\r" not in line, f"a frame of several lines: {block!r}"
        if line.startswith("data: "):
            frames.append(Frame(t, data=line.removeprefix("data: ")))
        elif line.startswith(": "):
            frames.append(Frame(t, comment=line.removeprefix(": ")))
        else:
            raise AssertionError(f"not an SSE frame: {block!r}")
    return frames


def is_event_stream(headers: httpx.Headers) -> bool:
    content_type: str = headers.get("content-type", "")
    return content_type.startswith("text/event-stream")


def read_result(status: int, headers: httpx.Headers, raw: bytes) -> SSEResult:
    """A complete answer as an :class:`SSEResult`: its frames when it is an event
    stream, else its JSON body (None if it is not JSON)."""
    if is_event_stream(headers):
        return SSEResult(status, headers, parse_frames(raw), raw)
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    return SSEResult(status, headers, [], raw, parsed)


class SSEStream:
    """An open streamed request; iterate :meth:`frames`; leave the ``with`` to disconnect."""

    def __init__(self, response: httpx.Response, t0: float) -> None:
        self.response = response
        self.t0 = t0
        self.seen: list[Frame] = []
        self.raw = b""
        # one body iterator and parser for the stream's life: a ``for f in s.frames():
        # break`` drops its generator, and had that generator owned httpx's iterator, its
        # finalizer would close the connection there and then (httpcore closes a stream
        # whose iteration ends in GeneratorExit): the client would have left at the
        # ``break``, not at the end of the ``with``
        self._pieces = response.iter_raw()
        self._parser = SSEParser()
        self._pending: deque[Frame] = deque()

    @property
    def status(self) -> int:
        return self.response.status_code

    @property
    def headers(self) -> httpx.Headers:
        return self.response.headers

    def frames(self) -> Iterator[Frame]:
        """The stream's frames from where the last call stopped; leaving the loop early
        keeps the connection open (only leaving the ``with`` closes it)."""
        while True:
            while self._pending:
                yield self._pending.popleft()
            piece = next(self._pieces, None)
            if piece is None:
                return
            now = time.monotonic() - self.t0
            self.raw += piece
            for ev in self._parser.feed(piece):
                f = Frame(now, data=ev.data, comment=ev.comment)
                self.seen.append(f)
                self._pending.append(f)

    def read_content(self, n: int) -> None:
        """Read on until ``n`` content chunks (data frames with ``choices``) have come;
        the connection stays open (:meth:`frames`)."""
        got = 0
        for f in self.frames():
            if f.data is not None and not f.is_done and f.json.get("choices"):
                got += 1
                if got == n:
                    return
        raise AssertionError(f"the stream ended after {got} of {n} content chunks")

    def result(self) -> SSEResult:
        return SSEResult(self.status, self.headers, list(self.seen), self.raw)


Target = Env | Gateway | str


def _target(target: Target) -> tuple[str, dict[str, str]]:
    """(base URL, auth headers) of a gateway to call."""
    if isinstance(target, str):
        return target, {}
    gw = target.gateway if isinstance(target, Env) else target
    return gw.url, dict(gw.headers)


@contextmanager
def open_sse(
    target: Target,
    body: dict[str, Any],
    *,
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> Iterator[SSEStream]:
    """POST a streamed request (authenticated as the gateway's test account); closing the
    ``with`` closes the connection (a disconnect)."""
    base_url, auth = _target(target)
    with httpx.Client(timeout=timeout) as client:
        t0 = time.monotonic()
        req = client.build_request(
            "POST", base_url + path, json=streamed(body), headers={**auth, **(headers or {})}
        )
        resp = client.send(req, stream=True)
        try:
            yield SSEStream(resp, t0)
        finally:
            resp.close()


def collect_sse(
    target: Target,
    body: dict[str, Any],
    *,
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> SSEResult:
    """The whole streamed answer (or the JSON error body if it was not a stream)."""
    with open_sse(target, body, path=path, headers=headers, timeout=timeout) as s:
        if not is_event_stream(s.headers):
            s.response.read()
            return read_result(s.status, s.headers, s.response.content)
        for _ in s.frames():
            pass
        return s.result()
