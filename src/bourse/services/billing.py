"""Money around a run: quote and hold before the book, settle after the outcome.

:class:`Billing` takes and returns plain values: a :class:`Quote` before the book,
a :class:`Closing` (the run's end) in and a :class:`Settlement` out after it. It
never sees the run itself.

- The quote is a conservative upper bound (prompt UTF-8 bytes, an allowance per
  message, the whole output budget) priced at the bid; the hold is the quote. A key
  with a spend cap has the hold counted on its cap in the same transaction (402
  ``key_budget_exceeded`` when it would pass it), and so has an account with one
  (402 ``account_budget_exceeded``, saying when the period starts again).
- Settlement charges actual tokens at the cleared price, never more than the hold,
  following the outcome x policy table of :mod:`bourse.domain.charging` (SPEC
  sections 7, 8, 12), and writes the usage record in the same transaction. The run
  starts it as a task of its own, so a client that leaves can neither strand a hold
  nor lose a charge; a close the store refuses (after the adapter's own retries) is
  kept for the hold sweeper (:mod:`bourse.services.hold_sweep`), which writes it once
  the store takes it again, on the live gateway and in the drain before it exits.
- Recovery: at start-up the holds left open by a previous run go to
  ``reconciling``; a heartbeat keeps this instance's lease for replicas, on the
  database's clock (the store writes and judges leases in its SQL), and measures this
  process's offset from that clock (:class:`~bourse.services.clock.DatabaseClock`):
  the times written into the ledger (a hold's, the spend cap's day) are on it too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Protocol

from bourse.domain.charging import Action, Outcome, RecordedOutcome, decide, recorded
from bourse.domain.errors import GatewayError
from bourse.domain.money import (
    affordable_tokens,
    charge,
    cost_micros,
    micros_to_usd,
    price_units,
    quote_tokens,
)
from bourse.domain.periods import cap_period, per_period, period_end
from bourse.domain.policy import Policy
from bourse.domain.values import immutable
from bourse.ports.budgets import AccountBudgetExceeded, KeyBudgetExceeded
from bourse.ports.engine import Kind
from bourse.ports.observer import NULL_OBSERVER, Observer
from bourse.ports.stores import (
    ApiKey,
    ChargeAboveHold,
    Hold,
    HoldNotOpen,
    InsufficientFunds,
    LedgerStore,
    StoreUnavailable,
    UnknownAccount,
    UsageRecord,
)
from bourse.services.clock import DatabaseClock
from bourse.services.hold_sweep import HoldClose, HoldSweeper
from bourse.services.ids import new_hold_id
from bourse.wire.prompt import PromptSize

log = logging.getLogger("bourse.billing")

NO_USAGE_NOTE = "the engine gave no usage"
"""The note of a hold moved to ``reconciling`` because its run reported no usage."""
ENDPOINTS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
"""Each kind of run's own route: the one map of them (the hot routes and the job
endpoints are read from it)."""
RESPONSES = "/v1/responses"
"""The Responses API's route: its requests run as chat completions."""
ROUTES: dict[str, Kind] = {**{path: kind for kind, path in ENDPOINTS.items()}, RESPONSES: "chat"}
"""Every route a run answers, and the kind of run it is: a run's access line and its
usage record's ``endpoint`` name its route, not its kind's."""


class BillingStore(LedgerStore, Protocol):
    single_node: bool


@immutable
class Quote:
    """The upper bound a request's hold covers: its tokens, and their cost at the bid."""

    tokens: int
    micros: int
    bid: float


def budget_exceeded(exc: KeyBudgetExceeded, quote: Quote) -> GatewayError:
    """The 402 of a hold that would take its key past its spend cap."""
    per = per_period(exc.period)
    left = max(0, exc.cap_micros - exc.spent_micros)
    return GatewayError(
        402,
        "key_budget_exceeded",
        f"This API key's spend cap is {exc.cap_micros} micro-USD {per}; {exc.spent_micros} micro-USD of it "
        f"is spent or held, which leaves {left}, less than this request's hold of {quote.micros} micro-USD "
        f"({quote.tokens} tokens at {quote.bid:g} USD per 1M). Lower max_tokens, or ask for a higher cap.",
    )


def account_budget_exceeded(exc: AccountBudgetExceeded, quote: Quote, now: float) -> GatewayError:
    """The 402 of a hold that would take its account past its spend cap: how much of it
    is left, and when the period (on the database's clock, ``now``) starts it again."""
    left = max(0, exc.cap_micros - exc.spent_micros)
    end = period_end(exc.period, now)
    if end is None:
        when = "The cap counts in total: it does not start again. Lower max_tokens, or ask for a higher cap."
    else:
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(end))
        when = (f"It starts again at {at} (the next UTC {exc.period}). Lower max_tokens, wait for it, "
                "or ask for a higher cap.")  # fmt: skip
    return GatewayError(
        402,
        "account_budget_exceeded",
        f"This account's spend cap is {exc.cap_micros} micro-USD {per_period(exc.period)}, for all its keys; "
        f"{exc.spent_micros} micro-USD of it is spent or held, which leaves {left}, less than this request's "
        f"hold of {quote.micros} micro-USD ({quote.tokens} tokens at {quote.bid:g} USD per 1M). {when}",
    )


def quote_for(prompt: PromptSize, max_output_tokens: int, bid: float) -> Quote:
    """The quote of a request with this prompt and output budget, at ``bid`` (USD per 1M tokens)."""
    tokens = quote_tokens(prompt.bytes, prompt.messages, max_output_tokens)
    return Quote(tokens, cost_micros(tokens, price_units(bid)), bid)


@immutable
class Closing:
    """A run's end, as plain values: everything its settlement reads."""

    request_id: str
    kind: Kind
    endpoint: str
    """The route the client called (one of :data:`ROUTES`), the usage record's ``endpoint``."""
    product: str
    created_at: float
    account_id: str
    key_id: str | None
    hold_id: str | None
    quote: Quote
    policy: Policy
    outcome: Outcome
    produced: bool
    """The engine generated at least one token."""
    price: float
    """The cleared price (USD per 1M tokens); the bid when the order was never admitted."""
    usage: Mapping[str, Any]
    """Token counts and ``x_market``; ``usage_estimated`` when the gateway counted."""
    receipt: Mapping[str, Any]
    """``latency_ms`` (and ``ttft_ms``) and ``outcome``."""
    correlation_id: str | None = None
    """The client's own ``x-request-id``, kept in the usage record."""


@immutable
class Settlement:
    """What became of a run's hold, and the usage and receipt the client sees."""

    action: Action
    outcome: RecordedOutcome
    cost_micros: int
    usage: dict[str, Any]
    """The closing's usage with ``cost`` (USD) and ``cost_micros``."""
    receipt: dict[str, Any]
    """The closing's receipt with the recorded outcome, ``cost_micros`` and the quote."""


def assess(closing: Closing) -> Settlement:
    """The settlement of ``closing`` (pure): the policy's decision, the charge, the receipt."""
    policy = closing.policy
    usage = closing.usage
    action = decide(
        closing.outcome,
        policy,
        produced=closing.produced,
        usage_estimated=bool(usage.get("usage_estimated")),
    )
    cost = unpaid = 0
    if action == "settle":
        units = price_units(closing.price)
        cost, unpaid = charge(
            int(usage["prompt_tokens"]), int(usage["completion_tokens"]), units, closing.quote.micros
        )
    outcome = recorded(closing.outcome, action)
    receipt = {
        **closing.receipt,
        "outcome": outcome,
        "cost_micros": cost,
        policy.receipt_quote_field: closing.quote.micros,
    }
    if unpaid:  # recorded, never silently dropped: the tokens' cost past the hold
        receipt["unpaid_micros"] = unpaid
    return Settlement(
        action, outcome, cost, {**usage, "cost": micros_to_usd(cost), "cost_micros": cost}, receipt
    )


class Billing:
    """Holds and settlements, against a ledger store."""

    def __init__(
        self,
        store: BillingStore,
        *,
        owner: str | None = None,
        lease_s: float = 15.0,
        observer: Observer = NULL_OBSERVER,
        clock: DatabaseClock | None = None,
    ) -> None:
        self.store = store
        self.owner = owner or "gw_" + os.urandom(8).hex()
        self.lease_s = lease_s
        self.observer = observer
        self.clock = clock or DatabaseClock()
        """The database's clock (its offset measured by each heartbeat): the time of
        every ledger and job record that another replica compares."""
        self._heartbeat: asyncio.Task[None] | None = None
        self.sweeper = HoldSweeper(store, self.owner, self._write, self.clock.now)
        """This gateway's holds not closed yet, and their sweep (``[storage] hold_sweep_interval_s``)."""

    # -- before the book ----------------------------------------------------------

    async def hold(
        self, quote: Quote, *, account_id: str, request_id: str, product: str, key: ApiKey | None = None
    ) -> str:
        """Hold ``quote`` on ``account_id`` (counted on ``key``'s spend cap if it has
        one, and on its account's); the hold's id. 402 if the balance or a cap cannot cover it."""
        hold_id = new_hold_id()
        now = self.clock.now()
        period = account_period = None
        if key is not None and key.spend_cap_period is not None and key.spend_cap_micros is not None:
            period = cap_period(key.spend_cap_period, now)
        if key is not None and key.account_cap_period is not None:
            account_period = cap_period(key.account_cap_period, now)
        t = time.perf_counter()
        sweeper = self.sweeper
        sweeper.placing(hold_id)
        try:
            await self.store.place_hold(
                Hold(
                    id=hold_id,
                    account_id=account_id,
                    request_id=request_id,
                    amount_micros=quote.micros,
                    state="open",
                    owner=self.owner,
                    product=product,
                    created_at=now,
                    key_id=None if key is None else key.id,
                    spend_period=period,
                    account_period=account_period,
                )
            )
        except KeyBudgetExceeded as exc:
            sweeper.done(hold_id)
            raise budget_exceeded(exc, quote) from None
        except AccountBudgetExceeded as exc:
            sweeper.done(hold_id)
            raise account_budget_exceeded(exc, quote, now) from None
        except InsufficientFunds as exc:
            sweeper.done(hold_id)
            can = affordable_tokens(exc.balance_micros, price_units(quote.bid))
            raise GatewayError(
                402,
                "insufficient_funds",
                f"The balance ({exc.balance_micros} micro-USD) cannot cover this request's hold of "
                f"{quote.micros} micro-USD ({quote.tokens} tokens at {quote.bid:g} USD per 1M). At this bid it "
                f"can afford {can} tokens: lower max_tokens, shorten the prompt, or add credit.",
            ) from None
        except UnknownAccount:
            sweeper.done(hold_id)
            raise GatewayError(401, "invalid_api_key", "This API key's account no longer exists.") from None
        except BaseException as exc:  # cancelled too: the transaction may stand
            sweeper.not_placed(hold_id)
            if isinstance(exc, Exception):
                self.observer.backend_error("database", "hold", exc)
            raise
        self.observer.ledger_timed("hold", time.perf_counter() - t)
        return hold_id

    async def release(self, hold_id: str) -> None:
        """The order never entered the book (503), or a job is handed back: give the
        hold back (the hold sweeper does, if the store refuses it now)."""
        t = time.perf_counter()
        try:
            await self.store.release(hold_id, None, self.clock.now())
        except HoldNotOpen as exc:
            self.observer.backend_error("database", "release", exc)
            raise
        except BaseException as exc:
            self.sweeper.keep(HoldClose(hold_id, "release", 0, None, self.clock.now()), exc)
            if isinstance(exc, Exception):
                self.observer.backend_error("database", "release", exc)
            raise
        finally:
            self.sweeper.done(hold_id)
        self.observer.ledger_timed("release", time.perf_counter() - t)

    # -- after the outcome ----------------------------------------------------------

    async def settle(self, closing: Closing) -> Settlement:
        """Close the hold per policy with its usage record; the settlement. Never raises
        for the store: a close it refuses past the retries is kept for the hold sweeper.
        (One coroutine, with the write's below it: every suspension of the write resumes
        each coroutine above it.)"""
        s = assess(closing)
        hold_id, request_id = closing.hold_id, closing.request_id
        if hold_id is None:
            return s
        record = UsageRecord(
            request_id=request_id,
            account_id=closing.account_id,
            product=closing.product,
            created_at=closing.created_at,
            outcome=s.outcome,
            cost_micros=s.cost_micros,
            record=usage_document(closing, s),
        )
        close = HoldClose(hold_id, s.action, s.cost_micros, record, self.clock.now())
        # one attempt: the adapters already retry what a retry mends (a lost connection,
        # a file locked within the busy timeout); a store still unavailable after that
        # would keep the client waiting (its last frames follow the settlement), so the
        # close is kept for the hold sweeper, which writes it once the store is back
        try:
            await self._write(close, False)
        except Exception as exc:
            self.sweeper.keep(close, exc)
        except BaseException as exc:
            self.sweeper.keep(close, exc)
            raise
        finally:
            self.sweeper.done(hold_id)
        return s

    async def _write(self, close: HoldClose, swept: bool) -> None:
        """Write one close (``swept``: by the hold sweeper, after the store refused it)."""
        store, observer = self.store, self.observer
        hold_id, usage = close.hold_id, close.usage
        t = time.perf_counter()
        try:
            if close.action == "settle":
                await store.settle(hold_id, close.cost_micros, usage, close.now)
            elif close.action == "release":
                await store.release(hold_id, usage, close.now)
            else:
                assert usage is not None  # a run's own decision: it has its usage record
                await store.to_reconciling(hold_id, usage, NO_USAGE_NOTE, close.now)
                observer.hold_reconciling(hold_id, usage.request_id, NO_USAGE_NOTE)
        except HoldNotOpen as exc:
            if swept:  # a refused try whose outcome was unknown had been written after all
                log.info("hold %s was %s already when the sweeper came", hold_id, exc.state)
            else:
                rid = usage and usage.request_id
                log.error("hold %s of request %s: %s", hold_id, rid, exc)
            return
        except ChargeAboveHold as exc:  # a defect: the hold goes to an operator, never clamped
            log.error("%s (request %s): moved to reconciling", exc, usage and usage.request_id)
            note = f"a charge of {exc.charge_micros} micro-USD above the hold was refused"
            await store.to_reconciling(hold_id, usage, note, close.now)
            observer.hold_reconciling(hold_id, usage.request_id if usage else "", note)
            return
        except Exception as exc:
            observer.backend_error("database", close.action, exc)
            raise
        observer.ledger_timed(close.action, time.perf_counter() - t)

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> int:
        """Reconcile orphaned holds and start the lease heartbeat; returns the orphans found."""
        await self._renew()
        # nothing runs yet: this instance's own open holds are from a previous life
        n = await self.store.reconcile_orphans(
            self.owner, all_others=self.store.single_node, include_own=True
        )
        if n:
            log.warning(
                "%d holds left open by a previous run are now 'reconciling' (see GET /admin/holds)", n
            )
        self._heartbeat = asyncio.create_task(self._beat())
        return n

    async def _renew(self) -> None:
        """Renew this instance's lease (on the database's clock) and measure the offset
        of this process's clock from the database's."""
        sent = self.clock.local()
        database_now = await self.store.heartbeat(self.owner, self.lease_s)
        if not self.store.single_node:  # SQLite's clock is this process's: no offset
            self.clock.observe(database_now, sent, self.clock.local())

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self._renew()
                if not self.store.single_node:
                    await self.store.reconcile_orphans(self.owner, all_others=False)
            except StoreUnavailable as exc:  # the next beat tries again; no trace for a known state
                self.observer.backend_error("database", "heartbeat", exc)
                log.warning("lease heartbeat failed: %s", exc)
            except Exception as exc:
                self.observer.backend_error("database", "heartbeat", exc)
                log.exception("lease heartbeat failed")

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None


def usage_document(closing: Closing, s: Settlement) -> dict[str, Any]:
    """The usage record as GET /v1/usage/{request_id} returns it."""
    return {
        "id": closing.request_id,
        "object": "bourse.usage",
        "created": int(closing.created_at),
        "model": closing.product,
        "endpoint": closing.endpoint,
        "outcome": s.outcome,
        "usage": s.usage,
        "receipt": s.receipt,
        "key_id": closing.key_id,
        **({"correlation_id": closing.correlation_id} if closing.correlation_id is not None else {}),
    }
