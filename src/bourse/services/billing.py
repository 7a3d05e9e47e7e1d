"""Money around a run: quote and hold before the book, settle after the outcome.

- The quote is a conservative upper bound (prompt UTF-8 bytes, an allowance per
  message, the whole output budget) priced at the bid; the hold is the quote.
- Settlement charges actual tokens at the cleared price, never more than the hold,
  following the product's policy for each outcome (SPEC sections 7, 8, 12), and
  writes the usage record in the same transaction. It runs as its own task, so a
  client that leaves can neither strand a hold nor lose a charge.
- Recovery: at start-up the holds left open by a previous run go to
  ``reconciling``; a heartbeat keeps this instance's lease for replicas.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from bourse.domain.errors import GatewayError
from bourse.domain.money import affordable_tokens, charge, micros_to_usd, price_units, quote_tokens
from bourse.ports.stores import Hold, HoldNotOpen, InsufficientFunds, LedgerStore, UnknownAccount, UsageRecord

if TYPE_CHECKING:
    from bourse.services.completion import Finished, Run

log = logging.getLogger("bourse.billing")


class BillingStore(LedgerStore, Protocol):
    single_node: bool


def prompt_bytes_and_messages(body: dict[str, Any]) -> tuple[int, int]:
    msgs = body.get("messages")
    if isinstance(msgs, list):
        total = 0
        for m in msgs:
            if not isinstance(m, dict):
                continue
            c = m.get("content")
            if isinstance(c, str):
                total += len(c.encode())
            elif isinstance(c, list):
                for part in c:
                    if isinstance(part, dict):
                        t = part.get("text")
                        total += len(t.encode()) if isinstance(t, str) else 64
            for tc in m.get("tool_calls") or ():
                fn = tc.get("function") if isinstance(tc, dict) else None
                if isinstance(fn, dict):
                    total += len(str(fn.get("arguments", "")).encode()) + len(
                        str(fn.get("name", "")).encode()
                    )
        tools = body.get("tools")
        if tools:
            import orjson

            total += len(orjson.dumps(tools))
        return total, len(msgs)
    p = body.get("prompt")
    if isinstance(p, str):
        return len(p.encode()), 1
    if isinstance(p, list):
        return sum(len(x.encode()) if isinstance(x, str) else 1 for x in p), 1
    return 0, 1


class Billing:
    """Holds and settlements for runs, against a ledger store."""

    def __init__(self, store: BillingStore, *, owner: str | None = None, lease_s: float = 15.0) -> None:
        self.store = store
        self.owner = owner or "gw_" + os.urandom(8).hex()
        self.lease_s = lease_s
        self._heartbeat: asyncio.Task[None] | None = None

    # -- before the book ----------------------------------------------------------

    def quote(self, run: Run, prompt_bytes: int, messages: int) -> None:
        """Set the run's quote: the upper bound (tokens, micro-USD) its hold covers."""
        tokens = quote_tokens(prompt_bytes, messages, run.max_output_tokens)
        run.quote_tokens = tokens
        run.quote_micros = -(-(tokens * price_units(run.bid)) // 1_000_000)

    async def hold(self, run: Run, account_id: str) -> None:
        """Hold the run's quote (set by :meth:`quote`) on ``account_id``; 402 if it cannot."""
        tokens, micros = run.quote_tokens, run.quote_micros
        hold_id = "hold_" + os.urandom(12).hex()
        try:
            await self.store.place_hold(
                Hold(
                    id=hold_id,
                    account_id=account_id,
                    request_id=run.request_id,
                    amount_micros=micros,
                    state="open",
                    owner=self.owner,
                    product=run.product,
                    created_at=time.time(),
                )
            )
        except InsufficientFunds as exc:
            units = price_units(run.bid)
            can = affordable_tokens(exc.balance_micros, units)
            raise GatewayError(
                402,
                "insufficient_funds",
                f"The balance ({exc.balance_micros} micro-USD) cannot cover this request's hold of {micros} micro-USD "
                f"({tokens} tokens at {run.bid:g} USD per 1M). At this bid it can afford {can} tokens: lower "
                f"max_tokens, shorten the prompt, or add credit.",
            ) from None
        except UnknownAccount:
            raise GatewayError(401, "invalid_api_key", "This API key's account no longer exists.") from None
        run.hold_id = hold_id
        run.account_id = account_id

    async def release_unbooked(self, run: Run) -> None:
        """The order never entered the book (503): give the hold back."""
        if run.hold_id is not None:
            await self.store.release(run.hold_id, None, time.time())
            run.hold_id = None

    # -- after the outcome ----------------------------------------------------------

    def decide(self, run: Run, fin: Finished) -> tuple[str, int]:
        """("settle", charge) | ("release", 0) | ("reconcile", 0) for this outcome and policy."""
        policy = run.market.policy
        usage = fin.usage
        produced = run.tokens > 0 or bool(usage.get("completion_tokens"))
        units = price_units(run.cleared_price if run.cleared_price is not None else run.bid)
        cost = charge(int(usage["prompt_tokens"]), int(usage["completion_tokens"]), units, run.quote_micros)
        outcome = fin.outcome
        if not produced:
            return "release", 0
        if outcome == "completed":
            if usage.get("usage_estimated") and policy.missing_usage == "reconcile":
                return "reconcile", 0
            return "settle", cost
        if outcome in ("disconnected", "canceled"):
            if usage.get("usage_estimated") and policy.missing_usage == "reconcile":
                return "reconcile", 0
            return ("settle", cost) if policy.charge_on_disconnect == "generated" else ("release", 0)
        if outcome == "error":
            return ("settle", cost) if policy.charge_on_error == "generated" else ("release", 0)
        return "release", 0

    async def settle(self, run: Run, fin: Finished) -> None:
        """Close the run's hold per policy, write its usage record, fill in the receipt."""
        action, cost = self.decide(run, fin)
        if action == "reconcile":
            fin.outcome = "reconciling"
            fin.receipt["outcome"] = "reconciling"
        self.fill_receipt(run, fin, cost)
        hold_id = run.hold_id
        if hold_id is None:
            return
        record = UsageRecord(
            request_id=run.request_id,
            account_id=run.account_id or "",
            product=run.product,
            created_at=run.created_at,
            outcome=fin.outcome,
            cost_micros=cost,
            record=usage_document(run, fin),
        )
        now = time.time()
        for attempt in range(5):
            try:
                if action == "settle":
                    await self.store.settle(hold_id, cost, record, now)
                elif action == "release":
                    await self.store.release(hold_id, record, now)
                else:
                    await self.store.to_reconciling(hold_id, record, "the engine gave no usage", now)
                run.hold_id = None
                return
            except HoldNotOpen:
                log.error("hold %s of request %s was already closed", hold_id, run.request_id)
                return
            except Exception:
                log.exception("settling hold %s failed (attempt %d); retrying", hold_id, attempt + 1)
                await asyncio.sleep(0.05 * 2**attempt)
        log.error("hold %s stays open after 5 attempts; it will be reconciled at the next start", hold_id)

    @staticmethod
    def fill_receipt(run: Run, fin: Finished, cost: int) -> None:
        fin.usage["cost"] = micros_to_usd(cost)
        fin.usage["cost_micros"] = cost
        receipt = fin.receipt
        receipt["cost_micros"] = cost
        if run.market.policy.receipt_name == "hips":
            receipt["quote"] = run.quote_micros
        else:
            receipt["quote_micros"] = run.quote_micros
        fin.cost_micros = cost

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> int:
        """Reconcile orphaned holds and start the lease heartbeat; returns the orphans found."""
        now = time.time()
        await self.store.heartbeat(self.owner, now + self.lease_s, now)
        # nothing runs yet: this instance's own open holds are from a previous life
        n = await self.store.reconcile_orphans(
            self.owner, now, all_others=self.store.single_node, include_own=True
        )
        if n:
            log.warning(
                "%d holds left open by a previous run are now 'reconciling' (see GET /admin/holds)", n
            )
        self._heartbeat = asyncio.create_task(self._beat())
        return n

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            now = time.time()
            try:
                await self.store.heartbeat(self.owner, now + self.lease_s, now)
                if not self.store.single_node:
                    await self.store.reconcile_orphans(self.owner, now, all_others=False)
            except Exception:
                log.exception("lease heartbeat failed")

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None


def usage_document(run: Run, fin: Finished) -> dict[str, Any]:
    """The usage record as GET /v1/usage/{request_id} returns it."""
    return {
        "id": run.request_id,
        "object": "bourse.usage",
        "created": run.created,
        "model": run.product,
        "endpoint": "/v1/chat/completions" if run.kind == "chat" else "/v1/completions",
        "outcome": fin.outcome,
        "usage": fin.usage,
        "receipt": fin.receipt,
        "key_id": run.key_id,
    }
