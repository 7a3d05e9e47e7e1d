"""Observability: the adapter behind the observer port (:mod:`bourse.ports.observer`).

- :mod:`~bourse.observability.metrics`: counters and histograms, the live-state
  gauges read at scrape time, the Prometheus exposition (``GET /metrics``);
- :mod:`~bourse.observability.access_log`: one line per finished request;
- :mod:`~bourse.observability.logs`: the log format (``text`` or ``json``);
- :mod:`~bourse.observability.tracing`: OpenTelemetry spans over OTLP (optional);
- :mod:`~bourse.observability.observer`: the observer that ties them together.

Only the composition root (:mod:`bourse.container`) imports this package; the CLI
imports :func:`~bourse.observability.logs.configure_logging`.
"""

from __future__ import annotations

from collections.abc import Mapping

from bourse.observability.access_log import AccessLog
from bourse.observability.metrics import BookSource, GaugeStore, Instruments, LiveState, Metrics
from bourse.observability.observer import Observability
from bourse.settings import ServerConfig

__all__ = ["Observability", "build_observer"]


def build_observer(
    server: ServerConfig,
    *,
    books: Mapping[str, BookSource],
    store: GaugeStore | None,
    instance: str,
    database: str,
) -> Observability:
    """The observer ``[server]`` asks for: metrics, access log and traces each on or off."""
    obs = Observability(database=database)
    if server.metrics:
        live = LiveState(books, store, obs.backend_error)
        obs.metrics = Metrics(Instruments(), live)
        obs.instruments = obs.metrics.instruments
    if server.access_log:
        obs.access = AccessLog(json=server.log_format == "json")
    if server.tracing:
        from bourse.observability.tracing import otlp_tracer

        obs.tracer = otlp_tracer(server.otlp_endpoint, service="bourse", instance=instance)
    return obs
