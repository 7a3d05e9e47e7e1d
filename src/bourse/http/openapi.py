"""``GET /openapi.json``: the API described from the app's own routes.

Every route the app serves is listed, with the methods and path parameters its
Starlette route declares, so the document cannot miss a route. What is known of each
operation (summary, authentication, query parameters, answers) is in
:data:`~bourse.http.openapi_operations.OPERATIONS`; the request bodies are the pydantic
models the routes validate with (``model_json_schema()``), so the schema and the
validation cannot drift apart; the answers' schemas are
:data:`~bourse.http.openapi_schemas.ANSWERS`. Every error answer is the OpenAI error
envelope. A route missing from ``OPERATIONS`` is still listed, with a generic answer (a
unit test requires an entry for each). This module builds the document.

The document is built once, on the first request, and kept as bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

import bourse
from bourse.http.openapi_operations import ERROR_CODES, OPERATIONS, UNDESCRIBED, Operation
from bourse.http.openapi_schemas import ANSWERS, REF, ref
from bourse.services.ids import new_request_id


def _json(description: str, schema: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ref(schema)}}}


def _model_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, str]:
    """``model``'s JSON schema added to ``components`` (its nested models too); a reference to it."""
    schema = model.model_json_schema(ref_template=REF)
    for name, part in [*schema.pop("$defs", {}).items(), (model.__name__, schema)]:
        if components.setdefault(name, part) != part:
            raise ValueError(f"two schemas named {name!r} in the OpenAPI document")
    return ref(model.__name__)


def _responses(op: Operation, path_params: bool) -> dict[str, Any]:
    ok: dict[str, Any] = (
        {"description": "the answer"} if op.answer is None else _json("the answer", op.answer)
    )
    if op.stream:
        ok["content"]["text/event-stream"] = {"schema": ref(op.event)}
    out: dict[str, Any] = {str(op.ok): ok}
    for status, (description, schema) in op.extra.items():
        out[str(status)] = _json(description, schema)
    errors = set(op.errors)
    if op.auth != "none":
        errors |= {401, 403}
    if op.body is not None or op.params:
        errors.add(400)
    if op.body is not None:
        errors.add(413)
    if path_params:
        errors.add(404)
    for status in sorted(errors - {op.ok, *op.extra}):
        out[str(status)] = _json(ERROR_CODES[status], "ErrorEnvelope")
    out["default"] = _json("any other error (the OpenAI error envelope)", "ErrorEnvelope")
    return out


def _operation(method: str, path: str, route: Route, components: dict[str, Any]) -> dict[str, Any]:
    op = OPERATIONS.get((method, path)) or Operation(route.name or path, "other", answer=None)
    names = list(route.param_convertors)
    out: dict[str, Any] = {
        "operationId": f"{method.lower()}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
        "summary": op.summary,
        "tags": [op.tag],
        "responses": _responses(op, bool(names)),
    }
    params = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names]
    params += [
        {"name": p.name, "in": p.where, "required": False, "schema": p.schema, "description": p.description}
        for p in op.params
    ]
    if params:
        out["parameters"] = params
    if op.body is not None:
        schema = _model_schema(op.body, components)
        media: dict[str, Any] = {"schema": schema}
        if op.example is not None:
            media["example"] = op.example
        # a model of optional fields only takes no body at all (read as ``{}``)
        required = any(f.is_required() for f in op.body.model_fields.values())
        out["requestBody"] = {"required": required, "content": {"application/json": media}}
    out["security"] = [] if op.auth == "none" else [{"apiKey" if op.auth == "key" else "adminKey": []}]
    return out


def document(routes: Sequence[BaseRoute]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes`` (every method of every :class:`Route`)."""
    components: dict[str, Any] = dict(ANSWERS)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route) or route.path_format.startswith(UNDESCRIBED):
            continue
        for method in sorted((route.methods or set()) - {"HEAD"}):
            item = paths.setdefault(route.path_format, {})
            item[method.lower()] = _operation(method, route.path_format, route, components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "bourse",
            "version": bourse.__version__,
            "description": "An OpenAI-compatible inference exchange: admission by price, metered tokens.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "an API key (`bk_…`)"},
                "adminKey": {"type": "http", "scheme": "bearer", "description": "the admin key"},
            },
        },
    }


def route(routes: Sequence[BaseRoute]) -> Route:
    """``GET /openapi.json`` describing ``routes`` and itself."""
    cached: list[bytes] = []

    async def openapi(request: Request) -> Response:
        if not cached:
            cached.append(orjson.dumps(document([*routes, this])))
        return Response(
            cached[0], media_type="application/json", headers={"x-request-id": new_request_id("req")}
        )

    this = Route("/openapi.json", openapi, methods=["GET"])
    return this
