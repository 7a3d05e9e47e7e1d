"""A settlement's charge (services/billing.py ``assess``): the tokens at the cleared
price up to the hold, and the rest recorded in the receipt as ``unpaid_micros``, never
dropped; a charge within the hold records nothing more. A close above its hold that
reaches the ledger anyway is refused there and goes to an operator."""

from __future__ import annotations

from typing import Any

import pytest

from bourse.domain.policy import PRESETS
from bourse.ports.stores import UsageRecord
from bourse.services.billing import Billing, Closing, Quote, assess
from bourse.services.hold_sweep import HoldClose
from tests.support.databases import StoreFactory

NOW = 1_700_000_000.0


def _closing(prompt: int, completion: int, hold_micros: int, price: float = 2.0) -> Closing:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    return Closing(
        request_id="chatcmpl-x", kind="chat", endpoint="/v1/chat/completions", product="p",
        created_at=0.0, account_id="a", key_id=None, hold_id="h", quote=Quote(100, hold_micros, price),
        policy=PRESETS["default"], outcome="completed", produced=True, price=price, usage=usage,
        receipt={"latency_ms": 1.0},
    )  # fmt: skip


@pytest.mark.parametrize(("prompt", "completion"), [(10, 20), (0, 1), (400, 600)])
def test_a_charge_within_its_hold_is_the_tokens_cost(prompt: int, completion: int) -> None:
    s = assess(_closing(prompt, completion, hold_micros=10_000))
    assert s.action == "settle"
    assert s.cost_micros == (prompt + completion) * 2  # 2 USD per 1M tokens: 2 micro-USD a token
    assert "unpaid_micros" not in s.receipt
    assert s.receipt["cost_micros"] == s.usage["cost_micros"] == s.cost_micros


def test_tokens_past_the_hold_are_charged_the_hold_and_the_rest_recorded() -> None:
    s = assess(_closing(500, 1_000, hold_micros=1_000))  # 3,000 micro-USD of tokens
    assert s.cost_micros == 1_000
    assert s.receipt["unpaid_micros"] == 2_000
    assert s.usage["cost_micros"] == 1_000


@pytest.mark.anyio
async def test_a_close_above_its_hold_goes_to_an_operator_not_clamped(store_factory: StoreFactory) -> None:
    """Should a defect ask the ledger to charge more than a hold, the store refuses it
    and the gateway moves the hold to ``reconciling`` with why, its usage record kept:
    nothing charged behind anyone's back, nothing left open."""
    async with store_factory() as s:
        await s.create_account("a", 10_000, NOW)
        billing = Billing(s, owner="me")
        hold_id = await billing.hold(Quote(100, 250, 2.5), account_id="a", request_id="r1", product="p")
        record = UsageRecord("r1", "a", "p", NOW, "completed", 251, {"id": "r1"})
        await billing._write(HoldClose(hold_id, "settle", 251, record, NOW), False)
        hold = await s.hold(hold_id)
        assert hold is not None and (hold.state, hold.charged_micros) == ("reconciling", 0)
        assert "251 micro-USD above the hold" in (hold.note or "")
        assert await s.usage("a", "r1") == record
        account = await s.account("a")
        assert account is not None and (account.balance_micros, account.reconciling_micros) == (9_750, 250)
