"""API keys on a served gateway, over SQLite and PostgreSQL: a spend cap holds under
50 concurrent requests (exactly as many holds as fit, the rest 402
``key_budget_exceeded``, never a micro-USD over the cap), a rotated key's old secret
works through its grace period and then gets 401, and the ``bourse admin`` CLI
covers keys, accounts and the audit log (tables by default, ``--json``, one line on
stderr and exit 2 on a failure)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import openai

from tests.e2e.money.support import As, assert_ledger_balanced, expected_cost, new_caller, quote_tokens
from tests.support.bodies import USER
from tests.support.gateway import ADMIN_KEY, Gateway, running_gateway
from tests.support.processes import free_port

PRICE = 1.0
CONFIG = f"""
[products.capped]
max_output_tokens = 512
sim_overrides = true
[[products.capped.deployments]]
engine = "sim"
slots = 200
floor = {PRICE}
"""
N = 50
FITS = 12
MAX_TOKENS = 20
TTFT_MS = 6000
"""Every admitted request waits this long before its first token, so that all 50
holds are attempted while the first ones are still held."""


async def _one(client: openai.AsyncOpenAI, t0: float) -> dict[str, Any]:
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model="capped",
            messages=USER,
            max_tokens=MAX_TOKENS,
            extra_body={"sim": {"ttft_ms": TTFT_MS, "output_tokens": 10}},
        )
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        return {"status": exc.status_code, "t": time.monotonic() - t0, "code": body.get("code")}
    doc = raw.parse()
    assert doc.usage is not None
    return {
        "status": raw.http_response.status_code,
        "t": time.monotonic() - t0,
        "cost": int(raw.headers["x-bourse-cost-micros"]),
        "usage": doc.usage.model_dump(),
    }


def _key_row(gw: Gateway, key_id: str, account: str) -> dict[str, Any]:
    r = gw.admin("GET", "/admin/keys", params={"account": account})
    assert r.status_code == 200, r.text
    rows: list[dict[str, Any]] = [k for k in r.json()["data"] if k["id"] == key_id]
    assert len(rows) == 1, r.text
    return rows[0]


async def _watch_spend(gw: Gateway, key_id: str, account: str, stop: asyncio.Event) -> list[int]:
    seen: list[int] = []
    async with httpx.AsyncClient(timeout=10, headers=gw.admin_headers) as http:
        while not stop.is_set():
            r = await http.get(f"{gw.url}/admin/keys", params={"account": account})
            seen += [k["spend_micros"] for k in r.json()["data"] if k["id"] == key_id]
            await asyncio.sleep(0.05)
    return seen


async def _crowd(gw: Gateway, me: As, key_id: str) -> tuple[list[dict[str, Any]], list[int]]:
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_spend(gw, key_id, me.account, stop))
    t0 = time.monotonic()
    async with openai.AsyncOpenAI(base_url=gw.v1, api_key=me.key, max_retries=0, timeout=90) as client:
        results = await asyncio.gather(*(_one(client, t0) for _ in range(N)))
    stop.set()
    return list(results), await watcher


def test_50_concurrent_requests_never_pass_a_keys_spend_cap(db: str | None) -> None:
    with running_gateway(CONFIG, database=db) as gw:
        hold = expected_cost(quote_tokens(USER, MAX_TOKENS), PRICE)
        cap = FITS * hold + hold - 1  # 12 holds and almost a 13th: never 13
        caller = new_caller(gw, "capped", 10.0)
        made = gw.admin("POST", "/admin/keys", json={"account": "capped", "spend_cap_usd": cap / 1_000_000})
        assert made.status_code == 201, made.text
        created = made.json()
        assert created["spend_cap_micros"] == cap
        me = As(gw, created["key"], "capped")
        credit = me.balance()

        results, spends = asyncio.run(_crowd(gw, me, created["id"]))

        ok = [r for r in results if r["status"] == 200]
        refused = [r for r in results if r["status"] == 402]
        assert [r for r in results if r["status"] not in (200, 402)] == []
        assert all(r["code"] == "key_budget_exceeded" for r in refused), refused[:3]
        assert refused and ok
        assert max(r["t"] for r in refused) < min(r["t"] for r in ok), (
            "timing precondition: a refusal came after a request finished; raise TTFT_MS"
        )
        assert (len(ok), len(refused)) == (FITS, N - FITS)
        assert max(spends, default=0) <= cap, max(spends)

        charges = sum(r["cost"] for r in ok)
        for r in ok:
            u = r["usage"]
            assert r["cost"] == expected_cost(
                u["prompt_tokens"] + u["completion_tokens"], u["x_market"]["cleared_price"]
            )
        assert charges <= cap
        assert me.wait_settled() == []
        row = _key_row(gw, created["id"], "capped")
        assert row["spend_micros"] == charges  # the holds' unused parts came back
        assert row["last_used_at"] is not None
        assert me.balance() == credit - charges
        assert len(me.holds()) == FITS  # a refusal leaves no hold behind
        me.assert_books()
        assert_ledger_balanced(gw)
        # the caller's other key has no cap: its account still pays
        assert caller.post({"model": "capped", "max_tokens": 5}).status_code == 200


def _status(gw: Gateway, key: str) -> int:
    return httpx.get(
        gw.url + "/v1/account", headers={"authorization": f"Bearer {key}"}, timeout=30
    ).status_code


def test_a_rotated_key_keeps_its_old_secret_through_the_grace_period(db: str | None) -> None:
    grace_s = 2.0
    with running_gateway(CONFIG, database=db) as gw:
        old = gw.new_key()
        assert _status(gw, old) == 200
        r = gw.admin("GET", "/admin/keys", params={"account": gw.account})
        key_id = next(k["id"] for k in r.json()["data"])
        r = gw.admin("POST", f"/admin/keys/{key_id}/rotate", json={"grace_s": grace_s})
        assert r.status_code == 200, r.text
        rotated = r.json()
        new, until = rotated["key"], rotated["old_key_valid_until"]
        assert until == rotated["old_key_valid_until"] and until > time.time()
        assert _status(gw, new) == 200
        while True:  # the old secret: 200 until the grace period ends, then 401
            started = time.time()
            status = _status(gw, old)
            answered = time.time()
            if status != 200:
                break
            assert started < until, "the old secret still worked after its grace period"
            time.sleep(0.05)
        assert status == 401
        assert answered >= until, "the old secret stopped before its grace period ended"
        assert started < until + 1.0
        assert _status(gw, new) == 200


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BOURSE_")}
    return subprocess.run(
        [sys.executable, "-m", "bourse", "admin", "--url", url, "--admin-key", ADMIN_KEY, *args],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def test_the_admin_cli_covers_keys_accounts_and_the_audit_log() -> None:
    with running_gateway(CONFIG) as gw:
        p = _cli(gw.url, "--actor", "ops", "accounts", "create", "cli-acct", "--credit-usd", "2")
        assert p.returncode == 0, p.stderr
        assert "balance: $2.000000" in p.stdout

        p = _cli(gw.url, "keys", "create", "--account", "cli-acct", "--name", "robot", "--products", "capped",
                 "--cap-usd", "0.5", "--cap-period", "day", "--expires-in", "30d")  # fmt: skip
        assert p.returncode == 0, p.stderr
        secret = next(line for line in p.stdout.splitlines() if line.startswith("API key (shown once"))
        secret = secret.rsplit(" ", 1)[1]
        assert secret.startswith("bk_") and _status(gw, secret) == 200

        p = _cli(gw.url, "keys", "list", "--account", "cli-acct")
        assert p.returncode == 0, p.stderr
        header, row = p.stdout.splitlines()[:2]
        assert header.split()[:4] == ["ID", "ACCOUNT", "NAME", "STATE"]
        assert "robot" in row and "active" in row and "$0.000000 of $0.500000 today" in row
        assert secret not in p.stdout

        p = _cli(gw.url, "--json", "keys", "list", "--account", "cli-acct")
        doc = json.loads(p.stdout)
        key_id = doc["data"][0]["id"]
        assert doc["data"][0]["spend_cap_period"] == "day"

        p = _cli(gw.url, "keys", "revoke", key_id, "--reason", "test")
        assert p.returncode == 0, p.stderr
        assert "state: revoked" in p.stdout
        assert _status(gw, secret) == 401

        p = _cli(gw.url, "audit", "list", "--target", key_id, "--json")
        entries = json.loads(p.stdout)["data"]
        assert [(e["action"], e["actor"]) for e in entries] == [
            ("key.revoke", "admin:cli"),
            ("key.create", "admin:cli"),
        ]
        p = _cli(gw.url, "audit", "list", "--action", "account.create", "--limit", "500")
        assert "admin:ops" in p.stdout and "cli-acct" in p.stdout
        p = _cli(gw.url, "accounts", "list")
        assert p.returncode == 0 and "cli-acct" in p.stdout

        # failures: one line on stderr, exit 2
        p = _cli(gw.url, "keys", "create", "--account", "cli-acct", "--products", "nosuch")
        assert (p.returncode, p.stdout) == (2, "")
        assert p.stderr.count("\n") == 1 and "400 invalid_request" in p.stderr and "'nosuch'" in p.stderr
        p = _cli(f"http://127.0.0.1:{free_port()}", "accounts", "list")
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and "cannot reach" in p.stderr
        assert "Traceback" not in p.stderr
