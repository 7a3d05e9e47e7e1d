"""bourse: an OpenAI-compatible inference exchange.

Architecture (dependency direction ``domain <- ports <- services <- http``):

- ``domain``   pure, synchronous rules: errors, policies, the order book, circuit breaker
- ``ports``    ``typing.Protocol`` interfaces the services depend on (engines, stores)
- ``wire``     the OpenAI protocol: request models, chunk shapes, SSE framing
- ``services`` use cases: admission to the book, running and relaying a completion
- ``engines``  adapters behind the engine port (sim, OpenAI-compatible HTTP)
- ``http``     the ASGI edge
- ``container`` the composition root, the only importer of adapters
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
