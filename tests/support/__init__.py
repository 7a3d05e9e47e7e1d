"""Helpers shared by the test suites, one module per concern.

- :mod:`~tests.support.bodies`: request bodies (the default conversation).
- :mod:`~tests.support.config`: products and deployments described in Python, rendered as TOML.
- :mod:`~tests.support.gateway`: a gateway served on a loopback port from a config.
- :mod:`~tests.support.env`: a served gateway on the ``sim`` or ``openai`` engine kind.
- :mod:`~tests.support.asgi`: the gateway in process, through ``httpx.ASGITransport``.
- :mod:`~tests.support.sse`: the raw SSE reader (frames, their times, the whole result).
- :mod:`~tests.support.errors`: the OpenAI error envelope, checked.
- :mod:`~tests.support.waiting`: waiting on a condition instead of sleeping.
- :mod:`~tests.support.servers`: an ASGI app served from a thread.
- :mod:`~tests.support.processes`: ``bourse serve`` as a child process, a child's output lines.
- :mod:`~tests.support.databases`: PostgreSQL and Redis for tests, and stores over each adapter.
"""
