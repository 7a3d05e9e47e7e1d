"""``GET /openapi.json``: the API described from the app's own routes.

Every route the app serves is listed, with the methods and path parameters its
Starlette route declares, so the document cannot miss a route. What is known of each
operation (summary, authentication, query parameters, answers) is in
:data:`OPERATIONS`; the request bodies are the pydantic models the routes validate
with (``model_json_schema()``), so the schema and the validation cannot drift apart.
Every error answer is the OpenAI error envelope. A route missing from
:data:`OPERATIONS` is still listed, with a generic answer (a unit test requires an
entry for each).

The document is built once, on the first request, and kept as bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Any, Literal

import orjson
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

import bourse
from bourse.domain.values import immutable
from bourse.http.admin import PAGE_MAX, Credit, NewAccount, NewKey, RevokeKey, RotateKey, SettleHold
from bourse.http.jobs import NewJob
from bourse.services.ids import new_request_id
from bourse.wire.requests import ChatCompletionRequest, CompletionRequest
from bourse.wire.responses import ResponsesRequest

Auth = Literal["key", "admin", "none"]
REF = "#/components/schemas/{model}"

_ERROR_CODES: dict[int, str] = {
    400: "a bad body or parameter (`param` names it)",
    401: "no key or an unknown key",
    402: "the balance cannot cover the hold",
    403: "the key may not use this product or route",
    404: "no such product, route or record",
    408: "the order waited its timeout in the book",
    409: "a conflict (Idempotency-Key, an existing account, a closed hold)",
    413: "the body is over `[server] max_body_bytes`",
    429: "a rate limit of the key (with `retry-after`)",
    502: "the engine failed and the requeues were spent",
    503: "no capacity (with `retry-after`)",
}


@immutable
class Param:
    """A query or header parameter."""

    name: str
    schema: dict[str, Any]
    description: str
    where: Literal["query", "header"] = "query"


@immutable
class Operation:
    """What the document says of one method on one route."""

    summary: str
    tag: str
    auth: Auth = "key"
    body: type[BaseModel] | None = None
    ok: int = 200
    answer: str | None = "Object"
    """The component schema of the (JSON) success answer; None: not described."""
    stream: bool = False
    """The success answer may be an event stream (``stream: true``)."""
    event: str = "Event"
    """The component schema of one event of that stream."""
    errors: tuple[int, ...] = ()
    params: tuple[Param, ...] = ()
    extra: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Other answers: status -> (description, component schema)."""
    example: dict[str, Any] | None = None
    """A request body (for the built-in product ``sim-fast``)."""


_INT = {"type": "integer"}
_LIMIT = Param("limit", {"type": "integer", "minimum": 1, "maximum": 100}, "page size (default 20)")
_AFTER = Param("after", {"type": "string"}, "the `next_after` of the previous page")
_ADMIN_LIMIT = Param(
    "limit", {"type": "integer", "minimum": 1, "maximum": PAGE_MAX}, "page size (default 100)"
)
_IDEM = Param(
    "Idempotency-Key",
    {"type": "string", "minLength": 1, "maxLength": 255},
    "replays the stored answer of the same key and body",
    "header",
)
_BID = Param("X-Max-Price", {"type": "string"}, "the bid, USD per 1M tokens (as `max_price`)", "header")
_WAIT = Param("X-Book-Timeout", {"type": "string"}, "seconds the order may wait in the book", "header")
_CHAT = {"model": "sim-fast", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
_RUN_ERRORS = (402, 403, 404, 408, 409, 429, 502, 503)
_JOB_ERRORS = (402, 403, 404, 409, 429, 503)

UNDESCRIBED = ("/dashboard",)
"""Route prefixes left out of the document: the web dashboard's pages and its own
session-cookie API (docs/dashboard.md), which are not part of the public API."""

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/chat/completions"): Operation(
        "Create a chat completion (OpenAI-compatible; `stream` for server-sent events)",
        "completions",
        body=ChatCompletionRequest,
        example=_CHAT,
        answer="ChatCompletion",
        stream=True,
        errors=_RUN_ERRORS,
        params=(_IDEM, _BID, _WAIT),
        extra={202: ("`detached: true`: the job", "Job")},
    ),
    ("POST", "/v1/completions"): Operation(
        "Create a legacy completion (OpenAI-compatible; `stream` for server-sent events)",
        "completions",
        body=CompletionRequest,
        example={"model": "sim-fast", "prompt": "Once upon a time", "max_tokens": 16, "stream": True},
        answer="TextCompletion",
        stream=True,
        errors=_RUN_ERRORS,
        params=(_IDEM, _BID, _WAIT),
        extra={202: ("`detached: true`: the job", "Job")},
    ),
    ("POST", "/v1/responses"): Operation(
        "Create a response (OpenAI's Responses API; `stream` for typed server-sent events, "
        "`background` to run it as a job)",
        "responses",
        body=ResponsesRequest,
        example={"model": "sim-fast", "input": "Hello", "max_output_tokens": 16},
        answer="Response",
        stream=True,
        event="ResponseEvent",
        errors=_RUN_ERRORS,
        params=(_IDEM, _BID, _WAIT),
    ),
    ("GET", "/v1/responses/{response_id}"): Operation(
        "A stored response (`stream=true&starting_after=N` resumes a background stream)",
        "responses",
        answer="Response",
        params=(
            Param("stream", {"type": "boolean"}, "resume a background stream"),
            Param("starting_after", {"type": "integer"}, "the last `sequence_number` already read"),
        ),
    ),
    ("DELETE", "/v1/responses/{response_id}"): Operation(
        "Delete a stored response", "responses", answer="ResponseDeleted"
    ),
    ("GET", "/v1/responses/{response_id}/input_items"): Operation(
        "A stored response's input items",
        "responses",
        answer="ItemList",
        params=(
            _LIMIT,
            Param("after", {"type": "string"}, "the `last_id` of the previous page"),
            Param("order", {"enum": ["asc", "desc"]}, "default desc"),
        ),
    ),
    ("POST", "/v1/responses/{response_id}/cancel"): Operation(
        "Cancel a background response (a queued one is never charged)", "responses", answer="Response"
    ),
    ("GET", "/v1/models"): Operation("List the products", "market", auth="none", answer="ModelList"),
    ("GET", "/v1/models/{model}"): Operation(
        "One product (its id may hold a `/`, as is or percent-encoded)",
        "market",
        auth="none",
        answer="Model",
        errors=(400,),
    ),
    ("GET", "/v1/market"): Operation(
        "Every product's market, without the book", "market", auth="none", answer="List"
    ),
    ("GET", "/v1/market/{product}"): Operation(
        "A product's market: level, slots, book, recent clears", "market", auth="none", answer="Market"
    ),
    ("GET", "/v1/account"): Operation(
        "The key's account: balance, holds, spend", "account", answer="Account"
    ),
    ("GET", "/v1/usage"): Operation(
        "The account's usage records, newest first",
        "account",
        answer="Page",
        params=(
            _LIMIT,
            _AFTER,
            Param("before", {"type": "number"}, "unix time"),
            Param("since", {"type": "number"}, "unix time"),
            Param("until", {"type": "number"}, "unix time"),
        ),
    ),
    ("GET", "/v1/usage/{request_id}"): Operation("One usage record (a receipt)", "account", answer="Usage"),
    ("POST", "/v1/jobs"): Operation(
        "Submit a detached job",
        "jobs",
        body=NewJob,
        example={"endpoint": "/v1/chat/completions", "body": _CHAT},
        ok=202,
        answer="Job",
        errors=_JOB_ERRORS,
        params=(_IDEM, _BID, _WAIT),
    ),
    ("GET", "/v1/jobs"): Operation(
        "The account's jobs, newest first", "jobs", answer="Page", params=(_LIMIT, _AFTER)
    ),
    ("GET", "/v1/jobs/{job_id}"): Operation("A job: its state, progress and result", "jobs", answer="Job"),
    ("POST", "/v1/jobs/{job_id}/cancel"): Operation("Cancel a job", "jobs", answer="Job"),
    ("POST", "/admin/accounts"): Operation(
        "Create an account",
        "admin",
        auth="admin",
        body=NewAccount,
        example={"id": "acme", "credit_usd": 10.0},
        ok=201,
        answer="AdminAccount",
        errors=(409,),
    ),
    ("GET", "/admin/accounts/{account_id}"): Operation(
        "An account", "admin", auth="admin", answer="AdminAccount"
    ),
    ("POST", "/admin/accounts/{account_id}/credit"): Operation(
        "Add credit to an account",
        "admin",
        auth="admin",
        body=Credit,
        answer="AdminAccount",
        example={"amount_usd": 5.0},
    ),
    ("POST", "/admin/keys"): Operation(
        "Create an API key (its secret is shown once)",
        "admin",
        auth="admin",
        body=NewKey,
        example={"account": "acme", "products": ["sim-fast"], "rpm": 60},
        ok=201,
        answer="KeyCreated",
    ),
    ("GET", "/admin/keys"): Operation(
        "List API keys (never their secrets), newest first",
        "admin",
        auth="admin",
        answer="Page",
        params=(Param("account", {"type": "string"}, "one account's keys"), _ADMIN_LIMIT, _AFTER),
    ),
    ("POST", "/admin/keys/{key_id}/revoke"): Operation(
        "Revoke an API key (refused on every replica within a second)",
        "admin",
        auth="admin",
        body=RevokeKey,
        example={"reason": "leaked"},
    ),
    ("POST", "/admin/keys/{key_id}/rotate"): Operation(
        "Give an API key a new secret; the old one works for the grace period",
        "admin",
        auth="admin",
        body=RotateKey,
        example={"grace_s": 3600},
        answer="KeyCreated",
    ),
    ("GET", "/admin/accounts"): Operation(
        "List accounts, paged", "admin", auth="admin", answer="Page", params=(_ADMIN_LIMIT, _AFTER)
    ),
    ("GET", "/admin/audit"): Operation(
        "The audit log of admin actions, newest first",
        "admin",
        auth="admin",
        answer="Page",
        params=(
            Param("action", {"type": "string"}, "one action, e.g. `key.revoke`"),
            Param("target", {"type": "string"}, "one target id (account, key or hold)"),
            _ADMIN_LIMIT,
            _AFTER,
        ),
    ),
    ("GET", "/admin/holds"): Operation(
        "List holds",
        "admin",
        auth="admin",
        answer="List",
        params=(
            Param("state", {"enum": ["open", "settled", "released", "reconciling"]}, "the holds' state"),
            Param("account", {"type": "string"}, "one account's holds"),
            Param("limit", {"type": "integer", "minimum": 1, "maximum": 1000}, "at most (default 100)"),
        ),
    ),
    ("POST", "/admin/holds/{hold_id}/settle"): Operation(
        "Settle an open or reconciling hold",
        "admin",
        auth="admin",
        body=SettleHold,
        example={"amount_micros": 1200},
        answer="Hold",
        errors=(409,),
    ),
    ("POST", "/admin/accounts/{account_id}/webhook_secret"): Operation(
        "Give an account a new webhook secret (shown once); its held webhooks are sent with it",
        "admin",
        auth="admin",
        answer="WebhookSecret",
        errors=(503,),
    ),
    ("POST", "/admin/webhook_secrets/reseal"): Operation(
        "Seal every webhook secret with this gateway's first BOURSE_SECRET_KEY (a key rotation)",
        "admin",
        auth="admin",
        answer="Reseal",
    ),
    ("POST", "/admin/holds/{hold_id}/release"): Operation(
        "Release an open or reconciling hold (charge nothing)",
        "admin",
        auth="admin",
        answer="Hold",
        errors=(409,),
    ),
    ("GET", "/admin/usage.csv"): Operation(
        "Every account's usage records in a time range, as CSV", "admin", auth="admin", answer=None
    ),
    ("GET", "/admin/ledger"): Operation(
        "The ledger's totals and whether they balance", "admin", auth="admin", answer="Ledger"
    ),
    ("GET", "/healthz"): Operation("Liveness", "service", auth="none", answer="Health"),
    ("GET", "/readyz"): Operation(
        "Readiness: some product has a healthy deployment",
        "service",
        auth="none",
        answer="Ready",
        extra={503: ("no product is ready", "Ready")},
    ),
    ("GET", "/metrics"): Operation(
        "The gateway's metrics in the Prometheus text format (404 when `[server] metrics` is off)",
        "service",
        auth="none",
        answer=None,
        errors=(404,),
    ),
    ("GET", "/openapi.json"): Operation("This document", "service", auth="none"),
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _obj(required: Sequence[str] = (), **properties: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = list(required)
    return out


def _const(value: str) -> dict[str, Any]:
    return {"type": "string", "const": value}


_STRING = {"type": "string"}
_NULLABLE_STRING = {"type": ["string", "null"]}

ANSWERS: dict[str, dict[str, Any]] = {
    "ErrorEnvelope": {
        "type": "object",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {
            "error": _obj(
                ["message", "type", "param", "code"],
                message=_STRING,
                type=_STRING,
                param=_NULLABLE_STRING,
                code=_NULLABLE_STRING,
            )
        },
    },
    "Object": {"type": "object"},
    "Event": {
        "description": "one server-sent event: a chunk, an error frame, or [DONE]",
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": _ref("Chunk"),
                    },
                ]
            }
        },
    },
    "Chunk": {
        "anyOf": [
            _obj(
                ["id", "object", "created", "model", "choices"],
                id=_STRING,
                object={"enum": ["chat.completion.chunk", "text_completion"]},
                created=_INT,
                model=_STRING,
                choices={"type": "array", "items": {"type": "object"}},
            ),
            {"type": "object", "required": ["error"], "properties": {"error": {"type": "object"}}},
        ]
    },
    "ResponseEvent": {
        "description": "one typed server-sent event: `event: <type>` and `data: <json>`",
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": _STRING,
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": _obj(["type", "sequence_number"], type=_STRING, sequence_number=_INT),
            },
        },
    },
    "Response": _obj(
        ["id", "object", "created_at", "status", "model", "output"],
        id=_STRING,
        object=_const("response"),
        created_at=_INT,
        status={"enum": ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]},
        model=_STRING,
        output={"type": "array", "items": {"type": "object"}},
        usage={"type": ["object", "null"]},
    ),
    "ResponseDeleted": _obj(
        ["id", "object", "deleted"],
        id=_STRING,
        object=_const("response.deleted"),
        deleted={"type": "boolean"},
    ),
    "ItemList": _obj(
        ["object", "data", "has_more"],
        object=_const("list"),
        data={"type": "array", "items": {"type": "object"}},
        first_id=_NULLABLE_STRING,
        last_id=_NULLABLE_STRING,
        has_more={"type": "boolean"},
    ),
    "List": _obj(
        ["object", "data"], object=_const("list"), data={"type": "array", "items": {"type": "object"}}
    ),
    "Model": _obj(
        ["id", "object", "created", "owned_by"],
        id=_STRING,
        object=_const("model"),
        created=_INT,
        owned_by=_STRING,
        context_length=_INT,
        max_output_tokens=_INT,
        pricing={"type": "object"},
    ),
    "ModelList": _obj(
        ["object", "data"], object=_const("list"), data={"type": "array", "items": _ref("Model")}
    ),
    "Page": _obj(
        ["object", "data", "has_more", "next_after"],
        object=_const("list"),
        data={"type": "array", "items": {"type": "object"}},
        has_more={"type": "boolean"},
        next_after=_NULLABLE_STRING,
    ),
    "ChatCompletion": _obj(
        ["id", "object", "created", "model", "choices"],
        id=_STRING,
        object=_const("chat.completion"),
        created=_INT,
        model=_STRING,
        choices={"type": "array", "items": {"type": "object"}},
        usage={"type": "object"},
    ),
    "TextCompletion": _obj(
        ["id", "object", "created", "model", "choices"],
        id=_STRING,
        object=_const("text_completion"),
        created=_INT,
        model=_STRING,
        choices={"type": "array", "items": {"type": "object"}},
        usage={"type": "object"},
    ),
    "Job": _obj(
        ["id", "object", "status", "endpoint", "request_id"],
        id=_STRING,
        object=_const("bourse.job"),
        endpoint=_STRING,
        request_id=_STRING,
        status={"enum": ["queued", "running", "succeeded", "failed", "canceled", "expired"]},
    ),
    "Market": _obj(
        ["object", "product", "slots", "deployments"],
        object=_const("bourse.market"),
        product=_STRING,
        slots={"type": "object"},
        deployments={"type": "array"},
    ),
    "Account": _obj(
        ["object", "id", "balance_micros"], object=_const("bourse.account"), id=_STRING, balance_micros=_INT
    ),
    "Usage": _obj(
        ["id", "object", "model", "usage"],
        id=_STRING,
        object=_const("bourse.usage"),
        model=_STRING,
        usage={"type": "object"},
    ),
    "AdminAccount": _obj(["id", "balance_micros"], id=_STRING, balance_micros=_INT),
    "KeyCreated": _obj(["key", "id", "account_id"], key=_STRING, id=_STRING, account_id=_STRING),
    "WebhookSecret": _obj(
        ["account", "webhook_secret", "released_jobs"],
        account=_STRING,
        webhook_secret=_STRING,
        released_jobs=_INT,
    ),
    "Reseal": _obj(
        ["resealed", "unchanged", "unreadable", "unreadable_count", "released_jobs"],
        resealed=_INT,
        unchanged=_INT,
        unreadable={"type": "array", "items": _STRING},
        unreadable_count=_INT,
        released_jobs=_INT,
    ),
    "Hold": _obj(
        ["id", "state", "amount_micros"],
        id=_STRING,
        amount_micros=_INT,
        state={"enum": ["open", "settled", "released", "reconciling"]},
    ),
    "Ledger": _obj(
        ["credits_micros", "balances_micros", "holds_micros", "revenue_micros", "balanced"],
        credits_micros=_INT,
        balances_micros=_INT,
        holds_micros=_INT,
        revenue_micros=_INT,
        balanced={"type": "boolean"},
    ),
    "Health": _obj(["status"], status=_const("ok")),
    "Ready": _obj(
        ["status", "products"],
        status={"enum": ["ready", "unready"]},
        products={"type": "object", "additionalProperties": {"type": "boolean"}},
        unavailable={
            "type": "array",
            "description": "each deployment that cannot serve (its probes fail, or its engine is broken) and why",
            "items": _obj(
                ["product", "deployment", "reason"], product=_STRING, deployment=_STRING, reason=_STRING
            ),
        },
    ),
}
"""Schemas of the answers (success and error), by component name."""


def _json(description: str, schema: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(schema)}}}


def _model_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, str]:
    """``model``'s JSON schema added to ``components`` (its nested models too); a reference to it."""
    schema = model.model_json_schema(ref_template=REF)
    for name, part in [*schema.pop("$defs", {}).items(), (model.__name__, schema)]:
        if components.setdefault(name, part) != part:
            raise ValueError(f"two schemas named {name!r} in the OpenAPI document")
    return _ref(model.__name__)


def _responses(op: Operation, path_params: bool) -> dict[str, Any]:
    ok: dict[str, Any] = (
        {"description": "the answer"} if op.answer is None else _json("the answer", op.answer)
    )
    if op.stream:
        ok["content"]["text/event-stream"] = {"schema": _ref(op.event)}
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
        out[str(status)] = _json(_ERROR_CODES[status], "ErrorEnvelope")
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
