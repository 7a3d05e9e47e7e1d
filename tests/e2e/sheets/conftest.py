"""The sheet tests' gateway: one per module and engine kind (``support.sheet_env``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.sheets.support import sheet_env
from tests.support.env import ENGINE_KINDS, Env


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    with sheet_env(request.param) as e:
        yield e
