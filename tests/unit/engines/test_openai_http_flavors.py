"""The ``openai`` engine's flavour-dependent parts against a fake upstream: the request
id each flavour gets, the probe's verdicts (wrong URL, unknown model, refused
credentials, a listed model), a 404 from the generation route as a configuration error,
and an engine's refusal logged at WARNING."""

from __future__ import annotations

import uuid

import orjson
import pytest
from aiohttp import web
from tests.unit.engines.test_openai_http import (
    CHAT,
    SECRET,
    Handler,
    Seen,
    _answer,
    _collect,
    _fake,
    _request,
)

from bourse.domain.availability import Availability
from bourse.ports.engine import EngineFailure

MODELS = orjson.dumps({"object": "list", "data": [{"id": "internal-model"}]})


def _router(routes: dict[str, tuple[int, bytes]], seen: list[Seen]) -> Handler:
    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        raw = await request.read()
        seen.append(Seen(request.path, {k.lower(): v for k, v in request.headers.items()}, raw))
        status, body = routes.get(request.path, (404, b'{"detail":"Not Found"}'))
        return web.Response(status=status, body=body, headers={"content-type": "application/json"})

    return handler


@pytest.mark.anyio
async def test_llama_cpp_python_gets_a_uuid_request_id_and_others_ours() -> None:
    for flavor, expect_uuid in (("llama-cpp-python", True), ("vllm", False), ("llama.cpp", False)):
        seen: list[Seen] = []
        async with _fake(_answer(400, b"", seen), flavor=flavor) as engine:
            with pytest.raises(EngineFailure):
                await _collect(engine, _request(CHAT, request_id="chatcmpl-0123456789abcdef01234567"))
        sent = seen[0].headers["x-request-id"]
        if expect_uuid:
            assert str(uuid.UUID(sent)) == sent and sent.endswith("89ab-cdef01234567"), sent
        else:
            assert sent == "chatcmpl-0123456789abcdef01234567"


@pytest.mark.anyio
async def test_every_refusal_carries_the_engines_status_and_a_bounded_scrubbed_body() -> None:
    """What the run's WARNING line says of a refusal (the observer's): the engine's status
    and at most 300 bytes of its body, the API key masked; a context refusal too, though
    it is the client's doing."""
    async with _fake(_answer(400, b"")) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    assert info.value.status == 400 and info.value.upstream == "HTTP 400, body b''"
    context = orjson.dumps(
        {"error": {"message": "too long", "type": "invalid_request_error", "code": "context_length_exceeded"}}
    )
    async with _fake(_answer(400, context)) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    assert info.value.code == "context_length_exceeded"
    assert info.value.upstream == f"HTTP 400, body {context!r}"
    long = b'{"error": "' + SECRET.encode() + b" " + b"x" * 1000 + b'"}'
    async with _fake(_answer(422, long)) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
    said = info.value.upstream
    assert said.startswith('HTTP 422, body b\'{"error": "***') and said.endswith("xx'..."), said
    assert SECRET not in said and len(said) < 400, said


@pytest.mark.anyio
async def test_a_404_from_the_generation_route_marks_the_deployment_unavailable() -> None:
    heard: list[str | None] = []
    availability = Availability(on_change=heard.append)
    async with _fake(_answer(404, b'{"detail":"Not Found"}'), availability=availability) as engine:
        with pytest.raises(EngineFailure) as info:
            await _collect(engine, _request(CHAT))
        failure = info.value
        assert failure.transient and failure.kind == "config"
        assert failure.status == 503 and failure.code == "no_capacity"
        assert "HTTP 404" in failure.message and "base_url" in failure.message
        assert availability.reason == failure.message and heard == [failure.message]
        probe = await engine.probe()  # its probes cannot try the route: it stays out a while
        assert probe.reason == failure.message


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("routes", "reason"),
    [
        ({}, "GET /v1/models answered 404: is base_url right (it usually ends in /v1)?"),
        (
            {"/v1/models": (401, b"{}")},
            "the upstream refused bourse's credentials (HTTP 401); check api_key_env",
        ),
        (
            {"/v1/models": (200, orjson.dumps({"data": [{"id": "other"}]}))},
            "the upstream does not serve the model 'internal-model' (it lists 'other')",
        ),
        ({"/v1/models": (200, MODELS)}, None),
        ({"/v1/models": (200, b'{"data": []}'), "/v1/models/internal-model": (200, b"{}")}, None),
        ({"/v1/models": (503, b"")}, "GET /v1/models answered HTTP 503"),
    ],
)
async def test_probe_verdicts(routes: dict[str, tuple[int, bytes]], reason: str | None) -> None:
    seen: list[Seen] = []
    async with _fake(_router(routes, seen), flavor="openai") as engine:
        probe = await engine.probe()
    assert probe.reason == reason
    assert all("x-request-id" not in s.headers for s in seen)  # probes send no request id


@pytest.mark.anyio
async def test_probe_finds_llama_server_and_its_slots() -> None:
    routes = {
        "/props": (200, b'{"total_slots": 2, "default_generation_settings": {"n_ctx": 1024}}'),
        "/health": (200, b'{"status":"ok"}'),
        "/v1/models": (200, MODELS),
        "/metrics": (200, b"llamacpp:requests_deferred 0\n"),
    }
    seen: list[Seen] = []
    async with _fake(_router(routes, seen)) as engine:
        assert engine.flavor == "auto"
        probe = await engine.probe()
        assert (probe.reason, probe.flavor, probe.slots, probe.waiting, probe.context_length) == (
            None, "llama.cpp", 2, 0, 1024,
        )  # fmt: skip
        assert engine.flavor == "llama.cpp"
    routes["/health"] = (503, b'{"error":{"message":"Loading model"}}')
    async with _fake(_router(routes, seen)) as engine:
        assert (await engine.probe()).reason == "its health check answered HTTP 503 (loading its model)"
