"""Debian's Chromium, headless, for the browser tests (driven by Playwright, which
never downloads a browser of its own here).

- :func:`require_chromium`: the browser's path; the test is skipped when Chromium or
  Playwright is missing (``.ci/run`` and ``scripts/test`` install Chromium with
  apt-get), a failure under ``BOURSE_REQUIRE_SERVICES=1``.
- :func:`open_browser`: one browser with a fresh profile folder and no network beyond
  loopback: every request the pages make passes :class:`Watch`, which lets through
  127.0.0.1 only and records anything else (the tests assert it stays empty), and
  records console errors and uncaught page errors.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.support.databases import MISSING_SERVICE_MARK, services_required

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LOOPBACK = "127.0.0.1"


def chromium_path() -> str | None:
    explicit = os.environ.get("BOURSE_TEST_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def require_chromium() -> str:
    """Chromium's path; skips (or fails under BOURSE_REQUIRE_SERVICES=1) without it."""
    path = chromium_path()
    problem = None
    if path is None:
        problem = "Chromium is not installed (apt-get install chromium chromium-driver; .ci/run does it)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            problem = "the playwright package is missing (pip install -e '.[test]')"
    if problem is not None:
        if services_required():
            pytest.fail(f"{problem}; BOURSE_REQUIRE_SERVICES=1 makes this a failure", pytrace=False)
        pytest.skip(f"{problem}; {MISSING_SERVICE_MARK}")
    assert path is not None
    return path


@dataclass
class Watch:
    """What the pages did that a test must check: console errors, page errors, and
    requests for anything but loopback (refused)."""

    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)

    def reset(self) -> None:
        for seen in (self.console_errors, self.page_errors, self.outside, self.seen):
            seen.clear()

    def route(self, route: Any) -> None:
        url = route.request.url
        self.seen.append(url)
        if urlsplit(url).hostname == LOOPBACK:
            route.continue_()
        else:
            self.outside.append(url)
            route.abort()

    def attach(self, page: Any) -> Any:
        page.on("console", lambda m: self.console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))
        return page

    def assert_clean(self) -> None:
        assert self.outside == [], f"requests left {LOOPBACK}: {self.outside}"
        assert self.console_errors == [], self.console_errors
        assert self.page_errors == [], self.page_errors
        assert self.seen, "no request went through the guard"


@contextmanager
def open_browser(profile: Path, chromium: str) -> Iterator[tuple[Any, Watch]]:
    """(a Playwright browser context with a fresh profile in ``profile``, its Watch)."""
    from playwright.sync_api import sync_playwright

    watch = Watch()
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=chromium, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900}, accept_downloads=True, service_workers="block",
        )  # fmt: skip
        try:
            context.route("**/*", watch.route)
            yield context, watch
        finally:
            context.close()


def artifacts_dir() -> Path:
    """Where the browser tests save screenshots: ``$BOURSE_ARTIFACTS`` or ``tmp/artifacts``."""
    root = Path(
        os.environ.get("BOURSE_ARTIFACTS") or Path(__file__).resolve().parents[2] / "tmp" / "artifacts"
    )
    out = root / "dashboard"
    out.mkdir(parents=True, exist_ok=True)
    return out
