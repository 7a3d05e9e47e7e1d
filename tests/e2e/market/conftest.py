"""One served gateway (sim engine) for the market tests; each test has its own
product, so the tests do not share a book."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import Dep, Env, Product, start_env

QUIET_S = 0.1

PRODUCTS = [
    # 1. six bids behind one busy slot
    Product("six", [Dep("six-a", slots=1, floor=0.13)]),
    # 2. an order below the level
    Product("lvl", [Dep("lvl-a", slots=1, floor=0.1)]),
    # 3. the views
    Product("view", [Dep("view-a", slots=1, floor=0.25)]),
    # 4. several deployments
    Product(
        "multi",
        [
            Dep("m-dear", slots=1, floor=2.0),
            Dep("m-mid-a", slots=2, floor=0.5),
            Dep("m-cheap", slots=1, floor=0.1),
            Dep("m-mid-b", slots=2, floor=0.5),
        ],
    ),
    # 5. disconnects and timeouts while queued
    Product("dc", [Dep("dc-a", slots=1, floor=0.2)]),
    # 6. rejected bids and a full book
    Product("bad", [Dep("bad-a", slots=4, floor=0.1)]),
    Product("full", [Dep("full-a", slots=1, floor=0.1)], knobs={"max_waiting": 2}),
    # 7. a requeued order keeps its arrival
    Product("rq", [Dep("rq-a", slots=1, floor=0.1)]),
]


@pytest.fixture(scope="package")
def env() -> Iterator[Env]:
    with start_env("sim", PRODUCTS, server={"quiet_interval_s": QUIET_S}) as e:
        yield e
