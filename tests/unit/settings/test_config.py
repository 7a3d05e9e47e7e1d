"""Config loading: the documented names work; a bad config says file, key, expectation."""

from __future__ import annotations

from pathlib import Path

import pytest

from bourse.settings import ConfigError, load_config

GOOD = """
[server]
quiet_interval_s = 0.5

[products.sim-fast]
policy = "default"
[[products.sim-fast.deployments]]
engine = "sim"
slots = 4
floor = 0.05
tokens_per_s = 200
ttft_ms = 20

[products.remote]
policy = "gopuram"
usage_chunk = "opt_in"
[[products.remote.deployments]]
engine = "openai"
base_url = "http://127.0.0.1:9100/v1"
model = "internal-name"
api_key_env = "UPSTREAM_KEY"
slots = 8
floor = 0.10
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "bourse.toml"
    p.write_text(text)
    return p


def test_the_documented_config_loads(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, GOOD), env={"UPSTREAM_KEY": "sk-secret"})
    assert cfg.products["sim-fast"].deployments[0].tokens_per_s == 200
    remote = cfg.products["remote"].deployments[0]
    assert remote.api_key is not None and remote.api_key.get_secret_value() == "sk-secret"
    assert "sk-secret" not in repr(cfg)
    pol = cfg.policy_for("remote")
    assert pol.name == "gopuram" and pol.usage_chunk == "opt_in" and pol.reasoning_field == "reasoning"
    assert pol.quiet_interval_s == 0.5  # from [server]


def test_builtin_default_config_has_a_sim_product() -> None:
    cfg = load_config(None, env={})
    assert any(d.engine == "sim" for p in cfg.products.values() for d in p.deployments)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            ("slots = 4", 'slots = "four"'),
            r"products\.sim-fast\.deployments\[0\]\.slots: Input should be a valid integer",
        ),
        (
            ("slots = 4", "slots = 0"),
            r"products\.sim-fast\.deployments\[0\]\.slots: Input should be greater than or equal to 1",
        ),
        (
            ('engine = "sim"', 'engine = "gpu"'),
            r"products\.sim-fast\.deployments\[0\]\.engine: Input should be 'sim', 'openai' or 'llamacpp'",
        ),
        (
            ("ttft_ms = 20", "ttft_ms = 20\ncolour = 1"),
            r"products\.sim-fast\.deployments\[0\]\.colour: unknown key",
        ),
        (('policy = "default"', 'policy = "fastest"'), r"products\.sim-fast\.policy: expected one of"),
        (
            ('base_url = "http://127.0.0.1:9100/v1"', 'base_url = "ftp://x"'),
            r"products\.remote\.deployments\[0\]\.base_url: expected an http",
        ),
        (("[server]", "[server\n"), r"not valid TOML"),
    ],
)
def test_bad_config_names_file_key_and_expectation(
    tmp_path: Path, edit: tuple[str, str], expected: str
) -> None:
    path = write(tmp_path, GOOD.replace(*edit, 1))
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(path, env={"UPSTREAM_KEY": "k"})
    assert str(path) in str(info.value)


def test_missing_secret_env_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"api_key_env: the environment variable UPSTREAM_KEY is not set"):
        load_config(write(tmp_path, GOOD), env={})


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(tmp_path / "missing.toml", env={})
