"""One served gateway (sim engine) for the market tests; each test has its own
product, so the tests do not share a book."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.config import Dep, Product
from tests.support.databases import require_redis
from tests.support.env import Env, start_env

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
    # 8. deadline orders (test_deadline.py): raised and admitted, 408, a job, a response
    Product("dl", [Dep("dl-a", slots=1, floor=0.1)]),
    Product("dlx", [Dep("dlx-a", slots=1, floor=0.1)]),
    Product("dljob", [Dep("dljob-a", slots=1, floor=0.1)]),
    Product("dlresp", [Dep("dlresp-a", slots=1, floor=0.1)]),
    # 9. the wait forecast, its score and the quotes
    Product("fcst", [Dep("fcst-a", slots=1, floor=0.2)]),
]


@pytest.fixture(scope="package", params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    """The gateway with its book in process, then with its book in Redis: every
    market test runs over both adapters of the book port."""
    cluster = None
    if request.param == "redis":
        cluster = {"redis_url": require_redis(), "key_prefix": "t" + os.urandom(6).hex()}
    with start_env("sim", PRODUCTS, server={"quiet_interval_s": QUIET_S}, cluster=cluster) as e:
        yield e
