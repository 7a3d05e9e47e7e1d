"""What ``GET /openapi.json`` says of each operation (method and route): its summary,
tag, authentication, request body (the pydantic model the route validates with),
parameters and answers, in :data:`OPERATIONS`; the routes left out
(:data:`UNDESCRIBED`); and the words for each error status (:data:`ERROR_CODES`).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, Literal

from pydantic import BaseModel

from bourse.domain.values import immutable
from bourse.http.admin import (
    PAGE_MAX,
    AccountEdit,
    AccountStatusChange,
    Adjustment,
    Credit,
    KeyEdit,
    NewAccount,
    NewKey,
    NewOperator,
    RevokeKey,
    RotateAdminKey,
    RotateKey,
    SettleHold,
)
from bourse.http.admin_market import MarketApply, ProductEdit, ProductPut
from bourse.http.jobs import NewJob
from bourse.wire.requests import ChatCompletionRequest, CompletionRequest
from bourse.wire.responses import ResponsesRequest

Auth = Literal["key", "admin", "none"]

ERROR_CODES: dict[int, str] = {
    400: "a bad body or parameter (`param` names it)",
    401: "no key or an unknown key",
    402: "the balance, the key's spend cap or the account's cannot cover the hold",
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
_DEADLINE = Param(
    "X-Deadline-S",
    {"type": "string"},
    "a deadline order: seconds by which it starts, its bid raised up to `max_price` (as `deadline_s`)",
    "header",
)
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
        params=(_IDEM, _BID, _WAIT, _DEADLINE),
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
        params=(_IDEM, _BID, _WAIT, _DEADLINE),
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
        params=(_IDEM, _BID, _WAIT, _DEADLINE),
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
        "A product's market: level, slots, book, recent clears, the wait forecast's score",
        "market",
        auth="none",
        answer="Market",
    ),
    ("GET", "/v1/market/{product}/quote"): Operation(
        "The lowest bid predicted to start within `within_s` seconds (a prediction, not a promise)",
        "market",
        auth="none",
        answer="Quote",
        errors=(400, 404),
        params=(
            Param(
                "within_s",
                {"type": "number", "exclusiveMinimum": 0, "maximum": 86400},
                "the wait asked about, in seconds (required)",
            ),
            Param(
                "tokens",
                {"type": "integer", "minimum": 1, "maximum": 100_000_000},
                "the order's tokens, to price the quote (`max_cost_usd`)",
            ),
        ),
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
        params=(_IDEM, _BID, _WAIT, _DEADLINE),
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
        example={"id": "acme", "credit_usd": 10.0, "spend_cap_usd": 50, "spend_cap_period": "month"},
        ok=201,
        answer="AdminAccount",
        errors=(409,),
    ),
    ("GET", "/admin/accounts/{account_id}"): Operation(
        "An account", "admin", auth="admin", answer="AdminAccount"
    ),
    ("PATCH", "/admin/accounts/{account_id}"): Operation(
        "Set an account's spend cap (spend_cap_usd, null removes it) and its period (total, "
        "or the UTC day, week or month); 402 account_budget_exceeded past it",
        "admin",
        auth="admin",
        body=AccountEdit,
        example={"spend_cap_usd": 100, "spend_cap_period": "month"},
        answer="AdminAccount",
        errors=(409,),
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
    ("POST", "/admin/accounts/{account_id}/debit"): Operation(
        "Debit an account, for a reason: a charge of the amount with its usage record "
        "(outcome debit); 402 insufficient_funds past the balance",
        "admin",
        auth="admin",
        body=Adjustment,
        example={"amount_usd": 2.5, "reason": "chargeback of order 1234"},
        answer="AdminAccount",
        errors=(402,),
    ),
    ("POST", "/admin/accounts/{account_id}/refund"): Operation(
        "Refund an account, for a reason: a credit audited as account.refund",
        "admin",
        auth="admin",
        body=Adjustment,
        example={"amount_usd": 1.0, "reason": "outage on 2026-12-01"},
        answer="AdminAccount",
    ),
    ("POST", "/admin/accounts/{account_id}/suspend"): Operation(
        "Suspend an account: its keys get 403 account_suspended on new requests; running ones finish",
        "admin",
        auth="admin",
        body=AccountStatusChange,
        example={"reason": "chargeback"},
        answer="AdminAccount",
    ),
    ("POST", "/admin/accounts/{account_id}/resume"): Operation(
        "Resume a suspended account (409 account_closed for a closed one)",
        "admin",
        auth="admin",
        body=AccountStatusChange,
        example={},
        answer="AdminAccount",
    ),
    ("POST", "/admin/accounts/{account_id}/close"): Operation(
        "Close an account for good: its keys revoked (403 account_closed), its balance and "
        "open holds reported; running requests finish",
        "admin",
        auth="admin",
        body=AccountStatusChange,
        example={"reason": "customer left"},
        answer="AdminAccount",
    ),
    ("PATCH", "/admin/keys/{key_id}"): Operation(
        "Edit an API key's products, limits, name, expiry or spend cap (null clears; in force "
        "on every replica within a second)",
        "admin",
        auth="admin",
        body=KeyEdit,
        example={"rpm": 600, "spend_cap_usd": 25, "spend_cap_period": "day"},
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
    ("GET", "/admin/market"): Operation(
        "The market in force: its version and every product's table (as the config file writes it)",
        "admin",
        auth="admin",
    ),
    ("POST", "/admin/market"): Operation(
        "Make these products the market in force on every replica (`dry_run`: only the changes)",
        "admin",
        auth="admin",
        body=MarketApply,
        example={
            "products": {"sim-fast": {"deployments": [{"engine": "sim", "floor": 0.5}]}},
            "dry_run": True,
        },
        errors=(409,),
    ),
    ("PUT", "/admin/products/{product}"): Operation(
        "Add a product, or replace it whole, live",
        "admin",
        auth="admin",
        body=ProductPut,
        example={"product": {"deployments": [{"engine": "sim", "floor": 0.5, "slots": 8}]}, "dry_run": True},
        errors=(409,),
    ),
    ("PATCH", "/admin/products/{product}"): Operation(
        "Change a product's terms and its deployments' (a floor, slots, a default bid) live",
        "admin",
        auth="admin",
        body=ProductEdit,
        example={"set": {"default_bid": 1.5}, "deployments": {"sim-fast/0": {"floor": 0.5}}, "dry_run": True},
        errors=(409,),
    ),
    ("DELETE", "/admin/products/{product}"): Operation(
        "Take a product off the exchange (what runs there finishes)", "admin", auth="admin", errors=(409,)
    ),
    ("POST", "/admin/operators"): Operation(
        "Add an operator with a role (owner only); its key (`bo_…`) is shown once",
        "admin",
        auth="admin",
        body=NewOperator,
        example={"name": "ada", "role": "billing"},
        ok=201,
        errors=(409,),
    ),
    ("GET", "/admin/operators"): Operation(
        "List the operators and their roles (revoked ones too)", "admin", auth="admin", answer="List"
    ),
    ("POST", "/admin/operators/{operator_id}/revoke"): Operation(
        "Revoke an operator (owner only; its key is refused on every replica within a second)",
        "admin",
        auth="admin",
    ),
    ("POST", "/admin/admin_key/rotate"): Operation(
        "Rotate the admin key (owner only): the new key is shown once; the old one works for the "
        "grace period on every replica, then is refused",
        "admin",
        auth="admin",
        body=RotateAdminKey,
        example={"grace_s": 3600},
        errors=(409,),
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
