"""End-to-end fixtures: a served gateway on a real port, driven over HTTP.

The helpers live in :mod:`tests.support`: :mod:`~tests.support.env` (a served gateway
on the ``sim`` or ``openai`` engine kind), :mod:`~tests.support.sse` (the raw SSE
reader), :mod:`~tests.support.errors` (the error envelope) and
:mod:`~tests.support.bodies` (request bodies).
"""

from __future__ import annotations

import pytest

from tests.support.env import ENGINE_KINDS


@pytest.fixture(params=ENGINE_KINDS)
def engine_kind(request: pytest.FixtureRequest) -> str:
    """Each engine kind in turn: ``sim`` (in process) and ``openai`` (sim upstreams)."""
    kind: str = request.param
    return kind
