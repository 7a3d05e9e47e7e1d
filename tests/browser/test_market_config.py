"""The live market changed from the dashboard (issue 37), in headless Chromium: an
operator previews a deployment's new floor (the diff line), applies it and the market
view shows it; a refused change shows its reason in the form; a product added from
its table as JSON joins the product picker, and is removed again after a
confirmation. A viewer is offered none of it. The products made here are removed at
the end (the gateway is shared by the package's tests)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.browser.conftest import ADMIN_KEY, Floor
from tests.browser.test_dashboard import WAIT_MS, _open, _shot
from tests.support.browser import Watch

LAB = "cfg-lab"
NEW = "cfg-new"


def _sim(name: str, floor: float, slots: int) -> dict[str, Any]:
    return {"engine": "sim", "name": name, "floor": floor, "slots": slots, "tokens_per_s": 0, "ttft_ms": 0}


@pytest.fixture
def lab(floor: Floor) -> Iterator[str]:
    """A product of its own (deployment ``cfg-lab-a``: floor 1, 2 slots); it and
    ``cfg-new`` are taken off the exchange afterwards."""
    table = {"description": "configured from the dashboard", "deployments": [_sim(f"{LAB}-a", 1.0, 2)]}
    r = floor.admin("PUT", f"/admin/products/{LAB}", json={"product": table})
    assert r.status_code == 200 and r.json()["applied"], r.text
    try:
        yield LAB
    finally:
        for product in (LAB, NEW):
            floor.admin("DELETE", f"/admin/products/{product}")


def _live_floor(floor: Floor, product: str) -> float:
    value: float = httpx.get(f"{floor.url}/v1/market/{product}", timeout=10).json()["deployments"][0]["floor"]
    return value


def test_operator_changes_a_floor_then_adds_and_removes_a_product(
    floor: Floor, page: Any, browser: tuple[Any, Watch], lab: str
) -> None:
    _open(page, floor, f"market/{lab}", ADMIN_KEY)
    page.wait_for_selector("#market-live.on")
    form = f"#deployment-forms form[data-deployment='{lab}-a']"
    page.wait_for_selector(form)
    assert page.inner_text("#config-product") == lab
    assert page.input_value(f"{form} input[name='floor']") == "1"
    assert page.input_value(f"{form} input[name='slots']") == "2"
    # preview: the diff line, nothing changed yet
    page.fill(f"{form} input[name='floor']", "2")
    page.click(f"{form} [data-step='preview']")
    page.wait_for_selector(f"{form} .diff li")
    assert page.inner_text(f"{form} .diff") == f"{lab}/{lab}-a floor: 1 -> 2"
    assert _live_floor(floor, lab) == 1.0
    _shot(page, "market-config-preview")
    # apply: in force at once, and the market view shows it
    page.click(f"{form} [data-step='apply']")
    page.wait_for_selector("#notice:not([hidden])")
    assert "applied" in page.inner_text("#notice") and "floor: 1 -> 2" in page.inner_text("#notice")
    assert _live_floor(floor, lab) == 2.0
    row = f"#deployments tr[data-deployment='{lab}-a'] td:nth-child(2)"
    page.wait_for_function(f'() => document.querySelector("{row}")?.textContent === "$2.00"', timeout=WAIT_MS)
    page.wait_for_function(
        "() => document.querySelector('#stat-floor').textContent === '$2.00'", timeout=WAIT_MS
    )
    page.wait_for_function(f"() => document.querySelector(\"{form} input[name='floor']\")?.value === '2'")
    audit = floor.admin("GET", "/admin/audit", params={"target": lab}).json()["data"]
    assert (audit[0]["action"], audit[0]["actor"]) == ("market.product.edit", "admin:dashboard"), audit
    # a change the market refuses: its reason in the form, nothing changed
    page.fill(f"{form} input[name='slots']", "200000")  # over the bound (the page checks none)
    page.click(f"{form} [data-step='preview']")
    page.wait_for_selector(f"{form} .error:not([hidden])")
    assert "slots" in page.inner_text(f"{form} .error")
    assert page.is_hidden(f"{form} [data-step='apply']")
    _, watch = browser
    assert len(watch.console_errors) == 1 and "400" in watch.console_errors[0], watch.console_errors
    watch.console_errors.clear()  # the browser logs the refused request itself
    # a product from its table as JSON: previewed, applied, in the product picker
    table = {"description": "added from the dashboard", "deployments": [_sim(f"{NEW}-a", 0.5, 3)]}
    page.fill("#product-add input[name='product']", NEW)
    page.fill("#product-add textarea[name='table']", json.dumps(table))
    page.click("#product-add [data-step='preview']")
    page.wait_for_selector("#product-add .diff li")
    assert page.inner_text("#product-add .diff") == f"product {NEW} added"
    assert page.query_selector(f"#market-product option[value='{NEW}']") is None
    page.click("#product-add [data-step='apply']")
    page.wait_for_selector(f"#market-product option[value='{NEW}']", state="attached")
    page.wait_for_function(f"() => location.hash === '#market/{NEW}'")
    assert page.inner_text("#market-product option:checked") == NEW
    page.wait_for_selector(f"#deployments tr[data-deployment='{NEW}-a']", timeout=WAIT_MS)
    page.wait_for_selector(f"#deployment-forms form[data-deployment='{NEW}-a']")
    assert f"product {NEW} added" in page.inner_text("#notice")
    models = floor.as_user("alice", "GET", "/v1/models").json()["data"]
    assert NEW in {m["id"] for m in models}
    _shot(page, "market-config-added")
    # and removed, after a confirmation
    page.click("#product-remove button[type=submit]")
    page.wait_for_selector("#confirm[open]")
    assert NEW in page.inner_text("#confirm-text")
    page.click("#confirm-yes")
    page.wait_for_function(f"() => !document.querySelector(\"#market-product option[value='{NEW}']\")")
    assert httpx.get(f"{floor.url}/v1/market/{NEW}", timeout=10).status_code == 404
    assert f"product {NEW} removed" in page.inner_text("#notice")


def test_a_viewer_is_offered_no_change_to_the_market(floor: Floor, page: Any) -> None:
    r = floor.admin("POST", "/admin/operators", json={"name": "mira", "role": "viewer"})
    assert r.status_code == 201, r.text
    _open(page, floor, "market/sim-fast", r.json()["key"])
    page.wait_for_selector("#market-live.on")
    page.wait_for_selector("#deployments tr[data-deployment]")
    assert page.is_hidden("#market-config")
    assert page.query_selector_all("#deployment-forms form") == []
