"""The local engine's CPU check: llama.cpp's extra buffer types (AMX) off on an AMX CPU."""

from __future__ import annotations

from pathlib import Path

from bourse.engines.llamacpp_native import has_amx


def test_amx_is_read_from_the_cpu_flags(tmp_path: Path) -> None:
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n")
    plain = tmp_path / "plain"
    plain.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\nbugs\t\t: amx_tile_is_not_a_flag_here\n")
    assert has_amx(str(amx)) is True
    assert has_amx(str(plain)) is False
    assert has_amx(str(tmp_path / "missing")) is False
