"""GET /openapi.json: every route of the app, described; the request schemas are the
wire models' own; every error answer is the envelope."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from bourse.container import build
from bourse.http.admin import NewKey
from bourse.http.openapi_operations import OPERATIONS
from bourse.http.openapi_schemas import REF
from bourse.settings import Environment, parse_config
from bourse.wire.requests import ChatCompletionRequest, CompletionRequest

SIM = '[products.sim-fast]\n[[products.sim-fast.deployments]]\nengine = "sim"\n'
METHODS = {"get", "post", "put", "patch", "delete"}


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    folder: Path = tmp_path_factory.mktemp("data")
    config = parse_config(tomllib.loads(SIM), "<test>", env={})
    container = build(config, data_dir=folder, env=Environment(admin_key="bk_admin_x"))
    client = TestClient(container.app())  # no lifespan: nothing is started
    r = client.get("/openapi.json")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.headers.get("x-request-id")
    body: dict[str, Any] = r.json()
    yield body
    client.close()


def _operations(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method.upper(), path): op
        for path, item in doc["paths"].items()
        for method, op in item.items()
        if method in METHODS
    }


def test_every_route_is_described_and_every_description_is_a_route(doc: dict[str, Any]) -> None:
    ops = _operations(doc)
    generic = [key for key, op in ops.items() if op["tags"] == ["other"]]
    assert generic == [], f"routes without an entry in bourse.http.openapi_operations.OPERATIONS: {generic}"
    assert set(ops) == set(OPERATIONS)
    assert doc["openapi"].startswith("3.1")
    for key in [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                ("POST", "/admin/keys"), ("GET", "/openapi.json")]:  # fmt: skip
        assert key in ops, key


def test_request_bodies_are_the_wire_models(doc: dict[str, Any]) -> None:
    schemas = doc["components"]["schemas"]
    for model in (ChatCompletionRequest, CompletionRequest, NewKey):
        own = model.model_json_schema(ref_template=REF)
        own.pop("$defs", None)
        assert schemas[model.__name__] == own, model.__name__
    chat = _operations(doc)[("POST", "/v1/chat/completions")]
    media = chat["requestBody"]["content"]["application/json"]
    assert media["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"messages", "model", "max_price", "timeout", "detached"} <= set(
        schemas["ChatCompletionRequest"]["properties"]
    )


def test_a_body_is_required_exactly_when_its_model_has_a_required_field(doc: dict[str, Any]) -> None:
    """A route whose body model has only optional fields (revoke, rotate, settle) takes
    no body at all (as ``{}``): its ``requestBody`` is not required; the others are."""
    for key, op in _operations(doc).items():
        model = OPERATIONS[key].body
        if model is None:
            assert "requestBody" not in op, key
            continue
        needed = any(f.is_required() for f in model.model_fields.values())
        assert op["requestBody"]["required"] is needed, key
    ops = _operations(doc)
    for key in [("POST", "/admin/keys/{key_id}/revoke"), ("POST", "/admin/keys/{key_id}/rotate"),
                ("POST", "/admin/holds/{hold_id}/settle")]:  # fmt: skip
        assert ops[key]["requestBody"]["required"] is False, key
    assert ops[("POST", "/v1/chat/completions")]["requestBody"]["required"] is True


def test_every_error_answer_is_the_envelope(doc: dict[str, Any]) -> None:
    envelope = {"$ref": "#/components/schemas/ErrorEnvelope"}
    for key, op in _operations(doc).items():
        responses = op["responses"]
        assert responses["default"]["content"]["application/json"]["schema"] == envelope, key
        for status, answer in responses.items():
            if status.startswith(("4", "5")) and key != ("GET", "/readyz"):
                assert answer["content"]["application/json"]["schema"] == envelope, (key, status)


def test_authentication_is_declared(doc: dict[str, Any]) -> None:
    ops = _operations(doc)
    assert ops[("POST", "/v1/chat/completions")]["security"] == [{"apiKey": []}]
    assert ops[("POST", "/admin/accounts")]["security"] == [{"adminKey": []}]
    assert ops[("GET", "/v1/models")]["security"] == []
    assert set(doc["components"]["securitySchemes"]) == {"apiKey", "adminKey"}


def test_the_model_routes_answer_model_objects(doc: dict[str, Any]) -> None:
    """``GET /v1/models/{model}`` answers a ``Model`` (no key), or 400 (an id that is no
    id) or 404 (unknown); the list's entries are ``Model`` too, with ``context_length``."""
    ops = _operations(doc)
    one = ops[("GET", "/v1/models/{model}")]
    assert one["security"] == []
    assert one["parameters"] == [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    assert one["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": REF.format(model="Model")
    }
    assert {"200", "400", "404", "default"} == set(one["responses"])
    listed = ops[("GET", "/v1/models")]["responses"]["200"]["content"]["application/json"]["schema"]
    assert listed == {"$ref": REF.format(model="ModelList")}
    schemas = doc["components"]["schemas"]
    assert schemas["ModelList"]["properties"]["data"]["items"] == {"$ref": REF.format(model="Model")}
    model = schemas["Model"]
    assert model["required"] == ["id", "object", "created", "owned_by"]
    assert model["properties"]["context_length"] == {"type": "integer"}
