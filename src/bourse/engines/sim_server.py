"""``bourse sim-upstream``: a standalone OpenAI-compatible HTTP server made of one SimEngine.

Owns the sim's HTTP face: the two completion routes (streamed as SSE or aggregated
into one JSON answer), the engine's counters (``GET /sim/stats``, ``POST
/sim/reset``), ``/v1/models`` (and ``/v1/models/{id}``, for any id: it serves any
model name) and ``/healthz``. It stands in for vLLM or llama.cpp
in tests and benchmarks: it honours the body's ``sim`` object, takes the attempt
number from ``x-bourse-attempt``, answers a failure before output with an HTTP
error instead of a stream, and closes the engine's generation the moment the
client disconnects, so cancellation can be observed from the outside.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import anyio
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from bourse.engines.sim import SimEngine, SimSettings
from bourse.ports.engine import ChunkEvent, EngineEvent, EngineFailure, GenerationRequest, Kind, UsageEvent
from bourse.wire.chunks import Aggregator

__all__ = ["DEFAULT_MODEL_NAME", "create_sim_app", "serve_sim_upstream"]

DEFAULT_MODEL_NAME = "sim-upstream"

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
_DONE = b"data: [DONE]\n\n"


class _JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _error(status: int, message: str, error_type: str, code: str, request_id: str | None = None) -> _JSON:
    headers = {"x-request-id": request_id} if request_id else None
    envelope = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return _JSON(envelope, status_code=status, headers=headers)


def _failure_response(exc: EngineFailure, request_id: str, *, after_output: bool = False) -> _JSON:
    if exc.status == 400:
        return _error(400, exc.message, exc.error_type, exc.code, request_id)
    status = 502 if after_output else 503
    return _error(status, exc.message, "server_error", exc.code, request_id)


def _usage_body(usage: UsageEvent) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        **usage.details,
    }


def _frame(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class _CompletionsEndpoint:
    """The ASGI app of ``POST /v1/chat/completions`` or ``POST /v1/completions``."""

    def __init__(self, engine: SimEngine, kind: Kind) -> None:
        self._engine = engine
        self._kind: Kind = kind
        self._object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self._id_prefix = "chatcmpl-" if kind == "chat" else "cmpl-"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        request_id = request.headers.get("x-request-id") or self._id_prefix + uuid.uuid4().hex
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            body = None
        response: Response
        if not isinstance(body, dict):
            response = _error(
                400, "the body must be a JSON object", "invalid_request_error", "invalid_request"
            )
            return await response(scope, receive, send)
        try:
            attempt = int(request.headers.get("x-bourse-attempt", "0"))
        except ValueError:
            response = _error(
                400, "x-bourse-attempt must be an integer", "invalid_request_error", "invalid_request"
            )
            return await response(scope, receive, send)
        events = self._engine.generate(GenerationRequest(request_id, self._kind, body, attempt))
        if body.get("stream") is True:
            options = body.get("stream_options")
            include_usage = isinstance(options, dict) and options.get("include_usage") is True
            await self._stream(receive, send, events, request_id, include_usage)
        else:
            await self._answer(scope, receive, send, events, request_id)

    async def _answer(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        events: AsyncGenerator[EngineEvent, None],
        request_id: str,
    ) -> None:
        """One JSON answer; a client that disconnects meanwhile cancels the generation
        (as vLLM does for non-streamed requests)."""
        response: Response | None = None
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message: Message = await receive()
                    if message["type"] == "http.disconnect":
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            try:
                response = await self._aggregate(events, request_id)
            finally:
                tg.cancel_scope.cancel()
        if response is not None:
            await response(scope, receive, send)

    async def _stream(
        self,
        receive: Receive,
        send: Send,
        events: AsyncGenerator[EngineEvent, None],
        request_id: str,
        include_usage: bool,
    ) -> None:
        """Relay the engine as SSE while a watcher cancels everything on disconnect."""
        try:
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    while True:
                        message: Message = await receive()
                        if message["type"] == "http.disconnect":
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch_disconnect)
                try:
                    await self._relay(send, events, request_id, include_usage)
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()

    async def _relay(
        self,
        send: Send,
        events: AsyncGenerator[EngineEvent, None],
        request_id: str,
        include_usage: bool,
    ) -> None:
        try:
            event: EngineEvent | None = await anext(events, None)
        except EngineFailure as exc:
            response = _failure_response(exc, request_id)
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": response.raw_headers,
                }
            )
            await send({"type": "http.response.body", "body": response.body})
            return
        headers = [*_SSE_HEADERS, (b"x-request-id", request_id.encode("latin-1"))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        usage: UsageEvent | None = None
        try:
            while event is not None:
                if isinstance(event, ChunkEvent):
                    await send({"type": "http.response.body", "body": _frame(event.chunk), "more_body": True})
                else:
                    usage = event
                event = await anext(events, None)
        except EngineFailure as exc:
            error = {"error": {"message": exc.message, "type": "server_error", "code": "upstream_error"}}
            await send({"type": "http.response.body", "body": _frame(error), "more_body": False})
            return
        tail = _DONE
        if usage is not None and include_usage:
            usage_chunk = {
                "id": request_id,
                "object": self._object,
                "created": int(time.time()),
                "model": self._engine.model_name,
                "choices": [],
                "usage": _usage_body(usage),
            }
            tail = _frame(usage_chunk) + _DONE
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _aggregate(self, events: AsyncGenerator[EngineEvent, None], request_id: str) -> Response:
        """One ``chat.completion`` / ``text_completion`` built from the engine's chunks."""
        answer = Aggregator(self._kind)
        usage: UsageEvent | None = None
        created = int(time.time())
        chunks = 0
        async with aclosing(events):
            try:
                async for event in events:
                    if isinstance(event, UsageEvent):
                        usage = event
                        continue
                    chunks += 1
                    created = event.chunk["created"]
                    answer.add(event.chunk)
            except EngineFailure as exc:
                return _failure_response(exc, request_id, after_output=chunks > 0)
        body = answer.build(
            request_id, self._engine.model_name, created, None if usage is None else _usage_body(usage)
        )
        return _JSON(body, headers={"x-request-id": request_id})


def create_sim_app(settings: SimSettings, *, model_name: str = DEFAULT_MODEL_NAME) -> Starlette:
    """The sim upstream's ASGI app, with one :class:`SimEngine` inside."""
    engine = SimEngine(settings, model_name)
    created = int(time.time())

    async def stats(request: Request) -> Response:
        return _JSON(dict(engine.stats))

    async def reset(request: Request) -> Response:
        engine.reset_stats()
        return _JSON(dict(engine.stats))

    async def models(request: Request) -> Response:
        model = {"id": model_name, "object": "model", "created": created, "owned_by": "bourse-sim"}
        return _JSON({"object": "list", "data": [model]})

    async def one_model(request: Request) -> Response:
        # the sim answers whatever model it is asked for: it serves every name
        name = request.path_params["model"]
        return _JSON({"id": name, "object": "model", "created": created, "owned_by": "bourse-sim"})

    async def healthz(request: Request) -> Response:
        return _JSON({"status": "ok"})

    routes = [
        Route("/v1/chat/completions", _CompletionsEndpoint(engine, "chat"), methods=["POST"]),
        Route("/v1/completions", _CompletionsEndpoint(engine, "completion"), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", one_model, methods=["GET"]),
        Route("/sim/stats", stats, methods=["GET"]),
        Route("/sim/reset", reset, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
    app = Starlette(routes=routes)
    app.state.engine = engine
    return app


def serve_sim_upstream(
    host: str, port: int, settings: SimSettings, *, model_name: str = DEFAULT_MODEL_NAME
) -> None:
    """Run the sim upstream with uvicorn until interrupted."""
    uvicorn.run(create_sim_app(settings, model_name=model_name), host=host, port=port, log_level="warning")
