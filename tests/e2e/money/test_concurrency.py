"""100 concurrent requests on a balance that affords exactly 30 holds: never an
overdraft, exactly 70 refusals (402), the charges never exceed the credit, the
ledger balances and no hold stays open. Over SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai

from tests.e2e.money.support import As, assert_ledger_balanced, expected_cost, new_caller, quote_tokens
from tests.support.bodies import USER
from tests.support.gateway import running_gateway

PRICE = 1.0
CONFIG = f"""
[products.crowd]
sim_overrides = true
max_output_tokens = 512
[[products.crowd.deployments]]
engine = "sim"
slots = 200
floor = {PRICE}
"""
N = 100
AFFORDABLE = 30
MAX_TOKENS = 20
TTFT_MS = 3000
"""Every admitted request waits this long before its first token, so that all 100
holds are attempted while the first 30 are still held."""


async def _one(client: openai.AsyncOpenAI, t0: float) -> dict[str, Any]:
    try:
        raw = await client.chat.completions.with_raw_response.create(
            model="crowd",
            messages=USER,
            max_tokens=MAX_TOKENS,
            extra_body={"sim": {"ttft_ms": TTFT_MS, "output_tokens": 10}},
        )
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        return {"status": exc.status_code, "t": time.monotonic() - t0, "code": body.get("code")}
    doc = raw.parse()
    return {
        "status": raw.http_response.status_code,
        "t": time.monotonic() - t0,
        "cost": int(raw.headers["x-bourse-cost-micros"]),
        "quote": int(raw.headers["x-bourse-quote-micros"]),
        "usage": doc.usage.model_dump() if doc.usage else None,
        "id": doc.id,
    }


async def _watch_balance(
    gw_url: str, admin_headers: dict[str, str], account: str, stop: asyncio.Event
) -> list[int]:
    seen: list[int] = []
    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            r = await http.get(f"{gw_url}/admin/accounts/{account}", headers=admin_headers)
            seen.append(int(r.json()["balance_micros"]))
            await asyncio.sleep(0.05)
    return seen


async def _crowd(me: As) -> tuple[list[dict[str, Any]], list[int]]:
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_balance(me.gw.url, me.gw.admin_headers, me.account, stop))
    t0 = time.monotonic()
    async with openai.AsyncOpenAI(base_url=me.gw.v1, api_key=me.key, max_retries=0, timeout=60) as client:
        results = await asyncio.gather(*(_one(client, t0) for _ in range(N)))
    stop.set()
    return list(results), await watcher


def test_100_concurrent_requests_on_a_balance_for_30_holds(db: str | None) -> None:
    with running_gateway(CONFIG, database=db) as gw:
        hold = expected_cost(quote_tokens(USER, MAX_TOKENS), PRICE)
        credit = AFFORDABLE * hold + hold // 2  # 30 holds and a half: never 31
        me = new_caller(gw, "crowd", credit / 1_000_000)
        assert me.balance() == credit

        results, balances = asyncio.run(_crowd(me))

        ok = [r for r in results if r["status"] == 200]
        refused = [r for r in results if r["status"] == 402]
        others = [r for r in results if r["status"] not in (200, 402)]
        assert others == [], others
        assert all(r["code"] == "insufficient_funds" for r in refused), refused[:3]
        # the refusals all came before any admitted request finished (so no hold had
        # been given back yet): exactly 30 holds fit, 70 are refused
        assert refused and ok
        assert max(r["t"] for r in refused) < min(r["t"] for r in ok), (
            "timing precondition: a refusal came after a request finished; raise TTFT_MS"
        )
        assert len(ok) == AFFORDABLE, (len(ok), len(refused))
        assert len(refused) == N - AFFORDABLE
        assert all(r["quote"] == hold for r in ok), {r["quote"] for r in ok}

        charges = sum(r["cost"] for r in ok)
        for r in ok:
            u = r["usage"]
            assert r["cost"] == expected_cost(
                u["prompt_tokens"] + u["completion_tokens"], u["x_market"]["cleared_price"]
            ), u
        assert charges <= credit
        assert min(balances) >= 0, min(balances)
        assert me.wait_settled() == []
        assert me.balance() == credit - charges
        acct = me.assert_books()
        assert acct["spent_micros"] == charges
        assert len(me.holds("settled")) == AFFORDABLE
        assert len(me.holds()) == AFFORDABLE  # a refusal leaves no hold behind
        assert_ledger_balanced(gw)
