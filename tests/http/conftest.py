"""One gateway in process for the HTTP tests: the real container and app (the ``sim``
engine, a SQLite ledger in a temporary folder) behind ``httpx.ASGITransport``.

It is built once for the package (one event loop for all its tests: ``anyio_backend``
is package-scoped here), with the products of :mod:`tests.http.gateway`. Tests that
touch money use their own account.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.http.gateway import config
from tests.support.asgi import InProcessGateway, in_process_gateway


@pytest.fixture(scope="package")
def anyio_backend() -> str:
    """The HTTP tests share one gateway, hence one event loop for the package."""
    return "asyncio"


@pytest.fixture(scope="package")
async def gw(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[InProcessGateway]:
    """The gateway with one product per preset (and ``knobs``, ``flaky``, ``single``), in process."""
    async with in_process_gateway(config(), tmp_path_factory.mktemp("gateway")) as g:
        yield g
