"""How the openai engine's aiohttp connections read: aiohttp's response protocol,
resuming a read only when it is paused.

aiohttp 3.14's ``StreamReader`` asks its protocol to resume reading each time it hands
out one buffered chunk (``_read_nowait_chunk``), paused or not. Resuming feeds the
parser an empty read (``data_received(b"")``) and restarts the transport: five Python
calls for every HTTP chunk of an upstream's stream, about 7 % of the bytecode the
event loop runs for a 16-chunk stream (``python -m bench.calls --opcodes --sse``). A read
that is not paused has nothing to resume: the parser holds input back only after
``pause_reading``, which sets the protocol's ``_reading_paused`` (or, for a buffer it
cannot drain, ``_buffer_paused``), and both stay set until the resume this lets through.

This leans on aiohttp's internals (the connector's protocol factory and the two flags),
so pyproject.toml caps aiohttp below the next minor release, and
``tests/unit/engines/test_upstream_reads.py`` reads paused, many-chunk and compressed
streams through it. Where a version lacks either, :func:`lean` leaves the connector as
it is.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

from aiohttp import TCPConnector
from aiohttp.base_protocol import BaseProtocol
from aiohttp.client_proto import ResponseHandler


class _Fifo(list[Any]):
    """The protocol's queue of response heads (``append``, ``popleft``, ``len``, truth)
    as a list: it holds one head at most for a while, and an empty deque is 760 bytes
    to a list's 56, for every open upstream connection (an open stream: bench (e))."""

    __slots__ = ()

    def popleft(self) -> Any:
        return self.pop(0)


class ResumeWhenPaused(ResponseHandler):
    """aiohttp's response protocol; a resume of a read that is not paused does nothing;
    its queue of response heads is a list (:class:`_Fifo`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        buffer = getattr(self, "_buffer", None)
        if type(buffer) is collections.deque and not buffer:
            self._buffer = _Fifo()  # type: ignore[assignment]

    def resume_reading(self, resume_parser: bool = True) -> None:
        if self._reading_paused or self._buffer_paused:
            super().resume_reading(resume_parser)


def lean(connector: TCPConnector) -> TCPConnector:
    """``connector``, making its connections with :class:`ResumeWhenPaused` (unchanged
    if this aiohttp makes them otherwise)."""
    factory = getattr(connector, "_factory", None)
    loop = getattr(connector, "_loop", None)
    if (
        isinstance(factory, functools.partial)
        and factory.func is ResponseHandler
        and loop is not None
        and hasattr(BaseProtocol, "_reading_paused")
        and hasattr(BaseProtocol, "_buffer_paused")
    ):
        connector._factory = functools.partial(ResumeWhenPaused, loop=loop)  # type: ignore[assignment]
    return connector
