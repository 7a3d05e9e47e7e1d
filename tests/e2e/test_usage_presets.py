"""The usage CSV under every preset, through the served gateway (issue 36).

A preset names its receipt's fields (``hips``: the quote is ``quote``, not
``quote_micros``); the CSV's columns are the usage record's fields whatever the
preset. Before the fix the quote column read ``receipt.quote_micros`` only, and was
empty for every ``hips`` product."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from bourse.domain.policy import PRESETS
from tests.support.bodies import USER
from tests.support.config import Dep, Product, config_toml
from tests.support.gateway import Gateway, running_gateway
from tests.support.usage_rows import assert_row_is_record, parse_csv

PRODUCTS = [Product(name, [Dep(f"{name}-a", floor=1.0)], {"policy": name}) for name in PRESETS]


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    with running_gateway(config_toml(PRODUCTS)) as g:
        yield g


def test_every_presets_usage_csv_row_has_its_quote(gw: Gateway) -> None:
    quotes: dict[str, int] = {}
    for name, policy in PRESETS.items():
        r = httpx.post(
            gw.v1 + "/chat/completions",
            json={"model": name, "messages": USER, "max_tokens": 4},
            headers=gw.headers,
            timeout=30,
        )
        assert r.status_code == 200, r.text
        quotes[r.headers["x-request-id"]] = int(r.headers[f"{policy.header_prefix}quote-micros"])
    r = httpx.get(gw.v1 + "/usage", params={"format": "csv", "limit": "100"}, headers=gw.headers, timeout=30)
    assert r.status_code == 200, r.text
    rows = {row["request_id"]: row for row in parse_csv(r.text)}
    got = {rid: rows[rid]["quote_micros"] for rid in quotes}
    assert got == {rid: str(q) for rid, q in quotes.items()}
    for rid, name in zip(quotes, PRESETS, strict=True):
        record = httpx.get(gw.v1 + f"/usage/{rid}", headers=gw.headers, timeout=30).json()
        assert_row_is_record(rows[rid], record, gw.account)
        # every column is filled, but those the record has no field for: the estimate
        # flag (the engine counted), the operator's close (no hold went to reconciling),
        # ttft_ms where the preset's receipt has none, and deadline_s (a fixed order)
        empty = {column for column, cell in rows[rid].items() if cell == ""}
        expected = {"usage_estimated", "reconciled", "reconciled_at", "deadline_s"}
        expected |= set() if PRESETS[name].receipt_ttft else {"ttft_ms"}
        assert empty == expected, (name, empty)
