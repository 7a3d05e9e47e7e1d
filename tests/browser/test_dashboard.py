"""The dashboard in headless Chromium against a served gateway.

Each test signs in through the form and checks what the issue asks: the operator
watches a one-slot book fill (the ladder grows, the level rises) and drain; releases
the reconciling hold a SIGKILL left, and sees the balance change; a viewer operator
signs in with their own key, sees their name and role and is offered no action; a user sees only
their account, the live tail, a request's detail, downloads the CSV (its rows are the
usage API's); jobs are listed and cancelled. Every page: the CSP header on the
document, no console error, no request beyond 127.0.0.1 (checked by the ``page``
fixture), and a screenshot in ``tmp/artifacts/dashboard/``.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bourse.http.dashboard.guard import CSP
from tests.browser.conftest import ADMIN_KEY, USER, Floor
from tests.support.browser import artifacts_dir
from tests.support.usage_rows import assert_row_is_record, parse_csv

WAIT_MS = 20_000


def _open(page: Any, floor: Floor, fragment: str, key: str) -> None:
    """Load the dashboard (checking its CSP) and sign in through the form."""
    resp = page.goto(f"{floor.url}/dashboard#{fragment}")
    assert resp is not None and resp.status == 200
    assert resp.headers["content-security-policy"] == CSP
    page.wait_for_selector("#signin-form", state="visible")
    page.fill("#signin-key", key)
    page.press("#signin-key", "Enter")
    page.wait_for_selector("#nav", state="visible")
    assert key not in page.url


def _shot(page: Any, name: str) -> Path:
    path = artifacts_dir() / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def _num(page: Any, selector: str) -> float:
    text = page.inner_text(selector)
    return float(re.sub(r"[^0-9.]", "", text) or "nan")


def test_operator_watches_the_book_fill_and_drain(floor: Floor, page: Any) -> None:
    _open(page, floor, "market/sim-market", ADMIN_KEY)
    page.wait_for_selector("#market-live.on")
    assert page.inner_text("#market-product option:checked") == "sim-market"
    assert page.inner_text("#who-role") == "admin key · owner · all accounts"
    floor_price = _num(page, "#stat-floor")
    assert floor_price == 0.10

    bids = [0.10, 0.15, 0.20, 0.25, 0.30, 0.35, 0.40, 0.45, 0.50, 0.55]
    results: list[int] = []

    def order(bid: float) -> None:
        r = floor.as_user("bob", "POST", "/v1/chat/completions",
                          json={"model": "sim-market", "messages": USER, "max_tokens": 25, "max_price": bid})  # fmt: skip
        results.append(r.status_code)

    threads = [threading.Thread(target=order, args=(b,)) for b in bids]
    for t in threads:
        t.start()
    # the ladder grows and the level rises above the floor
    page.wait_for_function(
        "() => Number(document.querySelector('#stat-waiting').textContent) >= 5", timeout=WAIT_MS
    )
    waiting = int(_num(page, "#stat-waiting"))
    rungs = page.query_selector_all("#ladder tr.rung")
    assert len(rungs) >= 2
    assert sum(int(r.get_attribute("data-orders")) for r in rungs) == waiting
    prices = [float(r.get_attribute("data-price")) for r in rungs]
    assert prices == sorted(prices, reverse=True), "best bid first"
    assert page.is_visible("#ladder-level")
    assert _num(page, "#stat-level") > floor_price
    _shot(page, "market-busy")
    # the picture for the README: the book draining, with a few seconds of history
    deadline = time.monotonic() + WAIT_MS / 1000
    while time.monotonic() < deadline and (left := _num(page, "#stat-waiting")) > 0:
        if left <= 5:
            _shot(page, "market-draining")
            break
        page.wait_for_timeout(50)
    for t in threads:
        t.join(timeout=60)
    assert results == [200] * len(bids)
    # then it drains
    page.wait_for_function(
        "() => Number(document.querySelector('#stat-waiting').textContent) === 0"
        " && document.querySelectorAll('#ladder tr.rung').length === 0",
        timeout=WAIT_MS,
    )
    page.wait_for_function(
        "() => document.querySelectorAll('#admissions tbody tr').length >= 10", timeout=WAIT_MS
    )
    assert _num(page, "#stat-level") == floor_price
    assert page.inner_text("#deployments [data-breaker]") == "closed"
    _shot(page, "market")


def test_operator_releases_the_hold_a_crash_left(floor: Floor, page: Any) -> None:
    hold = floor.crash_hold
    _open(page, floor, "money", ADMIN_KEY)
    row = f"#holds-reconciling tr[data-hold='{hold['id']}']"
    page.wait_for_selector(row)
    balance = "#accounts tr[data-account='crash'] .balance"
    before = page.inner_text(balance)
    assert before == _usd(1_000_000 - hold["amount_micros"])
    assert page.inner_text("#accounts tr[data-account='crash'] .reconciling") == _usd(hold["amount_micros"])
    _shot(page, "money")
    page.click(f"{row} button[data-action='release']")
    page.wait_for_selector("#confirm[open]")
    assert hold["id"] in page.inner_text("#confirm-text")
    page.click("#confirm-yes")
    page.wait_for_selector(row, state="detached", timeout=WAIT_MS)
    page.wait_for_function(
        f"() => document.querySelector(\"{balance}\").textContent === '{_usd(1_000_000)}'", timeout=WAIT_MS
    )
    assert "released" in page.inner_text("#notice")
    r = floor.admin("GET", "/admin/holds", params={"state": "released", "account": "crash"})
    assert [h["id"] for h in r.json()["data"]] == [hold["id"]]
    ledger = floor.admin("GET", "/admin/ledger").json()
    assert ledger["balanced"] is True
    audit = floor.admin("GET", "/admin/audit", params={"target": hold["id"]}).json()["data"]
    assert [e["action"] for e in audit] == ["hold.release"], audit
    assert audit[0]["actor"] == "admin:dashboard", audit


def test_user_sees_only_their_account_and_downloads_the_csv(floor: Floor, page: Any) -> None:
    _open(page, floor, "money", floor.keys["alice"])
    assert page.inner_text("#who-role").startswith("account alice")
    page.wait_for_selector("#accounts tr[data-account]")
    assert [
        r.get_attribute("data-account") for r in page.query_selector_all("#accounts tr[data-account]")
    ] == ["alice"]
    page.wait_for_selector("#holds-reconciling tr.empty")
    assert page.query_selector_all("#holds-reconciling tr[data-hold]") == []

    page.click("nav a[data-page='requests']")
    page.wait_for_selector("#requests-live.on")
    page.wait_for_selector("#requests tr[data-request]")
    shown = [r.get_attribute("data-request") for r in page.query_selector_all("#requests tr[data-request]")]
    assert set(shown) == set(floor.request_ids["alice"])
    # a request finishing now appears at the top of the live tail
    fresh = floor.complete("alice", "sim-fast").headers["x-request-id"]
    page.wait_for_selector(f"#requests tbody tr:first-child[data-request='{fresh}']", timeout=WAIT_MS)
    page.click(f"#requests tr[data-request='{fresh}'] button")
    page.wait_for_selector("#request-detail:not([hidden])")
    assert fresh in page.inner_text("#detail-record") and "latency_ms" in page.inner_text("#detail-receipt")
    _shot(page, "requests")

    with page.expect_download() as info:
        page.click("#requests-csv")
    rows = parse_csv(Path(info.value.path()).read_text())
    api = floor.as_user("alice", "GET", "/v1/usage", params={"limit": "100"}).json()["data"]
    assert [row["request_id"] for row in rows] == [rec["id"] for rec in api]
    assert {row["account"] for row in rows} == {"alice"}
    for row, rec in zip(rows, api, strict=True):
        assert_row_is_record(row, rec, "alice")

    page.click("#signout")
    page.wait_for_selector("#signin-form", state="visible")
    session = page.evaluate("() => fetch('/dashboard/api/session').then((r) => r.json())")
    assert session == {"signed_in": False}


def test_an_operator_signs_in_with_their_own_key_and_sees_their_role(floor: Floor, page: Any) -> None:
    r = floor.admin("POST", "/admin/operators", json={"name": "vera", "role": "viewer"})
    assert r.status_code == 201, r.text
    _open(page, floor, "money", r.json()["key"])
    assert page.inner_text("#who-role") == "vera · viewer · all accounts"
    page.wait_for_selector("#accounts tr[data-account='alice']")
    accounts = {
        r.get_attribute("data-account") for r in page.query_selector_all("#accounts tr[data-account]")
    }
    assert {"alice", "bob", "crash"} <= accounts
    page.wait_for_selector("#holds-reconciling tr")
    assert page.query_selector_all("#holds-reconciling button") == [], (
        "a viewer is offered no settle or release"
    )
    _shot(page, "money-viewer")
    page.click("#signout")
    page.wait_for_selector("#signin-form", state="visible")


def test_jobs_are_listed_and_cancelled(floor: Floor, page: Any) -> None:
    r = floor.as_user("bob", "POST", "/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": {
        "model": "slow", "messages": USER, "max_tokens": 200}})  # fmt: skip
    assert r.status_code == 202, r.text
    job = r.json()["id"]
    _open(page, floor, "jobs", ADMIN_KEY)
    row = f"#jobs tr[data-job='{job}']"
    page.wait_for_selector(f"{row}[data-status='running'] progress", timeout=WAIT_MS)
    _shot(page, "jobs")
    page.click(f"{row} button")
    page.wait_for_selector("#confirm[open]")
    page.click("#confirm-yes")
    page.wait_for_selector(f"{row}[data-status='canceled']", timeout=WAIT_MS)
    deadline = time.monotonic() + 10
    while floor.as_user("bob", "GET", f"/v1/jobs/{job}").json()["status"] != "canceled":
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _usd(micros: int) -> str:
    whole, frac = divmod(micros, 1_000_000)
    return f"${whole:,}.{frac:06d}"


def test_pages_are_usable_on_a_phone(floor: Floor, page: Any) -> None:
    page.set_viewport_size({"width": 390, "height": 844})
    _open(page, floor, "market/sim-market", ADMIN_KEY)
    page.wait_for_selector("#market-live.on")
    page.wait_for_selector("#chart-depth canvas")
    page.wait_for_selector("#ladder-level")  # the first snapshot is drawn
    width = page.evaluate("() => document.documentElement.scrollWidth")
    assert width <= 390, f"the market page scrolls sideways on a phone ({width}px)"
    _shot(page, "phone-market")
    # keyboard: the pages are reachable with Tab and Enter
    page.focus("nav a[data-page='money']")
    page.keyboard.press("Enter")
    page.wait_for_selector("#page-money:not([hidden]) #accounts tr[data-account]")
    assert page.evaluate("() => document.activeElement.id") == "money-title"
    width = page.evaluate("() => document.documentElement.scrollWidth")
    assert width <= 390, f"the money page scrolls sideways on a phone ({width}px)"
    _shot(page, "phone-money")
    assert httpx.get(floor.url + "/healthz").status_code == 200
