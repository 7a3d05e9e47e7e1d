"""The sealing-key check before a replica serves (``container.sealing_problem``): a
connection that fails just after the database was reached (a container network's DNS
not answering yet) is tried again, not a refusal to start (which made compose restart
the replica; podman then killed the restarted one on stop, exit 137)."""

from __future__ import annotations

from typing import Any, cast

import psycopg
import pytest

from bourse import container as C
from bourse.storage.postgres import PostgresStore


class _Container:
    def __init__(self) -> None:
        self.store: Any = PostgresStore("postgresql://postgres@db.invalid/x")  # never opened
        self.store.secret_box = cast(Any, object())
        self.adopt_secret_key = False


def test_a_connection_failing_once_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    opens: list[int] = []

    async def open_(self: PostgresStore) -> None:
        opens.append(1)
        if len(opens) == 1:
            raise psycopg.OperationalError(
                "failed to resolve host 'postgres': Temporary failure in name resolution"
            )

    async def adopt(self: PostgresStore, now: float, take_over: bool) -> None:
        return None

    async def close(self: PostgresStore) -> None:
        return None

    monkeypatch.setattr(PostgresStore, "open", open_)
    monkeypatch.setattr(PostgresStore, "adopt_sealing_key", adopt)
    monkeypatch.setattr(PostgresStore, "close", close)
    monkeypatch.setattr(C, "SEALING_RETRY_S", 0.0)
    c: Any = _Container()
    assert C.sealing_problem(c) is None
    assert len(opens) == 2


def test_a_database_that_stays_away_is_a_refusal_after_the_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    opens: list[int] = []

    async def open_(self: PostgresStore) -> None:
        opens.append(1)
        raise psycopg.OperationalError("connection refused")

    monkeypatch.setattr(PostgresStore, "open", open_)
    monkeypatch.setattr(C, "SEALING_RETRY_S", 0.0)
    c: Any = _Container()
    problem = C.sealing_problem(c)
    assert problem is not None and problem.startswith("cannot check the webhook-secret key")
    assert len(opens) == C.SEALING_ATTEMPTS
