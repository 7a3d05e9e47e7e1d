"""Every fault test ends with the ledger's ten invariants (:func:`tests.faults.ledger.check_ledger`)
checked on each gateway database it used: as each gateway stops, and after the test on
those still running (a module's shared gateway)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.ledger import check_ledger
from tests.support.ledgers import WATCH, Ledger


def _check(ledger: Ledger) -> None:
    check_ledger(ledger.data_dir, ledger.dsn)


@pytest.fixture(autouse=True)
def ledger_invariants() -> Iterator[None]:
    with WATCH.checking(_check):
        yield
        for ledger in list(WATCH.live):
            if ledger.exists:
                _check(ledger)
