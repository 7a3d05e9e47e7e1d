"""How every ``bourse`` command fails: :class:`CliError` for a failure it expects,
:func:`failure_line` for the one line an operator reads, :data:`EXIT_FAILURE` for the
exit status. A module of its own so that the command modules (``cli``, ``jobs_cli``)
import it and not each other: ``cli`` builds the parser from ``jobs_cli``, which raised
``cli``'s :class:`CliError`, an import cycle."""

from __future__ import annotations

EXIT_FAILURE = 2
"""The exit status of every CLI failure (bad arguments, config, file, server)."""


class CliError(Exception):
    """A failure the command reports as one line (its message) and exit status 2."""


def failure_line(exc: Exception) -> str:
    """What went wrong, in one line, for an operator (no traceback)."""
    import httpx

    if isinstance(exc, httpx.RequestError):
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"cannot reach {exc.request.url}: {reason}"
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"cannot use {exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, CliError):
        return str(exc)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
