"""What a run yields to its consumer (:data:`RunEvent`), and how a drain hands one back.

Between the engine's own chunks, a run says that its order rests in the book
(:class:`Queued`), that a failed attempt went back to it (:class:`Requeued`), and at
its end, once, how it was settled (:class:`Finished`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from bourse.domain.charging import RecordedOutcome
from bourse.domain.errors import GatewayError
from bourse.domain.values import immutable
from bourse.ports.engine import ChunkEvent
from bourse.services.billing import Closing

log = logging.getLogger("bourse.completion")


@immutable
class Queued:
    """The order rests in the book at ``bid``."""

    bid: float


@immutable
class Requeued:
    """An attempt on ``deployment`` failed before any output: the order is back in the book."""

    deployment: str


@immutable
class Finished:
    """The end of a run, settled: the error (None when completed), usage and receipt."""

    outcome: RecordedOutcome
    error: GatewayError | None
    usage: dict[str, Any]
    receipt: dict[str, Any]
    text_tokens: int = 0
    """Completion tokens the gateway relayed (its own count)."""
    cost_micros: int = 0


RunEvent = ChunkEvent | Queued | Requeued | Finished
SettledHook = Callable[[Closing, Finished], None]
"""Called once per run after its settlement (the usage record is written); must not block."""


class HandedBack(Exception):
    """A detached job's run stopped by a draining gateway, neither finished nor settled:
    its slot is back; its hold is the consumer's to give back
    (:meth:`CompletionService.give_back`)."""


async def resolving(settling: Coroutine[Any, Any, Finished], out: asyncio.Future[Finished]) -> Finished:
    """``settling`` (a run's settlement, run as a task of its own: a consumer cancelled
    meanwhile leaves it running), its outcome also given to ``out``, which the run's
    consumer waits on (unless ``out`` is done: that waiter was cancelled). A plain future,
    not ``asyncio.shield`` of the task: its outer future and two callbacks cost ~4 µs a
    request."""
    try:
        fin = await settling
    except BaseException as exc:
        if isinstance(exc, asyncio.CancelledError):
            if not out.done():
                out.cancel()
            raise
        if out.done():  # its consumer was cancelled: nobody else hears of it
            log.error("a run's settlement failed after its consumer left", exc_info=exc)
        else:
            out.set_exception(exc)
        task = asyncio.current_task()
        if task is not None:  # reported once (above, or by the consumer), not again by asyncio
            task.add_done_callback(_retrieved)
        raise
    if not out.done():
        out.set_result(fin)
    return fin


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Mark a settlement task's error as seen (:func:`resolving` reported it)."""
    if not task.cancelled():
        task.exception()
