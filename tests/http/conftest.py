"""One gateway in process for the HTTP tests: the real container and app (the ``sim``
engine, a SQLite ledger in a temporary folder) behind ``httpx.ASGITransport``.

It is built once for the package (one event loop for all its tests: ``anyio_backend``
is package-scoped here). Each preset of SPEC section 12 has its own product, each at
a floor of 1 USD per 1M tokens (one micro-USD per token), so a receipt's cost is its
token count. Tests that touch money use their own account.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.asgi import InProcessGateway, in_process_gateway
from tests.support.config import Dep, Product, config_toml

FLOOR = 1.0
"""USD per 1M tokens: one micro-USD per token."""
MAX_BODY = 4096
PRESETS = ("default", "hips", "openfill", "aigrid", "gopuram")

PRODUCTS = [
    *(Product(name, [Dep(f"{name}-a", floor=FLOOR)], {"policy": name}) for name in PRESETS),
    Product(
        "knobs",
        [Dep("knobs-a", floor=FLOOR)],
        {
            "policy": "default",
            "usage_chunk": "always",
            "done_after_error": False,
            "error_finish_reason": False,
            "reasoning_field": "reasoning",
        },
    ),
    # failures before output: the breaker never opens, so each test sees a healthy deployment
    Product("flaky", [Dep("flaky-a", floor=FLOOR, extra={"breaker_threshold": 1000})]),
    # one slot, for jobs that wait in the book
    Product("single", [Dep("single-a", slots=1, floor=FLOOR)]),
]


@pytest.fixture(scope="package")
def anyio_backend() -> str:
    """The HTTP tests share one gateway, hence one event loop for the package."""
    return "asyncio"


@pytest.fixture(scope="package")
async def gw(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[InProcessGateway]:
    """The gateway with one product per preset (and ``knobs``, ``flaky``, ``single``), in process."""
    text = config_toml(PRODUCTS, server={"max_body_bytes": MAX_BODY})
    async with in_process_gateway(text, tmp_path_factory.mktemp("gateway")) as g:
        yield g
