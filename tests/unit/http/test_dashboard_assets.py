"""The dashboard's files in the package: every file the page loads is there, the
vendored chart library is the pinned copy (its checksums and license), and no page
or script relies on inline code or HTML built from strings."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from bourse.http.dashboard.assets import load_assets

ROOT = Path(__file__).resolve().parents[3]


def test_every_file_the_page_loads_is_served() -> None:
    assets = load_assets()
    page = assets["index.html"].body.decode()
    refs = re.findall(r'(?:src|href)="/dashboard/static/([^"]+)"', page)
    assert refs and all(ref in assets for ref in refs), refs
    for name, asset in assets.items():
        if not name.endswith(".js") or name.startswith("vendor/"):
            continue
        for imported in re.findall(r'from "\./([^"]+)"', asset.body.decode()):
            assert f"js/{imported}" in assets, (name, imported)


def test_no_inline_script_style_or_html_strings() -> None:
    assets = load_assets()
    page = assets["index.html"].body.decode()
    assert "<style" not in page and " style=" not in page
    assert re.search(r"<[^>]*\son[a-z]+=", page) is None, "an inline event handler"
    assert re.findall(r"<script(?![^>]*\bsrc=)", page) == []
    for name, asset in assets.items():
        if name.endswith(".js") and not name.startswith("vendor/"):
            text = asset.body.decode()
            for sink in (
                "innerHTML",
                "outerHTML",
                "insertAdjacentHTML",
                "document.write",
                "eval(",
                "new Function",
            ):
                assert sink not in text, (name, sink)


def test_the_vendored_chart_library_is_the_pinned_copy() -> None:
    assets = load_assets()
    sums = assets["vendor/uplot/SHA256SUMS.txt"].body.decode().split("\n")
    checked = 0
    for line in filter(None, sums):
        digest, name = line.split()
        assert hashlib.sha256(assets[f"vendor/uplot/{name}"].body).hexdigest() == digest, name
        checked += 1
    assert checked == 3
    assert "MIT License" in assets["vendor/uplot/LICENSE.txt"].body.decode()
    pinned = json.loads((ROOT / "web" / "package.json").read_text())["dependencies"]["uplot"]
    lock = json.loads((ROOT / "web" / "package-lock.json").read_text())["packages"]["node_modules/uplot"]
    assert lock["version"] == pinned
    assert assets["vendor/uplot/VERSION.txt"].body.decode().startswith(f"uPlot {pinned},")
