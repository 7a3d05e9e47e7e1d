"""The admin API of the live market (issue 37): its configuration read and changed
while serving, in force on every replica within a second
(:class:`~bourse.ports.market.MarketAdmin`, :mod:`bourse.market_desk`).

- ``GET /admin/market``: the version in force: every product's table, as the config
  file writes it (viewer);
- ``POST /admin/market``: every product at once (``bourse admin config apply FILE``),
  ``dry_run`` to see the changes only (admin);
- ``PUT /admin/products/{product}``: add a product or replace it whole (admin);
- ``PATCH /admin/products/{product}``: change some of its terms (``set``; ``null``
  goes back to the default) and some of its deployments' (``deployments``, by name):
  a floor, slots, a default bid, a policy knob, an engine's setting (admin);
- ``DELETE /admin/products/{product}``: take it off the exchange; what runs finishes (admin).

Each change answers its version and one line per change, and is audited.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import GatewayError
from bourse.http.admin_roles import guard, needing
from bourse.http.deps import Services, json_model
from bourse.http.responses import JSON
from bourse.ports.market import Edit, MarketAdmin, MarketVersion, Outcome
from bourse.wire.requests import IdText, check_id

MAX_PRODUCTS = 1000
MAX_KEYS = 200
"""The most keys a product's or a deployment's table may change at once."""


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class MarketApply(_In):
    products: dict[IdText, dict[str, Any]] = Field(max_length=MAX_PRODUCTS)
    """Every product's table, as in the config file (``[products.NAME]``)."""
    dry_run: bool = False


class ProductPut(_In):
    product: dict[str, Any] = Field(max_length=MAX_KEYS)
    """The product's table, as in the config file (with its ``deployments``)."""
    dry_run: bool = False


class ProductEdit(_In):
    set: dict[str, Any] = Field(default_factory=dict, max_length=MAX_KEYS)
    """The product's keys to change (``null``: back to the default), not ``deployments``."""
    deployments: dict[IdText, dict[str, Any]] = Field(default_factory=dict, max_length=MAX_KEYS)
    """Deployment name -> its keys to change (``null``: back to the default)."""
    dry_run: bool = False


def outcome_doc(out: Outcome) -> dict[str, Any]:
    """A change's answer: its version, its lines, whether it was written."""
    return {"object": "market.change", "version": out.version, "changes": out.changes, "applied": out.applied}


def market_doc(v: MarketVersion) -> dict[str, Any]:
    """The version in force, as ``GET /admin/market`` answers it."""
    return {"object": "market", "version": v.version, "products": v.products, "actor": v.actor,
            "created_at": v.created_at}  # fmt: skip


def _not_found(product: str) -> GatewayError:
    return GatewayError(404, "not_found", f"No product '{product}' on the exchange.", param="product")


def _merge(table: dict[str, Any], changes: dict[str, Any], where: str) -> None:
    for key, value in changes.items():
        if len(key) > 128:
            raise GatewayError(400, "invalid_request_error", f"{where}: a key is over 128 characters")
        if value is None:
            table.pop(key, None)
        else:
            table[key] = value


def edit_product(doc: dict[str, Any], product: str, body: ProductEdit) -> dict[str, Any]:
    """``doc`` (every product's table) with ``body``'s changes made to ``product``."""
    table = doc.get(product)
    if not isinstance(table, dict):
        raise _not_found(product)
    if "deployments" in body.set:
        raise GatewayError(
            400, "invalid_request_error", "set: deployments are changed by name in 'deployments'", param="set"
        )
    _merge(table, body.set, f"products.{product}")
    deps = table.get("deployments") or []
    names = {  # a deployment's name, as bourse.settings.deployment_name gives it
        (d.get("name") or f"{product}/{i}"): d for i, d in enumerate(deps) if isinstance(d, dict)
    }
    for name, changes in body.deployments.items():
        if name not in names:
            raise GatewayError(
                404, "not_found", f"'{product}' has no deployment '{name}' (it has: {', '.join(names)}).",
                param="deployments",
            )  # fmt: skip
        _merge(names[name], changes, f"products.{product}.deployments.{name}")
    return doc


def put_product(product: str, body: ProductPut) -> Edit:
    """The change of ``PUT /admin/products/{product}``: the product added or replaced."""

    def edit(doc: dict[str, Any]) -> dict[str, Any]:
        return {**doc, product: body.product}

    return edit


def delete_product(product: str) -> Edit:
    """The change of ``DELETE /admin/products/{product}``: 404 for an unknown product,
    409 for the last one."""

    def edit(doc: dict[str, Any]) -> dict[str, Any]:
        if product not in doc:
            raise _not_found(product)
        if len(doc) == 1:
            raise GatewayError(409, "conflict", "The exchange keeps at least one product.", param="product")
        return {k: v for k, v in doc.items() if k != product}

    return edit


PRODUCT_ACTIONS = {
    "PUT": "market.product.put",
    "PATCH": "market.product.edit",
    "DELETE": "market.product.delete",
}
"""The audit log's action of each product route (by its method)."""


async def change_product(desk: MarketAdmin, request: Request, actor: str, max_depth: int) -> dict[str, Any]:
    """What ``PUT|PATCH|DELETE /admin/products/{product}`` do (the admin routes, and the
    dashboard's that mirror them with the session's actor): the body read with the
    route's model, the change written (or only shown: ``dry_run``) and audited as
    ``actor``; the answer's document."""
    product = check_id(request.path_params["product"], "product")
    method = request.method
    edit: Edit
    dry_run = False
    if method == "PUT":
        put = await json_model(request, ProductPut, max_depth)
        edit, dry_run = put_product(product, put), put.dry_run
    elif method == "PATCH":
        body = await json_model(request, ProductEdit, max_depth)
        edit, dry_run = (lambda doc: edit_product(doc, product, body)), body.dry_run
    else:
        edit = delete_product(product)
    out = await desk.change(edit, actor, action=PRODUCT_ACTIONS[method], target=product, dry_run=dry_run)
    return outcome_doc(out)


class _MarketRoutes:
    def __init__(self, services: Services) -> None:
        self.auth = services.auth
        self.desk = services.desk
        self.max_depth = services.max_json_depth

    async def market(self, request: Request) -> Response:
        await guard(self.auth, request)
        return JSON(market_doc(await self.desk.current()))

    async def apply(self, request: Request) -> Response:
        actor = await guard(self.auth, request)
        body = await json_model(request, MarketApply, self.max_depth)
        out = await self.desk.change(
            lambda _: dict(body.products), actor, action="market.apply", dry_run=body.dry_run
        )
        return JSON(outcome_doc(out))

    async def product(self, request: Request) -> Response:
        actor = await guard(self.auth, request)
        return JSON(await change_product(self.desk, request, actor, self.max_depth))


def routes(services: Services) -> list[Route]:
    m = _MarketRoutes(services)
    plain = [
        ("GET", "/admin/market", m.market),
        ("POST", "/admin/market", m.apply),
        ("PUT", "/admin/products/{product}", m.product),
        ("PATCH", "/admin/products/{product}", m.product),
        ("DELETE", "/admin/products/{product}", m.product),
    ]
    return [Route(path, needing(method, path, fn), methods=[method]) for method, path, fn in plain]
