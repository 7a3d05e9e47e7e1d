"""One exchange in process per test module (its event loop lives as long as the module)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.unit.services.exchange import PRESETS, Exchange, product, running


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """Module-wide, so that the exchange fixture and the tests share one event loop."""
    return "asyncio"


PRODUCTS = {
    **{name: product(name) for name in PRESETS},
    "no-charge-on-disconnect": product(charge_on_disconnect="none"),
    "two-requeues": product(max_requeues=2),
}


@pytest.fixture(scope="module")
async def exchange(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Exchange]:
    async with running(tmp_path_factory.mktemp("exchange"), PRODUCTS) as ex:
        yield ex
