"""The container image's entrypoint (deploy/bourse-entrypoint), run on the host with a
stand-in ``bourse`` that prints the arguments it was given and the keys it got: the
image's defaults before the caller's options, the mounted config, the keys made once in
BOURSE_KEYS_DIR and shared by every replica, and the other commands passed through."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "deploy" / "bourse-entrypoint"
DEFAULTS = ["--host", "0.0.0.0", "--port", "8000", "--data-dir", "/var/lib/bourse"]
FAKE_BOURSE = """#!/bin/sh
echo "ARGS $*"
echo "ADMIN ${BOURSE_ADMIN_KEY:-}"
echo "SECRET ${BOURSE_SECRET_KEY:-}"
"""

pytestmark = pytest.mark.skipif(shutil.which("flock") is None, reason="needs flock (util-linux)")


def run(tmp_path: Path, *args: str, **env: str) -> dict[str, str]:
    """Run the entrypoint; its stand-in bourse's lines, by their first word."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        (bin_dir / "bourse").write_text(FAKE_BOURSE)
        (bin_dir / "bourse").chmod(0o755)
        (bin_dir / "python3").symlink_to(sys.executable)
    environ = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT / "src"),
        "BOURSE_CONFIG": str(tmp_path / "absent.toml"),
        **env,
    }
    done = subprocess.run(
        ["sh", str(ENTRYPOINT), *args], env=environ, capture_output=True, text=True, timeout=60, check=True
    )
    return {word: rest for word, _, rest in (line.partition(" ") for line in done.stdout.splitlines())}


def test_serve_takes_the_image_defaults_then_the_callers_options(tmp_path: Path) -> None:
    assert run(tmp_path)["ARGS"].split() == ["serve", *DEFAULTS]
    assert run(tmp_path, "serve", "--port", "9000")["ARGS"].split() == ["serve", *DEFAULTS, "--port", "9000"]


def test_a_mounted_config_is_read(tmp_path: Path) -> None:
    config = tmp_path / "bourse.toml"
    config.write_text("")
    args = run(tmp_path, "serve", "--demo", BOURSE_CONFIG=str(config))["ARGS"].split()
    assert args == ["serve", *DEFAULTS, "--config", str(config), "--demo"]


def test_other_commands_pass_through(tmp_path: Path) -> None:
    assert run(tmp_path, "sim-upstream", "--port", "9100")["ARGS"] == "sim-upstream --port 9100"
    assert run(tmp_path, "admin", "accounts")["ARGS"] == "admin accounts"
    assert "ARGS" not in run(tmp_path, "true")  # not one of bourse's: run as it is


def test_keys_are_made_once_in_the_shared_folder(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    first = run(tmp_path, BOURSE_KEYS_DIR=str(keys))
    second = run(tmp_path, BOURSE_KEYS_DIR=str(keys))  # the other replica, or a restart
    assert first["ADMIN"].startswith("bk_admin_") and len(first["ADMIN"]) > 30
    Fernet(first["SECRET"].encode())  # a Fernet key, as bourse serve requires
    assert (second["ADMIN"], second["SECRET"]) == (first["ADMIN"], first["SECRET"])
    assert (keys / "admin_key").read_text().strip() == first["ADMIN"]
    assert (keys / "admin_key").stat().st_mode & 0o077 == 0  # readable by its owner only


def test_keys_set_in_the_environment_win(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    got = run(tmp_path, BOURSE_KEYS_DIR=str(keys), BOURSE_ADMIN_KEY="bk_admin_mine")
    assert got["ADMIN"] == "bk_admin_mine"
    assert got["SECRET"] == (keys / "secret_key").read_text().strip()
