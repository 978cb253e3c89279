"""One option, one definition: every command taking ``--device``, ``--dtype``, ``--trust-remote-code``,
``--seed`` or ``--limit`` gets it from the helper of :mod:`gradflow.cli.options` (same type, range and
choices everywhere), and every command module of ``gradflow.cli`` registers exactly the command of
its own name."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import pytest

import gradflow.cli
from gradflow.cli.main import COMMAND_MODULES, build_parser
from gradflow.errors import UsageError
from gradflow.models import DTYPES

SHARED = ("--device", "--dtype", "--trust-remote-code", "--seed", "--limit")
NOT_COMMANDS = {"main", "options"}


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command's parser by its full name ("record", "zoo fetch"), walked from ``parser``."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                full = f"{prefix} {name}".strip()
                found[full] = sub
                found.update(_commands(sub, full))
    return found


COMMANDS = _commands(build_parser())


def _flag(flag: str) -> dict[str, argparse.Action]:
    return {name: sub._option_string_actions[flag] for name, sub in COMMANDS.items()
            if flag in sub._option_string_actions}


def test_the_shared_flags_are_where_they_were():
    assert {flag: sorted(_flag(flag)) for flag in SHARED} == {
        "--device": ["atlas", "check", "explore", "finetune", "probe", "record", "repair"],
        "--dtype": ["atlas", "record"],
        "--trust-remote-code": ["atlas", "check", "record"],
        "--seed": ["atlas", "channels", "check", "diagnose", "finetune", "probe", "record", "repair", "surgery"],
        "--limit": ["atlas", "demo", "diagnose", "probe", "record"],
    }


@pytest.mark.parametrize("command", sorted(_flag("--dtype")))
def test_every_dtype_has_the_model_loaders_choices(command):
    action = _flag("--dtype")[command]
    assert list(action.choices) == list(DTYPES) and action.default == "float32"
    assert "%(choices)s" in action.help and "%(default)s" in action.help


@pytest.mark.parametrize("command", sorted(_flag("--device")))
def test_every_device_is_a_free_torch_device_name(command):
    action = _flag("--device")[command]
    assert action.choices is None and action.type is None and action.nargs is None
    assert action.default == "cpu" and action.help.startswith("torch device")


@pytest.mark.parametrize("command", sorted(_flag("--trust-remote-code")))
def test_every_trust_remote_code_is_an_off_by_default_switch(command):
    action = _flag("--trust-remote-code")[command]
    assert isinstance(action, argparse._StoreTrueAction) and action.default is False
    assert "own Python code" in action.help


@pytest.mark.parametrize(("flag", "good", "bad"), [
    ("--seed", {"0": 0, "7": 7}, ("-1", "1.5", "x", "nan")),
    ("--limit", {"1": 1, "50": 50}, ("0", "-3", "2.5", "x")),
])
def test_every_seed_and_limit_is_checked_the_same_way(flag, good, bad):
    for command, action in _flag(flag).items():
        for text, value in good.items():
            converted = action.check(text)
            assert converted == value and type(converted) is int, command
        for text in bad:
            with pytest.raises(UsageError, match=f"^{flag} must be "):
                action.check(text)
        assert action.default is None or (type(action.default) is int and action.check(str(action.default))
                                          == action.default), command
        assert flag != "--seed" or action.help.startswith("random seed"), command


def test_each_command_keeps_its_default():
    assert {c: a.default for c, a in _flag("--seed").items()} == dict.fromkeys(_flag("--seed"), 0)
    assert {c: a.default for c, a in _flag("--limit").items()} == {
        "atlas": None, "demo": None, "diagnose": None, "probe": 2000, "record": None}


def _command_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(gradflow.cli.__path__) if m.name not in NOT_COMMANDS)


@pytest.mark.parametrize("name", _command_modules())
def test_each_cli_module_registers_the_command_of_its_name(name):
    module = importlib.import_module(f"gradflow.cli.{name}")
    subparsers = argparse.ArgumentParser().add_subparsers(dest="command")
    module.add_parser(subparsers)
    assert list(subparsers.choices) == [name]
    assert subparsers.choices[name].get_default("run") is module.run


def test_main_lists_every_command_module_once():
    names = [m.__name__.rpartition(".")[2] for m in COMMAND_MODULES]
    assert sorted(names) == _command_modules() and len(set(names)) == len(names)
    top = [name for name in COMMANDS if " " not in name]
    assert top == names  # gradflow --help lists the commands in COMMAND_MODULES' order


def test_every_width_has_one_default_the_figures_share():
    """Issue 27 point 6: report, compare and probe drew at different default widths; now one, the figures' own."""
    from gradflow.cli.options import DEFAULT_FIGURE_WIDTH
    from gradflow.figures.style import DEFAULT_WIDTH, WIDTHS

    widths = _flag("--width")
    assert {"report", "compare", "probe"} <= set(widths)
    assert {action.default for action in widths.values()} == {DEFAULT_WIDTH} == {DEFAULT_FIGURE_WIDTH}
    assert all(list(action.choices) == list(WIDTHS) for action in widths.values())
