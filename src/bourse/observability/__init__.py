"""Observability: the adapter behind the observer port (:mod:`bourse.ports.observer`).

- :mod:`~bourse.observability.metrics`: counters and histograms, the live-state
  gauges read at scrape time, the Prometheus exposition (``GET /metrics``);
- :mod:`~bourse.observability.worker_metrics`: under ``serve --workers``, every
  worker's series in each scrape;
- :mod:`~bourse.observability.access_log`: one line per finished request;
- :mod:`~bourse.observability.logs`: the log format (``text`` or ``json``);
- :mod:`~bourse.observability.tracing`: OpenTelemetry spans over OTLP (optional);
- :mod:`~bourse.observability.observer`: the observer that ties them together.

Only the composition root (:mod:`bourse.container`) imports this package; the CLI
imports :func:`~bourse.observability.logs.configure_logging`.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client.metrics_core import Metric

from bourse.observability.access_log import AccessLog
from bourse.observability.metrics import BookSource, GaugeStore, Instruments, LiveState, Metrics
from bourse.observability.observer import Observability
from bourse.observability.worker_metrics import WorkerPeers
from bourse.settings import ServerConfig
from bourse.workers import WorkerLink

__all__ = ["Observability", "WorkerPeers", "build_observer"]


def build_observer(
    server: ServerConfig,
    *,
    books: Mapping[str, BookSource],
    store: GaugeStore | None,
    instance: str,
    database: str,
    link: WorkerLink | None = None,
) -> Observability:
    """The observer ``[server]`` asks for: metrics, access log and traces each on or off;
    ``link``: this worker's channel to the others under ``serve --workers``."""
    obs = Observability(database=database)
    if server.metrics:
        live = LiveState(books, store, obs.backend_error)
        metrics = obs.metrics = Metrics(Instruments(), live, worker=None if link is None else link.number)
        obs.instruments = metrics.instruments
        if link is not None:

            def own() -> list[Metric]:  # as a scrape of its own: the finished runs counted first
                obs.drain()
                return metrics.own()

            metrics.peers = WorkerPeers(link.listener, link.peers, own, obs.backend_error)
    if server.access_log:
        obs.access = AccessLog(json=server.log_format == "json")
    if server.tracing:
        from bourse.observability.tracing import otlp_tracer

        obs.tracer = otlp_tracer(server.otlp_endpoint, service="bourse", instance=instance)
    return obs
