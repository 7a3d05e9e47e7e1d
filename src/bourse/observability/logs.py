"""The process's log lines: their format (``[server] log_format``), one handler on
stderr, and the two timestamp shapes every line uses.

- ``text``: ``2025-05-01 12:00:00,123 INFO bourse.access: key=value …`` (the
  standard library's default shape, local time);
- ``json``: one object per line, ``{"ts": "2025-05-01T12:00:00.123Z", "level":
  "INFO", "logger": "bourse.access", "msg": …, …fields}`` (UTC). A record's
  structured fields (``extra={"fields": {...}}``) become keys of their own; a
  traceback is one string under ``exc``.

uvicorn is told not to configure logging (``log_config=None``): its records reach
this handler too, so every line of the process has one shape.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

import orjson

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


_MILLIS = tuple(f",{ms:03d}" for ms in range(1000))
"""``,000`` to ``,999``: a line's milliseconds without a format call."""


class Clock:
    """Timestamps for log lines, the formatted second cached (lines come in bursts)."""

    __slots__ = ("_local", "_local_s", "_utc", "_utc_s")

    def __init__(self) -> None:
        self._local_s = self._utc_s = -1
        self._local = self._utc = ""

    def local(self, t: float) -> str:
        """``2025-05-01 12:00:00,123`` (local time, as ``logging`` writes it)."""
        s = int(t)
        if s != self._local_s:
            self._local_s, self._local = s, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s))
        return self._local + _MILLIS[int((t - s) * 1000)]

    def utc(self, t: float) -> str:
        """``2025-05-01T12:00:00.123Z``."""
        s = int(t)
        if s != self._utc_s:
            self._utc_s, self._utc = s, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(s))
        return "%s.%03dZ" % (self._utc, int((t - s) * 1000))  # noqa: UP031


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def __init__(self) -> None:
        super().__init__()
        self._clock = Clock()

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": self._clock.utc(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for k, v in fields.items():
                doc.setdefault(k, v)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exc"] = record.exc_text
        return orjson.dumps(doc, default=str).decode()


def configure_logging(level: str, fmt: str, stream: TextIO | None = None) -> logging.Handler:
    """One handler on ``stream`` (stderr) at the root, in ``fmt`` (``text`` or ``json``)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
