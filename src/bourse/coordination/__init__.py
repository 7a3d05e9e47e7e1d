"""Adapters of the coordination ports: the order book and the rate limits, each in
process and over Redis, side by side.

- :mod:`~bourse.coordination.book_local` and :mod:`~bourse.coordination.book_redis`:
  the two adapters of :mod:`bourse.ports.book` (one gateway; several replicas
  sharing one book per product).
- :mod:`~bourse.coordination.limits_local` and :mod:`~bourse.coordination.limits_redis`:
  the two adapters of :mod:`bourse.ports.limits`.
- :mod:`~bourse.coordination.redis_hub`: this replica's link to Redis (connections,
  scripts, admission channel, heartbeat), shared by the Redis adapters.
- ``lua/``: the scripts that run inside Redis, read with :mod:`importlib.resources`.

Only the composition root (:mod:`bourse.container`) imports this package; the same
contract tests (``tests/contract``) run over each pair.
"""
