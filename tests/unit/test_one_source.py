"""Each name written once (issue 36): every list that is derived from another, or
written beside it where it cannot be derived (a docstring, the docs, a Lua script),
is checked here against its one source.

- the preset names: :data:`bourse.domain.policy.PRESETS` (each policy's ``name``, the
  docs' lists and tables);
- the charging table: :data:`bourse.domain.charging.CHARGING` (its docstring's table
  and docs/architecture.md's);
- the Redis book's keys: :data:`bourse.coordination.book_redis.BOOK_KEYS` (the
  scripts' unpack of ``KEYS`` and their key table, in ``lua/book.lua``);
- the usage CSV's columns: :data:`bourse.http.usage_csv.COLUMNS` (the receipt field
  names each preset gives, docs/dashboard.md's list).
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest

from bourse.coordination.book_redis import BOOK_KEYS, SHARED_KEYS, script_keys
from bourse.domain import charging
from bourse.domain.charging import CHARGING, ChargedWhen
from bourse.domain.policy import PRESETS, resolve_policy
from bourse.http import usage_csv

ROOT = Path(__file__).resolve().parents[2]


def _doc(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def _ticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


# -- preset names --------------------------------------------------------------------


def test_each_preset_carries_the_name_it_is_found_by() -> None:
    assert {name: p.name for name, p in PRESETS.items()} == {name: name for name in PRESETS}


def test_the_docs_name_every_preset() -> None:
    config = _doc("docs/configuration.md")
    listed = re.search(r'^policy = "default" +# (.*)$', config, re.MULTILINE)
    assert listed is not None
    assert listed.group(1).split(" | ") == list(PRESETS)
    with pytest.raises(ValueError) as refused:
        resolve_policy("nope", {})
    assert f"products.p.{refused.value}" in config  # the config error, as the docs show it
    readme = _doc("README.md").split("## Presets", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    assert [_ticked(line)[0] for line in rows] == list(PRESETS)
    streaming = _doc("docs/streaming.md")
    header = next(line for line in streaming.splitlines() if line.startswith("| | `default`"))
    assert _ticked(header) == list(PRESETS)


# -- the charging table ----------------------------------------------------------------

_WHEN: dict[str, ChargedWhen] = {
    "always": "always",
    "never": "never",
    "policy charge_on_disconnect": "charge_on_disconnect",
    "policy charge_on_error": "charge_on_error",
}
_YES = {"yes": True, "no": False}


def _rows(cells: list[list[str]]) -> dict[str, tuple[ChargedWhen, bool]]:
    return {outcome: (_WHEN[when], _YES[reconcile]) for outcome, when, reconcile in cells}


def _plain(cell: str) -> str:
    return cell.replace("`", "").strip()


def test_the_charging_docstring_is_the_table() -> None:
    doc = charging.__doc__ or ""
    body = doc.split("====\n", 2)[2].split("\n====", 1)[0]  # between the header rule and the last
    cells = [[_plain(c) for c in re.split(r"\s{2,}", line.strip())] for line in body.splitlines()]
    assert _rows(cells) == CHARGING


def test_the_architecture_docs_charging_table_is_the_table() -> None:
    text = _doc("docs/architecture.md")
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("| `")]
    table = [line for line in lines if _plain(line.split("|")[1]) in CHARGING]
    cells = [[_plain(c) for c in line.strip("|").split("|")] for line in table]
    assert _rows(cells) == CHARGING


# -- the Redis book's keys ---------------------------------------------------------------

LUA_LOCALS = {"seq": "seqk", "replicas": "reps"}
"""Where a script's local for a key is not the key's name: ``seq`` is what the scripts
call an arrival number."""


def _lua(name: str) -> str:
    return resources.files("bourse.coordination").joinpath("lua", name).read_text(encoding="utf-8")


def test_the_book_scripts_unpack_keys_in_book_keys_order() -> None:
    keys = [*BOOK_KEYS, *SHARED_KEYS]
    assert [k.rsplit(":", 1)[1] for k in script_keys("bourse", "p")] == keys
    common = _lua("book.lua")
    unpack = re.search(r"^local ([\w, ]+) =\s*((?:KEYS\[\d+\],?\s*)+)", common, re.MULTILINE)
    assert unpack is not None, "book.lua unpacks KEYS in one local statement"
    names = [n.strip() for n in unpack.group(1).split(",")]
    indices = [int(i) for i in re.findall(r"KEYS\[(\d+)\]", unpack.group(2))]
    assert indices == list(range(1, len(keys) + 1))
    assert names == [LUA_LOCALS.get(k, k) for k in keys]
    assert common.count("KEYS[") == len(keys), "KEYS is read in the unpack only"
    table = re.findall(r"^--   (\w+) +(?:ZSET|HASH|LIST|STRING) ", common, re.MULTILINE)
    assert table == list(BOOK_KEYS), "the key table in book.lua's header"
    scripts = [f.name for f in resources.files("bourse.coordination").joinpath("lua").iterdir()]
    for script in sorted(s for s in scripts if s.startswith("book_")):
        assert "KEYS[" not in _lua(script), f"{script} reads KEYS itself"


# -- the usage CSV -----------------------------------------------------------------------


def test_the_csv_reads_each_presets_receipt_names() -> None:
    receipt_paths = {path for _, paths in usage_csv.COLUMNS for path in paths if path[0] == "receipt"}
    for name, policy in PRESETS.items():
        assert ("receipt", policy.receipt_quote_field) in receipt_paths, name


def test_the_dashboard_docs_list_every_csv_column() -> None:
    text = _doc("docs/dashboard.md")
    listed = text.split("(`bourse.http.usage_csv.COLUMNS`):", 1)[1].split(". ", 1)[0]
    assert _ticked(listed) == usage_csv.header()
