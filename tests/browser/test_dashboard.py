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
import openai

from bourse.http.dashboard.guard import CSP
from tests.browser.conftest import ADMIN_KEY, USER, Floor
from tests.support.browser import Watch, artifacts_dir
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


def test_operator_creates_an_account_credits_it_and_gives_it_a_key(
    floor: Floor, page: Any, browser: tuple[Any, Watch]
) -> None:
    _open(page, floor, "money", ADMIN_KEY)
    page.fill("#account-new-id", "carol")
    page.click("#account-new button[type=submit]")
    page.wait_for_selector("#account-panel:not([hidden])")
    page.wait_for_selector("#accounts tr[data-account='carol']")
    assert page.inner_text("#panel-account") == "carol"
    assert page.inner_text("#accounts tr[data-account='carol'] .balance") == _usd(0)
    # the API's refusal shows in the form: a debit needs a reason
    page.select_option("#money-kind", "debit")
    page.fill("#money-amount", "1")
    page.click("#money-form button[type=submit]")
    page.wait_for_selector("#money-form .error:not([hidden])")
    assert "reason" in page.inner_text("#money-form .error")
    _, watch = browser
    assert len(watch.console_errors) == 1 and "400" in watch.console_errors[0], watch.console_errors
    watch.console_errors.clear()  # the browser logs the refused request itself
    # a credit: the table and the panel show it
    page.select_option("#money-kind", "credit")
    page.fill("#money-amount", "3.5")
    page.click("#money-form button[type=submit]")
    balance = "#accounts tr[data-account='carol'] .balance"
    page.wait_for_function(
        f"() => document.querySelector(\"{balance}\").textContent === '{_usd(3_500_000)}'", timeout=WAIT_MS
    )
    assert page.is_hidden("#money-form .error")
    assert _usd(3_500_000) in page.inner_text("#panel-kv [data-field='balance']")
    # a key: its secret shown once
    page.fill("#key-new input[name='name']", "laptop")
    page.fill("#key-new input[name='rpm']", "60")
    page.click("#key-new button[type=submit]")
    page.wait_for_selector("#secret-box:not([hidden])")
    secret = page.inner_text("#secret-key")
    assert secret.startswith("bk_")
    page.wait_for_selector("#keys tr[data-key][data-state='active']")
    row = page.query_selector("#keys tr[data-key]")
    key_id = row.get_attribute("data-key")
    assert "laptop" in row.inner_text()
    _shot(page, "manage-key")
    # the key works with the OpenAI SDK against the same gateway
    with openai.OpenAI(base_url=floor.url + "/v1", api_key=secret, max_retries=0) as client:
        out = client.chat.completions.create(model="sim-fast", messages=USER, max_tokens=5)  # type: ignore[arg-type]
    assert out.choices[0].message.content
    # dismissed, the secret is gone from the page
    page.click("#secret-done")
    assert page.is_hidden("#secret-box")
    assert secret not in page.content()
    assert page.evaluate("() => document.querySelector('#secret-key').textContent") == ""
    # the request's charge shows in the balance
    charged = floor.admin("GET", "/admin/accounts/carol").json()
    assert charged["spent_micros"] > 0 and charged["balance_micros"] == 3_500_000 - charged["spent_micros"]
    page.wait_for_function(
        f"() => document.querySelector(\"{balance}\").textContent === '{_usd(charged['balance_micros'])}'",
        timeout=WAIT_MS,
    )
    audit = floor.admin("GET", "/admin/audit", params={"target": "carol"}).json()["data"]
    assert [e["action"] for e in audit] == ["account.credit", "account.create"], audit
    audit += floor.admin("GET", "/admin/audit", params={"target": key_id}).json()["data"]
    assert [e["action"] for e in audit][2:] == ["key.create"], audit
    assert all(e["actor"] == "admin:dashboard" for e in audit), audit
    assert all(secret not in str(e) for e in audit)


def _confirm(page: Any, expect: str) -> None:
    page.wait_for_selector("#confirm[open]")
    assert expect in page.inner_text("#confirm-text"), page.inner_text("#confirm-text")
    page.click("#confirm-yes")


def test_operator_edits_rotates_and_revokes_a_key_and_closes_the_account(floor: Floor, page: Any) -> None:
    assert floor.admin("POST", "/admin/accounts", json={"id": "dave", "credit_usd": 2.0}).status_code == 201
    made = floor.admin("POST", "/admin/keys", json={"account": "dave", "name": "ci"}).json()
    _open(page, floor, "money", ADMIN_KEY)
    page.click("#accounts tr[data-account='dave'] button[data-action='manage']")
    page.wait_for_selector(f"#keys tr[data-key='{made['id']}']")
    # edit: limits, products, a weekly cap, an expiry
    page.click(f"#keys tr[data-key='{made['id']}'] button[data-action='key']")
    page.wait_for_selector("#key-panel:not([hidden])")
    page.fill("#key-edit input[name='rpm']", "30")
    page.fill("#key-edit input[name='products']", "sim-fast")
    page.fill("#key-edit input[name='spend_cap_usd']", "0.5")
    page.select_option("#key-edit select[name='spend_cap_period']", "week")
    page.fill("#key-edit input[name='expires_at']", "2099-01-02T03:04")
    page.click("#key-edit button[type=submit]")
    page.wait_for_function(
        f"() => document.querySelector(\"#keys tr[data-key='{made['id']}']\").textContent.includes('/ week')",
        timeout=WAIT_MS,
    )
    key = floor.admin("GET", "/admin/keys", params={"account": "dave"}).json()["data"][0]
    assert (key["rpm"], key["products"], key["spend_cap_micros"], key["spend_cap_period"]) == (
        30, ["sim-fast"], 500_000, "week"
    ), key  # fmt: skip
    assert key["expires_at"] == 4_071_006_240  # 2099-01-02 03:04 UTC
    # emptied, a field is cleared; left alone, kept
    page.fill("#key-edit input[name='rpm']", "")
    page.click("#key-edit button[type=submit]")
    page.wait_for_function(
        "() => document.querySelector('#notice').textContent.includes('saved')", timeout=WAIT_MS
    )
    key = floor.admin("GET", "/admin/keys", params={"account": "dave"}).json()["data"][0]
    assert (key["rpm"], key["spend_cap_period"]) == (None, "week"), key
    # rotate, with grace: the new secret shown once, both work
    page.fill("#key-rotate input[name='grace_s']", "600")
    page.click("#key-rotate button[type=submit]")
    _confirm(page, "600 more seconds")
    page.wait_for_selector("#secret-box:not([hidden])")
    rotated = page.inner_text("#secret-key")
    assert rotated.startswith("bk_") and rotated != made["key"]
    for secret in (rotated, made["key"]):
        r = httpx.post(floor.url + "/v1/chat/completions", headers={"authorization": f"Bearer {secret}"},
                       json={"model": "sim-fast", "messages": USER, "max_tokens": 5}, timeout=30)  # fmt: skip
        assert r.status_code == 200, r.text
    page.click("#secret-done")
    assert rotated not in page.content()
    # revoke
    page.fill("#key-revoke input[name='reason']", "laptop lost")
    page.click("#key-revoke button[type=submit]")
    _confirm(page, made["id"])
    page.wait_for_selector(f"#keys tr[data-key='{made['id']}'][data-state='revoked']", timeout=WAIT_MS)
    assert page.is_hidden("#key-panel")
    r = httpx.post(floor.url + "/v1/chat/completions", headers={"authorization": f"Bearer {rotated}"},
                   json={"model": "sim-fast", "messages": USER, "max_tokens": 5}, timeout=30)  # fmt: skip
    assert r.status_code == 401, r.text
    # suspend, resume, close (the balance reported)
    page.fill("#status-reason", "unpaid invoice")
    page.click("#status-form button[data-status='suspend']")
    _confirm(page, "Suspend account dave")
    page.wait_for_selector("#accounts tr[data-account='dave'][data-status='suspended']", timeout=WAIT_MS)
    assert page.inner_text("#panel-status") == "suspended"
    assert "unpaid invoice" in page.inner_text("#panel-kv")
    page.click("#status-form button[data-status='resume']")
    page.wait_for_selector("#accounts tr[data-account='dave'][data-status='active']", timeout=WAIT_MS)
    page.click("#status-form button[data-status='close']")
    _confirm(page, "for good")
    page.wait_for_selector("#accounts tr[data-account='dave'][data-status='closed']", timeout=WAIT_MS)
    balance = floor.admin("GET", "/admin/accounts/dave").json()["balance_micros"]
    assert f"closed: its balance is {_usd(balance)}" in page.inner_text("#notice")
    assert page.is_hidden("#status-form") and page.is_hidden("#key-new")
    _shot(page, "manage-closed")
    actions = [
        e["action"] for e in floor.admin("GET", "/admin/audit", params={"target": "dave"}).json()["data"]
    ]
    assert actions[:3] == ["account.close", "account.resume", "account.suspend"], actions
    actions = [
        e["action"] for e in floor.admin("GET", "/admin/audit", params={"target": made["id"]}).json()["data"]
    ]
    assert actions == ["key.revoke", "key.rotate", "key.update", "key.update", "key.create"], actions
