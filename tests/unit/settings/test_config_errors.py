"""Config errors as an operator meets them: every problem at once, one line each, enum
values in any case, and a wrong type anywhere is a ConfigError (never a crash)."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from bourse.settings import ConfigError, parse_config

SIM = '[products.p]\n[[products.p.deployments]]\nengine = "sim"\n'


def _parse(text: str, env: dict[str, str] | None = None) -> Any:
    return parse_config(tomllib.loads(text), "bourse.toml", env=env or {})


def test_every_problem_is_reported_at_once() -> None:
    text = """
[server]
bogus = 1
port = "eighty"

[products.a]
policy = "nope"
[[products.a.deployments]]
engine = "sim"

[products.b]
[[products.b.deployments]]
engine = "sim"
slots = 0
[[products.b.deployments]]
engine = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "m"
api_key_env = "MISSING_KEY"
"""
    with pytest.raises(ConfigError) as info:
        _parse(text)
    lines = str(info.value).splitlines()
    wanted = [
        "server.bogus: unknown key",
        "server.port: Input should be a valid integer",
        "products.a.policy: expected one of",
        "products.b.deployments[0].slots: Input should be greater than or equal to 1",
        "products.b.deployments[1].api_key_env: the environment variable MISSING_KEY is not set",
    ]
    for want in wanted:
        assert sum(want in line for line in lines) == 1, (want, lines)
    assert len(lines) == len(wanted), lines
    assert all(line.startswith("config error in bourse.toml: ") for line in lines), lines
    assert info.value.problems == [line.removeprefix("config error in bourse.toml: ") for line in lines]


def test_duplicate_deployment_names_are_reported() -> None:
    text = SIM + 'name = "x"\n[products.q]\n[[products.q.deployments]]\nengine = "sim"\nname = "x"\n'
    with pytest.raises(ConfigError, match=r"products\.q\.deployments\[0\]\.name: 'x' is used twice"):
        _parse(text)


@pytest.mark.parametrize(
    ("text", "check"),
    [
        ('[server]\nlog_level = "INFO"\n' + SIM, ("server.log_level", "info")),
        ('[server]\nlog_level = "Warning"\n' + SIM, ("server.log_level", "warning")),
        (SIM.replace('"sim"', '"SIM"'), ("engine", "sim")),
        (SIM.replace("[products.p]\n", '[products.p]\npolicy = "GoPuram"\n'), ("policy", "gopuram")),
        (SIM.replace("[products.p]\n", '[products.p]\nusage_chunk = "ALWAYS"\n'), ("usage_chunk", "always")),
        (
            SIM.replace("[products.p]\n", '[products.p]\non_disconnect = "Drain"\n'),
            ("on_disconnect", "drain"),
        ),
    ],
    ids=["log_level-upper", "log_level-title", "engine", "policy", "usage_chunk", "on_disconnect"],
)
def test_enum_values_are_case_insensitive(text: str, check: tuple[str, str]) -> None:
    cfg = _parse(text)
    key, value = check
    if key == "server.log_level":
        assert cfg.server.log_level == value
    elif key == "engine":
        assert cfg.products["p"].deployments[0].engine == value
    elif key == "policy":
        assert cfg.policy_for("p").name == value
    else:
        assert getattr(cfg.policy_for("p"), key) == value


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("products = 3\n", "products"),
        ('products = "many"\n', "products"),
        ("products = [1, 2]\n", "products"),
        ("server = 3\n" + SIM, "server"),
        ("cluster = []\n" + SIM, "cluster"),
        ("[products]\np = 3\n", "products.p"),
        ("[products.p]\ndeployments = 3\n", "products.p.deployments"),
        ("[products.p]\ndeployments = [3]\n", "products.p.deployments[0]"),
        ("[products.p]\ndeployments = ['sim']\n", "products.p.deployments[0]"),
        (SIM + "api_key_env = 3\n", "products.p.deployments[0].api_key_env"),
        (SIM + "api_key_env = ['A']\n", "products.p.deployments[0].api_key_env"),
        ("[server]\nlog_level = 3\n" + SIM, "server.log_level"),
        ('[products.p]\npolicy = 3\n[[products.p.deployments]]\nengine = "sim"\n', "products.p.policy"),
        (
            '[products.p]\nusage_chunk = 1\n[[products.p.deployments]]\nengine = "sim"\n',
            "products.p.usage_chunk",
        ),
    ],
)
def test_a_wrong_type_anywhere_is_a_one_line_config_error(text: str, where: str) -> None:
    with pytest.raises(ConfigError) as info:
        _parse(text)
    lines = str(info.value).splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"config error in bourse.toml: {where}"), lines


def test_no_products_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^config error in bourse.toml: products: Field required$"):
        _parse("[server]\nport = 1\n")


def test_a_knob_of_the_wrong_type_is_reported_beside_another_problem() -> None:
    text = '[server]\nport = "x"\n[products.p]\ndone_after_error = "true"\n[[products.p.deployments]]\nengine = "sim"\n'
    with pytest.raises(ConfigError) as info:
        _parse(text)
    wheres = [p.split(":")[0] for p in info.value.problems]
    assert wheres[0] == "server.port", info.value.problems
    assert any("done_after_error" in p and "true or false" in p for p in info.value.problems), (
        info.value.problems
    )
