"""Unknown words are errors, not silent defaults (issue 36).

The config refuses a word it does not know at load, naming it (a
:class:`~bourse.settings.ConfigError`, one line per problem); past the config, the
code that acts on a word matches every word of its ``Literal`` and nothing else
(``typing.assert_never``, so mypy refuses a new word that is not handled, and a word
that got past the config anyway is refused, naming it). Before: an unknown error frame
shape rendered as ``envelope``, an unknown charge word charged nothing, and an unknown
engine kind built an ``openai`` engine.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, get_args

import pytest

from bourse.container import build_engine
from bourse.domain.charging import CHARGING, Outcome, decide
from bourse.domain.errors import GatewayError
from bourse.domain.policy import Charge, ErrorFrame, Policy
from bourse.engines.llamacpp import LlamaCppEngine
from bourse.engines.openai_http import OpenAIHTTPEngine
from bourse.engines.sim import SimEngine
from bourse.settings import ConfigError, DeploymentConfig, EngineName, load_config
from bourse.wire.chunks import error_frame

ERR = GatewayError(502, "upstream_error", "boom")
FIELDS = ("message", "type", "param", "code")


def _frame(shape: Any) -> dict[str, Any]:
    return error_frame("chat", "rid", "m", 7, ERR, shape=shape, fields=FIELDS, finish_reason=False)


# -- at load: the config names the word ----------------------------------------------


@pytest.mark.parametrize(
    ("product", "deployment", "word"),
    [
        ("", 'engine = "anthropic"', "anthropic"),
        ('error_frame = "html"', 'engine = "sim"', "html"),
        ('charge_on_error = "partial"', 'engine = "sim"', "partial"),
        ('charge_on_disconnect = "half"', 'engine = "sim"', "half"),
    ],
    ids=["engine", "error_frame", "charge_on_error", "charge_on_disconnect"],
)
def test_the_config_refuses_an_unknown_word_by_name(
    tmp_path: Path, product: str, deployment: str, word: str
) -> None:
    path = tmp_path / "bourse.toml"
    path.write_text(f"[products.p]\n{product}\n[[products.p.deployments]]\n{deployment}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert len(refused.value.problems) == 1 and repr(word) in refused.value.problems[0], refused.value


# -- past the config: every word handled, any other refused --------------------------


def test_each_error_frame_shape_is_its_own_and_no_other_is_drawn() -> None:
    frames = [_frame(shape) for shape in get_args(ErrorFrame)]
    assert len({repr(f) for f in frames}) == len(frames)
    with pytest.raises(AssertionError, match="'html'"):
        _frame("html")  # before: {"error": …}, the envelope


@pytest.mark.parametrize("outcome", [o for o, (when, _) in CHARGING.items() if when.startswith("charge_on")])
def test_each_charge_word_decides_and_no_other_does(outcome: Outcome) -> None:
    knob = "charge_on_disconnect" if CHARGING[outcome][0] == "charge_on_disconnect" else "charge_on_error"
    actions = {"generated": "settle", "none": "release"}
    assert set(actions) == set(get_args(Charge))
    for word, action in actions.items():
        knobs: dict[str, Any] = {knob: word}
        policy = replace(Policy(), **knobs)
        assert decide(outcome, policy, produced=True, usage_estimated=False) == action
    stray: dict[str, Any] = {knob: "partial"}
    policy = replace(Policy(), **stray)
    with pytest.raises(AssertionError, match="'partial'"):
        decide(outcome, policy, produced=True, usage_estimated=False)  # before: release


def test_each_engine_kind_builds_its_engine_and_no_other_does() -> None:
    keys: dict[str, dict[str, Any]] = {
        "sim": {},
        "llamacpp": {},
        "openai": {"base_url": "http://127.0.0.1:9/v1", "model": "m"},
    }
    assert set(keys) == set(get_args(get_args(EngineName)[0]))
    built = {kind: type(build_engine("p", DeploymentConfig(engine=kind, **k))[0]) for kind, k in keys.items()}
    assert built == {"sim": SimEngine, "llamacpp": LlamaCppEngine, "openai": OpenAIHTTPEngine}
    word: Any = "anthropic"
    stray = DeploymentConfig.model_construct(engine=word, **keys["openai"])
    with pytest.raises(AssertionError, match="'anthropic'"):
        build_engine("p", stray)  # before: an openai engine
