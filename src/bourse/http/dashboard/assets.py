"""The dashboard's files, served from inside the package: the page, its script and
style, and the charting library (``static/vendor/uplot``, copied from npm by
``scripts/vendor-dashboard``).

Files are read once when the app is built and served from memory with an ETag
(``cache-control: no-cache``: the browser revalidates, so an upgrade shows at once).
Only files under ``static/`` with a known type are served; nothing else on disk is
reachable.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from importlib.resources.abc import Traversable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bourse.domain.errors import GatewayError
from bourse.domain.values import immutable
from bourse.http.dashboard.guard import secure

TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
}


@immutable
class Asset:
    body: bytes
    media_type: str
    etag: str


def _walk(folder: Traversable, prefix: str, out: dict[str, Asset]) -> None:
    for entry in folder.iterdir():
        name = prefix + entry.name
        if entry.is_dir():
            _walk(entry, name + "/", out)
            continue
        media = next((t for ext, t in TYPES.items() if entry.name.endswith(ext)), None)
        if media is None:
            continue
        body = entry.read_bytes()
        out[name] = Asset(body, media, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')


def load_assets() -> dict[str, Asset]:
    """Every servable file under ``static/``, by its path there."""
    out: dict[str, Asset] = {}
    _walk(resources.files("bourse.http.dashboard") / "static", "", out)
    return out


def _serve(request: Request, asset: Asset) -> Response:
    headers = {"etag": asset.etag, "cache-control": "no-cache"}
    if request.headers.get("if-none-match") == asset.etag:
        return secure(Response(status_code=304, headers=headers))
    return secure(Response(asset.body, media_type=asset.media_type, headers=headers))


def routes() -> list[Route]:
    assets = load_assets()
    index = assets["index.html"]

    async def page(request: Request) -> Response:
        return _serve(request, index)

    async def static(request: Request) -> Response:
        asset = assets.get(request.path_params["path"])
        if asset is None:
            raise GatewayError(404, "not_found", f"No dashboard file '{request.path_params['path'][:200]}'.")
        return _serve(request, asset)

    return [
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/", page, methods=["GET"]),
        Route("/dashboard/static/{path:path}", static, methods=["GET"]),
    ]
