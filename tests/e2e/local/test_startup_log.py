"""``bourse serve`` on the built-in config loads the local model without burying its
start-up messages: llama.cpp's ~150 load lines (metadata, progress, notes about the
file) stay at DEBUG, so the line naming the demo key's file (stderr is a log file,
not a terminal: the key itself is only in that 0600 file) is among a handful of lines,
none a llama.cpp WARNING."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from tests.support.processes import serve_process

DEMO_KEY = re.compile(r"its API key is in the file (\S+) \(mode 600\)")


def _ready_with_key(url: str, log: Path) -> bool:
    ready: bool = httpx.get(url + "/readyz", timeout=5).json()["products"]["gemma-3-270m"]
    return ready and DEMO_KEY.search(log.read_text()) is not None


def test_the_model_load_logs_nothing_at_warning_and_the_demo_key_stands_out(tmp_path: Path) -> None:
    # no --config: the built-in one, whose first start makes the demo account
    with serve_process(tmp_path, "serve", None, tmp_path / "data", "bk_admin_startup") as (url, _proc):
        log = sorted(tmp_path.glob("serve-*.log"))[-1]  # the attempt that started
        deadline = time.monotonic() + 120
        while not _ready_with_key(url, log):
            assert time.monotonic() < deadline, f"no model or no demo key: {log.read_text()}"
            time.sleep(0.1)
        text = log.read_text()
        lines = text.splitlines()
        match = DEMO_KEY.search(text)
        assert match is not None, text
        assert Path(match.group(1)).read_text().startswith("bk_"), match.group(1)
    llama = [line for line in lines if "bourse.llamacpp" in line]
    assert not [line for line in llama if " WARNING " in line or " ERROR " in line], "\n".join(llama)
    assert any("gemma-3-270m: ready in" in line for line in llama)
    assert len(lines) <= 12, "\n".join(lines)
