"""What the sheet tests share: one gateway with a product per preset, the sheets'
samples run as they are, and a product's only slot held so an order times out in band.

Products (each on its own deployment, for both engine kinds):

- ``def`` (policy ``default``), for contrast;
- ``hips`` (000); ``placeholder-large`` (001 openfill, the id its sample asks for);
  ``openai/gpt-oss-20b`` (002 aigrid, the id its sample asks for); ``gopuram`` (004);
- ``<preset>-1``: the same policies on one slot, to time an order out in the book.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.e2e.money.support import read_until
from tests.support.config import Dep, Product
from tests.support.env import Env, start_env
from tests.support.sse import SSEStream, open_sse

SAMPLES = Path(__file__).parent / "samples"
OPENFILL = "placeholder-large"
AIGRID = "openai/gpt-oss-20b"
PRESET_PRODUCTS = {
    "default": "def",
    "hips": "hips",
    "openfill": OPENFILL,
    "aigrid": AIGRID,
    "gopuram": "gopuram",
}
"""preset -> the product that runs it"""
ONE_SLOT = {preset: f"{preset}-1" for preset in PRESET_PRODUCTS}
"""preset -> its one-slot product"""
FLOOR = 0.05
"""USD per 1M tokens: under the openfill sample's bid (0.10), and every answer costs something."""
SLOW = {"tokens_per_s": 20, "output_tokens": 400}
"""A stream that holds its slot for 20 s unless the client leaves (its disconnect frees it)."""


def sheet_products() -> list[Product]:
    products = [
        Product(name, [Dep(f"{preset}-a", floor=FLOOR)], {"policy": preset})
        for preset, name in PRESET_PRODUCTS.items()
    ]
    products += [
        Product(name, [Dep(f"{preset}-one", slots=1)], {"policy": preset, "on_disconnect": "cancel"})
        for preset, name in ONE_SLOT.items()
    ]
    return products


@contextmanager
def sheet_env(kind: str) -> Iterator[Env]:
    with start_env(kind, sheet_products(), server={"quiet_interval_s": 0.2}) as env:
        yield env


def run_sample(name: str, env: Env, namespace: dict[str, Any] | None = None) -> str:
    """Run the sample ``name`` (``samples/<name>.py.txt``) as it is, against ``env``: the
    sheet's public base URL becomes the gateway's and its key variable holds the test key.
    What the sample prints is returned."""
    source = (SAMPLES / f"{name}.py.txt").read_text()
    source = source.replace("https://api.openfill.ai/v1", env.gateway.v1)
    out = io.StringIO()
    saved = os.environ.get("OPENFILL_API_KEY")
    os.environ["OPENFILL_API_KEY"] = env.gateway.api_key
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, f"<sample {name}>", "exec"), dict(namespace or {}))
    finally:
        if saved is None:
            del os.environ["OPENFILL_API_KEY"]
        else:
            os.environ["OPENFILL_API_KEY"] = saved
    return out.getvalue()


def raw_events(raw: bytes) -> list[bytes]:
    """The stream's events read by hand from its bytes (not the project's parser): each
    event's text up to its blank line, comments left out."""
    events = [e for e in raw.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
    return [e for e in events if not e.startswith(b":")]


def raw_data(raw: bytes) -> list[Any]:
    """The ``data:`` payload of each event (one line each), JSON-decoded; ``[DONE]`` as the string."""
    out: list[Any] = []
    for e in raw_events(raw):
        assert e.startswith(b"data: ") and b"\n" not in e, e
        payload = e[len(b"data: ") :]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


@contextmanager
def slot_held(env: Env, product: str) -> Iterator[SSEStream]:
    """``product``'s only slot busy with a slow stream (leaving the ``with`` frees it)."""
    with open_sse(env, {"model": product, "sim": SLOW}) as s:
        read_until(s, data_chunks=1)
        yield s
