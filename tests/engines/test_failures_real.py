"""Failures that stay one client's, against llama-cpp-python's own server (n_ctx 2048,
``interrupt_requests`` on, the session fixture):

- a streamed prompt over the engine's context (the server answers 200 and closes the
  stream empty) opens no breaker: the client gets an in-band ``context_length_exceeded``
  when the product's context length says the prompt cannot fit, else an upstream error
  counted once; either way the next client is served;
- a stream the server interrupts to serve another request (``[DONE]`` without a
  ``finish_reason``) ends with an error frame, recorded as an error, never completed;
- a non-streamed request that timed out reaches the engine once (its own server here).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path
from typing import Any

import httpx

from tests.support.gateway import Gateway, breaker_openings, running_gateway
from tests.support.real_engines import RealEngine, llama_cpp_python_server
from tests.support.sse import SSEResult, collect_sse, open_sse


def config(engine: RealEngine, *, context_length: int | None = None, slots: int = 1) -> str:
    context = "" if context_length is None else f"context_length = {context_length}\n"
    return f"""
[products.real]
{context}[[products.real.deployments]]
engine = "openai"
base_url = "{engine.base_url}"
model = "{engine.model}"
slots = {slots}
breaker_threshold = 3
cooldown_s = 60
"""


def served_to_another_client(gw: Gateway) -> httpx.Response:
    other = gw.new_key()
    return httpx.post(
        gw.v1 + "/completions", headers={"authorization": f"Bearer {other}"}, timeout=120,
        json={"model": "real", "prompt": "Once upon a time", "max_tokens": 4},
    )  # fmt: skip


def error_of(result: SSEResult) -> dict[str, Any]:
    [frame] = [c for c in result.chunks if "error" in c]
    error: dict[str, Any] = frame["error"]
    return error


def test_a_prompt_over_the_context_is_refused_in_band_and_opens_no_breaker(
    llama_cpp_python: RealEngine,
) -> None:
    # ~4,900 tokens in 9,800 bytes: past bourse's pre-check (bytes / 8 = 1,225 < 2,048)
    prompt = "a " * 4900
    with running_gateway(config(llama_cpp_python, context_length=llama_cpp_python.n_ctx)) as gw:
        body = {"model": "real", "stream": True, "messages": [{"role": "user", "content": prompt}]}
        result = collect_sse(gw, body)
        assert result.status == 200
        error = error_of(result)
        assert error["code"] == "context_length_exceeded", error
        assert not any(c.get("choices") for c in result.chunks)
        assert breaker_openings(gw) == 0
        # not streamed, the server says it with a 400 of its own: the client's 400
        r = httpx.post(
            gw.v1 + "/chat/completions", headers=gw.headers, json={**body, "stream": False}, timeout=120
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert r.headers["x-should-retry"] == "false"
        ok = served_to_another_client(gw)
        assert ok.status_code == 200, ok.text
        assert breaker_openings(gw) == 0


def test_a_prompt_over_an_unknown_context_is_counted_once_and_opens_no_breaker(
    llama_cpp_python: RealEngine,
) -> None:
    """The product does not know the engine's context (the default 8192): the empty 200
    stays an upstream failure, requeued, but one request counts once on the breaker."""
    prompt = "The market opens at nine and closes at five. " * 445  # ~4,900 tokens, 20,000 bytes
    with running_gateway(config(llama_cpp_python)) as gw:
        body = {"model": "real", "stream": True, "messages": [{"role": "user", "content": prompt}]}
        result = collect_sse(gw, body)
        assert result.status == 200
        error = error_of(result)
        openings = breaker_openings(gw)
        assert openings == 0, (openings, error)
        assert error["code"] == "upstream_error" and "on every attempt" in error["message"], error
        ok = served_to_another_client(gw)
        assert ok.status_code == 200, ok.text


def test_an_interrupted_stream_ends_with_an_error_frame(llama_cpp_python: RealEngine) -> None:
    """Two streamed clients of two products that share the one engine (each product's
    one slot is the engine's own capacity, so both run at once there): the second's
    arrival makes the server stop the first (``[DONE]``, no ``finish_reason``)."""
    shared = config(llama_cpp_python) + config(llama_cpp_python).replace("products.real", "products.other")
    with running_gateway(shared) as gw:
        long = {"model": "real", "stream": True, "prompt": "Once upon a time", "max_tokens": 200}
        short = {"model": "other", "stream": True, "prompt": "The sea is", "max_tokens": 8}
        second: list[SSEResult] = []
        thread = threading.Thread(
            target=lambda: second.append(collect_sse(gw, short, path="/v1/completions", timeout=120))
        )
        with open_sse(gw, long, path="/v1/completions", timeout=120) as stream:
            for frame in stream.frames():
                began = frame.data is not None and not frame.is_done and bool(frame.json.get("choices"))
                if began and thread.ident is None:  # output began: now another client arrives
                    thread.start()
            first = stream.result()
        thread.join(timeout=120)
        assert first.status == 200
        assert first.text(), "the first stream produced output before it was interrupted"
        assert not any(c["choices"][0].get("finish_reason") for c in first.content_chunks)
        error = error_of(first)
        assert "interrupted" in error["message"], error
        [done] = second
        assert done.status == 200
        assert any(c["choices"][0].get("finish_reason") for c in done.content_chunks)
        records = httpx.get(gw.v1 + "/usage", headers=gw.headers, timeout=30).json()["data"]
        outcomes = sorted(r["receipt"]["outcome"] for r in records)
        assert outcomes == ["completed", "error"], records


class CountingProxy:
    """A TCP relay on 127.0.0.1 in front of a real engine that counts the HTTP requests
    whose request line starts with ``line`` (it only watches the bytes; the engine
    answers). Runs its own event loop in a thread."""

    def __init__(self, target_port: int, line: bytes) -> None:
        self.count = 0
        self._target_port = target_port
        self._line = line
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="counting-proxy", daemon=True)
        self.port = 0

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: bool) -> None:
        try:
            while data := await reader.read(65536):
                if count:
                    self.count += data.count(self._line)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        await asyncio.gather(self._pipe(reader, up_writer, True), self._pipe(up_reader, writer, False))

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()  # (its self-pipe sockets, else left to the garbage collector)


def test_a_timed_out_non_streamed_request_is_not_sent_again(tmp_path: Path) -> None:
    """Defect 6: a non-streamed request whose answer did not come within the deployment's
    timeout is not sent again to the engine, which may still be generating it
    (llama-cpp-python's server runs an abandoned non-streamed generation to its end): it
    reaches the engine once and the client gets 504 ``upstream_timeout``, told not to retry."""
    with llama_cpp_python_server(tmp_path, interrupt_requests=False) as engine:
        port = int(engine.root.rsplit(":", 1)[1])
        with CountingProxy(port, b"POST /v1/completions ") as proxy:
            proxied = dataclasses.replace(engine, root=f"http://127.0.0.1:{proxy.port}")
            settings = config(proxied) + "first_byte_timeout_s = 0.5\nread_timeout_s = 0.5\n"
            with running_gateway(settings) as gw:
                r = httpx.post(
                    gw.v1 + "/completions", headers=gw.headers, timeout=120,
                    json={"model": "real", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0},
                )  # fmt: skip
                assert r.status_code == 504, r.text
                assert r.json()["error"]["code"] == "upstream_timeout", r.text
                assert r.headers["x-should-retry"] == "false"
                # the engine finishes the abandoned generation; then one more answer through it
                done = httpx.post(
                    engine.base_url + "/completions", timeout=300,
                    json={"model": engine.model, "prompt": "Hi", "max_tokens": 1},
                )  # fmt: skip
                assert done.status_code == 200, done.text
                assert proxy.count == 1, f"the engine was sent the request {proxy.count} times"
                assert breaker_openings(gw) == 0
