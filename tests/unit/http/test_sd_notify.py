"""bourse.http.sd_notify on its own: the addresses ``$NOTIFY_SOCKET`` may name, a
message's bytes on a real socket, a socket that refuses (one warning, no raise), and
``READY=1`` after the longest wait when no product becomes ready (its status saying why)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from bourse.http.sd_notify import Notifier, ServiceNotes, socket_address


def test_the_addresses_a_value_may_name() -> None:
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("@bourse/notify") == b"\0bourse/notify"
    assert socket_address(None) is None
    assert socket_address("") is None
    assert socket_address("vsock:2:1234") is None  # a kind not spoken here
    assert socket_address("relative/path") is None


def test_a_message_is_one_datagram_of_lines(tmp_path: Path) -> None:
    path = str(tmp_path / "n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(2)
        assert Notifier(path).send("READY=1", "STATUS=two\nlines")
        assert sock.recv(4096) == b"READY=1\nSTATUS=two lines"


def test_without_the_variable_nothing_is_sent() -> None:
    notifier = Notifier.from_environment({})
    assert not notifier.enabled and not notifier.send("READY=1")


def test_a_refusing_socket_warns_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="bourse")
    notifier = Notifier(str(tmp_path / "gone"))
    assert not notifier.send("READY=1") and not notifier.send("STOPPING=1")
    warnings = [r.getMessage() for r in caplog.records if "cannot notify" in r.getMessage()]
    assert len(warnings) == 1 and "No such file or directory" in warnings[0], warnings


def test_a_value_that_is_no_socket_warns_at_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="bourse")
    assert not Notifier("vsock:2:1").enabled
    assert "not a socket path or an @abstract name: 'vsock:2:1'" in caplog.text


@pytest.mark.anyio
async def test_never_ready_is_told_ready_after_the_wait_with_why(tmp_path: Path) -> None:
    path = str(tmp_path / "n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(2)
        notes = ServiceNotes(
            Notifier(path), lambda: False, lambda: "a/x: connect refused", "serving a", ready_wait_s=0.3
        )
        await notes.started()
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving a; not ready: a/x: connect refused"
        notes.reloading()
        assert sock.recv(4096).startswith(b"RELOADING=1\nMONOTONIC_USEC=")
        notes.reloaded()
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving a"


@pytest.mark.anyio
async def test_a_reload_before_ready_does_not_say_ready(tmp_path: Path) -> None:
    path = str(tmp_path / "n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(2)
        notes = ServiceNotes(Notifier(path), lambda: False, lambda: "", "serving a")
        notes.reloaded()
        assert sock.recv(4096) == b"STATUS=serving a"
