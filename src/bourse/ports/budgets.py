"""The refusals of a spend cap (:mod:`bourse.domain.periods`): a hold that would take
its API key (:class:`KeyBudgetExceeded`) or its account (:class:`AccountBudgetExceeded`)
past what the cap allows in its period. The store raises them from the hold's own
transaction, having counted nothing."""

from __future__ import annotations

from bourse.domain.periods import CapPeriod


class BudgetExceeded(Exception):
    """The hold would take a spend cap past its amount in the current period."""

    whose = "spend"

    def __init__(self, cap_micros: int, spent_micros: int, period: CapPeriod) -> None:
        super().__init__(f"{self.whose} cap {cap_micros} micro-USD per {period}, {spent_micros} taken")
        self.cap_micros = cap_micros
        self.spent_micros = spent_micros
        self.period: CapPeriod = period


class KeyBudgetExceeded(BudgetExceeded):
    """The hold would take the key past its spend cap."""

    whose = "key's spend"


class AccountBudgetExceeded(BudgetExceeded):
    """The hold would take the account past its spend cap (whichever key it came by)."""

    whose = "account's spend"
