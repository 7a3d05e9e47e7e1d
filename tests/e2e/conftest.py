"""End-to-end fixtures: a served gateway on a real port, driven over HTTP.

Every scenario can run through two engine kinds:

- ``sim``: the gateway's in-process simulated engine;
- ``openai``: the gateway's HTTP engine pointed at ``bourse sim-upstream``
  (``create_sim_app``) served on its own real port, one upstream per deployment,
  with the internal model name ``internal-name``.

:func:`start_env` builds either from the same description (products, their policy
knobs, their deployments with sim settings). :func:`open_sse` / :func:`collect_sse`
are the raw SSE reader (httpx streaming + :class:`bourse.wire.sse.SSEParser`), which
reports comment frames and the arrival time of every frame.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from bourse.engines.sim import SimSettings
from bourse.engines.sim_server import create_sim_app
from bourse.wire.sse import SSEParser
from tests.support.gateway import Gateway, running_gateway
from tests.support.servers import serve_app_in_thread

INTERNAL_MODEL = "internal-name"
UPSTREAM_MODEL = "sim-upstream"
ENGINE_KINDS = ("sim", "openai")

USER = [{"role": "user", "content": "Tell me something about rivers."}]


# -- environment ---------------------------------------------------------------------


@dataclass
class Dep:
    """One deployment: its name, slots, floor, sim settings and other deployment keys."""

    name: str
    slots: int = 4
    floor: float = 0.0
    sim: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Product:
    name: str
    deps: list[Dep]
    knobs: dict[str, Any] = field(default_factory=dict)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    raise TypeError(f"no TOML for {v!r}")


def _table(lines: list[str], header: str, values: dict[str, Any]) -> None:
    lines.append(header)
    for k, v in values.items():
        if v is None:
            continue
        lines.append(f"{k} = {_toml_value(v)}")
    lines.append("")


@dataclass
class Env:
    """A running gateway and a way to read each deployment's engine counters."""

    kind: str
    gateway: Gateway
    upstreams: dict[str, str]
    """deployment name -> sim-upstream base URL (openai kind only)"""

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def auth(self) -> dict[str, str]:
        """The test account's Authorization header."""
        return dict(self.gateway.headers)

    def client(self, **kw: Any) -> Any:
        return self.gateway.client(**kw)

    def post(
        self, path: str, body: Any = None, *, content: Any = None, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        """An authenticated POST (raw JSON ``content`` or a ``body`` to encode)."""
        h = {**self.auth, **(headers or {})}
        if content is not None:
            h.setdefault("content-type", "application/json")
            return httpx.post(self.url + path, content=content, headers=h, timeout=30)
        return httpx.post(self.url + path, json=body, headers=h, timeout=30)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.auth, timeout=30)

    def stats(self, dep: str) -> dict[str, int]:
        if self.kind == "sim":
            return dict(self.gateway.engine(dep).stats)
        r = httpx.get(self.upstreams[dep] + "/sim/stats", timeout=5)
        r.raise_for_status()
        data: dict[str, int] = r.json()
        return data

    def wait_stats(
        self, dep: str, pred: Callable[[dict[str, int]], bool], timeout: float
    ) -> tuple[dict[str, int], float]:
        """Poll the counters until ``pred`` holds or ``timeout`` passes; (last stats, seconds)."""
        t0 = time.monotonic()
        while True:
            s = self.stats(dep)
            waited = time.monotonic() - t0
            if pred(s) or waited > timeout:
                return s, waited
            time.sleep(0.01)


@contextmanager
def start_env(
    kind: str,
    products: list[Product],
    server: dict[str, Any] | None = None,
    cluster: dict[str, Any] | None = None,
) -> Iterator[Env]:
    """A served gateway with ``products`` on the ``sim`` engine or on ``openai`` in
    front of sim upstreams; ``cluster`` (e.g. a redis_url) puts its book in Redis."""
    lines: list[str] = []
    _table(lines, "[server]", server or {})
    if cluster:
        _table(lines, "[cluster]", cluster)
    upstreams: dict[str, str] = {}
    with ExitStack() as stack:
        for p in products:
            _table(lines, f'[products."{p.name}"]', p.knobs)
            for d in p.deps:
                keys: dict[str, Any] = {"name": d.name, "slots": d.slots, "floor": d.floor}
                if kind == "sim":
                    keys["engine"] = "sim"
                    keys.update(d.sim)
                else:
                    url = stack.enter_context(serve_app_in_thread(create_sim_app(SimSettings(**d.sim))))
                    upstreams[d.name] = url
                    keys.update(engine="openai", base_url=url + "/v1", model=INTERNAL_MODEL)
                keys.update(d.extra)
                _table(lines, f'[[products."{p.name}".deployments]]', keys)
        gw = stack.enter_context(running_gateway("\n".join(lines)))
        yield Env(kind, gw, upstreams)


@pytest.fixture(params=ENGINE_KINDS)
def engine_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


# -- raw SSE reader ---------------------------------------------------------------------


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


class SSEStream:
    """An open streamed request; iterate :meth:`frames`; leave the ``with`` to disconnect."""

    def __init__(self, response: httpx.Response, t0: float) -> None:
        self.response = response
        self.t0 = t0
        self.seen: list[Frame] = []
        self.raw = b""

    @property
    def status(self) -> int:
        return self.response.status_code

    @property
    def headers(self) -> httpx.Headers:
        return self.response.headers

    def frames(self) -> Iterator[Frame]:
        parser = SSEParser()
        for piece in self.response.iter_raw():
            now = time.monotonic() - self.t0
            self.raw += piece
            for ev in parser.feed(piece):
                f = Frame(now, data=ev.data, comment=ev.comment)
                self.seen.append(f)
                yield f

    def result(self) -> SSEResult:
        return SSEResult(self.status, self.headers, list(self.seen), self.raw)


def _body_with_defaults(body: dict[str, Any]) -> dict[str, Any]:
    out = {"stream": True, **body}
    if "messages" not in out and "prompt" not in out:
        out["messages"] = USER
    return out


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
            "POST", base_url + path, json=_body_with_defaults(body), headers={**auth, **(headers or {})}
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
        if not s.headers.get("content-type", "").startswith("text/event-stream"):
            s.response.read()
            raw = s.response.content
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = None
            return SSEResult(s.status, s.headers, [], raw, parsed)
        for _ in s.frames():
            pass
        return s.result()


def assert_error_envelope(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """The answer is ``status`` with the OpenAI error envelope, an x-request-id, no trace."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers.get("x-request-id"), dict(resp.headers)
    assert resp.headers.get("content-type", "").startswith("application/json")
    text = resp.text
    assert "Traceback" not in text and 'File "' not in text, text
    body = resp.json()
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if code is not None:
        assert err["code"] == code, err
    return err
