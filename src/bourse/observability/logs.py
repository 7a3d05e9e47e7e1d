"""The process's log lines: their format (``[server] log_format``), one handler on
stderr, the two timestamp shapes every line uses, and :func:`say`, the way
``bourse serve`` writes its own lines (what it serves, the keys it made, why it cannot
start).

- ``text``: ``2025-05-01 12:00:00,123 INFO bourse.access: key=value …`` (the
  standard library's default shape, local time); a line of :func:`say` keeps the
  command's ``bourse: …`` shape;
- ``json``: one object per line, ``{"ts": "2025-05-01T12:00:00.123Z", "level":
  "INFO", "logger": "bourse.access", "msg": …, …fields}`` (UTC). A record's
  structured fields (``extra={"fields": {...}}``) become keys of their own; a
  traceback is one string under ``exc``.

uvicorn is told not to configure logging (``log_config=None``), Python's warnings and
the tracebacks of threads that die are logged too: their records reach this handler,
so every line the process writes on stderr has one shape (with ``json``, every line
is an object).
"""

from __future__ import annotations

import logging
import sys
import threading
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


class TextFormatter(logging.Formatter):
    """:data:`TEXT_FORMAT`; a line of :func:`say` as ``bourse: …``, as the command has
    always written it (operators and scripts read those)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "said", False):
            return f"bourse: {record.getMessage()}"
        return super().format(record)


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
    """One handler on ``stream`` (stderr) at the root, in ``fmt`` (``text`` or ``json``);
    Python's warnings and a dying thread's traceback become records on it."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # both would write to stderr past the handler: a plain line in a JSON log
    logging.captureWarnings(True)
    threading.excepthook = _log_thread_death
    return handler


def _log_thread_death(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return  # as the default hook: a thread may end itself so
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("bourse").error(
        "thread %s died: %s", name, args.exc_type.__name__, exc_info=args.exc_value
    )


def say(message: str, level: int = logging.INFO, **fields: Any) -> None:
    """One of ``bourse serve``'s own lines, written whatever ``log_level`` is: ``bourse:
    message`` with ``text``, an object (``fields`` among its keys) with ``json``. Before
    :func:`configure_logging` (a config that cannot be read), the plain line."""
    log = logging.getLogger("bourse")
    if not log.hasHandlers():
        print(f"bourse: {message}", file=sys.stderr, flush=True)
        return
    record = log.makeRecord(
        log.name, level, __file__, 0, message, (), None, extra={"said": True, "fields": fields}
    )
    log.handle(record)  # to the handlers without the level check: log_level does not silence it
