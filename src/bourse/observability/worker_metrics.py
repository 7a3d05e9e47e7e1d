"""``serve --workers N``: every worker's series in the scrape of any one of them.

The kernel hands a scrape's connection to whichever worker it picks, and each worker
counts only what it served; a scrape answered with one worker's counters makes every
``rate()`` over them meaningless. So each worker labels its own series (its counters,
histograms and process metrics) ``worker="n"``, answers its peers on a Unix socket of
its own (the gateway made them before forking, in a private folder), and, when it is
scraped, asks every peer for its series at that moment and writes them all: whichever
worker answers, the scrape holds every worker's series, each counted once.

Nothing of this runs per request: a worker's series are read only when a peer asks
(after it counts its batch of finished runs, as a scrape of its own would). A peer
that does not answer within :data:`PEER_TIMEOUT_S` is left out of that scrape and
counted in ``bourse_backend_errors_total{backend="worker", op="scrape"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

PEER_TIMEOUT_S = 2.0
ErrorHook = Callable[[str, str, BaseException], None]


def labelled(families: Iterable[Metric], name: str, value: str) -> Iterator[Metric]:
    """``families`` with the label ``name="value"`` on every sample."""
    for fam in families:
        out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        out.samples = [s._replace(labels={**s.labels, name: value}) for s in fam.samples]
        yield out


def merged(groups: Iterable[Iterable[Metric]]) -> list[Metric]:
    """One family per name holding the samples of every group's family of that name
    (the text format allows each family once)."""
    out: dict[str, Metric] = {}
    for fams in groups:
        for fam in fams:
            have = out.get(fam.name)
            if have is None:
                have = out[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            have.samples.extend(fam.samples)
    return list(out.values())


def encode(families: Iterable[Metric]) -> bytes:
    return json.dumps(
        [
            [f.name, f.documentation, f.type, f.unit, [[s.name, s.labels, s.value] for s in f.samples]]
            for f in families
        ]
    ).encode()


def decode(data: bytes) -> list[Metric]:
    families = []
    raw: list[Any] = json.loads(data)
    for name, doc, typ, unit, samples in raw:
        fam = Metric(str(name), str(doc), str(typ), str(unit))
        fam.samples = [Sample(str(n), {str(k): str(v) for k, v in labels.items()}, float(value))
                       for n, labels, value in samples]  # fmt: skip
        families.append(fam)
    return families


class WorkerPeers:
    """This worker's side of the exchange of series: it answers its peers with
    ``local()`` and asks them for theirs (:meth:`gather`)."""

    def __init__(
        self,
        listener: socket.socket,
        peers: Mapping[int, str],
        local: Callable[[], list[Metric]],
        on_error: ErrorHook,
    ) -> None:
        self.listener = listener
        self.peers = dict(peers)
        """The other workers' numbers and socket paths."""
        self.local = local
        self.on_error = on_error
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._answer, sock=self.listener)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readline()
            writer.write(encode(self.local()))
            await writer.drain()
        except (OSError, ValueError):
            pass  # the asking worker gave up or left
        finally:
            writer.close()

    async def gather(self) -> list[list[Metric]]:
        """Every peer's series now (a peer that does not answer: left out)."""
        answers = await asyncio.gather(*(self._ask(path) for path in self.peers.values()))
        return [a for a in answers if a is not None]

    async def _ask(self, path: str) -> list[Metric] | None:
        try:
            async with asyncio.timeout(PEER_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(path)
                try:
                    writer.write(b"scrape\n")
                    await writer.drain()
                    return decode(await reader.read())
                finally:
                    writer.close()
        except (OSError, TimeoutError, ValueError, TypeError) as exc:
            self.on_error("worker", "scrape", exc)
            return None
