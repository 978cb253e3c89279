"""Options are checked at the edge: a bad value is one line naming the option and its range, exit 2.

Also: ``gradflow --help`` lists every command, option choices come from the registries, and the
compare-with-one-run message points to the shell command.
"""

from __future__ import annotations

import argparse

import pytest

from gradflow.cli import build_parser, main
from gradflow.figures.style import WIDTHS
from gradflow.interventions.finetune import BUILTIN_TASKS
from gradflow.losses import LOSSES, REDUCTIONS
from gradflow.models import DTYPES, EMBEDDED_MODELS
from gradflow.runs.channels import QUANTITIES

COMMANDS = ("record", "demo", "zoo", "report", "compare", "channels", "diagnose", "surgery", "finetune")
RECORD = ["record", "--out", "OUT"]
DIAGNOSE = ["diagnose", "--out", "OUT"]
SURGERY = ["surgery", "--model", "m", "--out", "OUT"]
FINETUNE = ["finetune", "--model", "m", "--task", "t", "--out", "OUT"]

BAD = [
    (RECORD + ["--mask-rate", "1.5"], "--mask-rate", "in (0, 1]", "got 1.5"),
    (RECORD + ["--mask-rate", "0"], "--mask-rate", "in (0, 1]", "got 0"),
    (RECORD + ["--mask-rate", "nan"], "--mask-rate", "in (0, 1]", "got nan"),
    (RECORD + ["--mask-rate", "high"], "--mask-rate", "a number in (0, 1]", "got 'high'"),
    (RECORD + ["--batch-size", "0"], "--batch-size", ">= 1", "got 0"),
    (RECORD + ["--batch-size", "2.5"], "--batch-size", "an integer >= 1", "got '2.5'"),
    (RECORD + ["--max-length", "0"], "--max-length", ">= 1", "got 0"),
    (RECORD + ["--limit", "0"], "--limit", ">= 1", "got 0"),
    (RECORD + ["--seed", "-1"], "--seed", ">= 0", "got -1"),
    (RECORD + ["--mask-split", "0.5,0.5,0.5"], "--mask-split", "summing to 1", "0.5,0.5,0.5"),
    (RECORD + ["--mask-split", "0.8,0.2"], "--mask-split", "three comma-separated", "0.8,0.2"),
    (RECORD + ["--mask-split", "1.2,-0.1,-0.1"], "--mask-split", "non-negative", "1.2,-0.1,-0.1"),
    (RECORD + ["--mask-split", "a,b,c"], "--mask-split", "fractions", "a,b,c"),
    (RECORD + ["--mask-split", "0.8,0.3,-0.1"], "--mask-split", "non-negative", "-0.1 (the 3rd value) is not >= 0"),
    (RECORD + ["--mask-split", "0.8,0.1,0.2"], "--mask-split", "summing to 1", "'0.8,0.1,0.2': they sum to 1.1"),
    (RECORD + ["--mask-split", "0.8,0.2"], "--mask-split", "three comma-separated", "'0.8,0.2': it has 2 values"),
    (RECORD + ["--mask-ratios", "0.1,0,0.9"], "--mask-ratios", "in (0, 1]", "0 (the 2nd value) is not in (0, 1]"),
    (RECORD + ["--mask-ratios", "0.5,1.5"], "--mask-ratios", "in (0, 1]", "1.5 (the 2nd value) is not in (0, 1]"),
    (RECORD + ["--mask-ratios", "0.5,,0.9"], "--mask-ratios", "numbers", "'' (the 2nd value) is not a number"),
    (RECORD + ["--mask-ratios", "half"], "--mask-ratios", "numbers", "'half' (the 1st value) is not a number"),
    (RECORD + ["--mask-ratio", "0"], "--mask-ratio", "in (0, 1]", "got 0"),
    (["demo", "--out", "OUT", "--limit", "0"], "--limit", ">= 1", "got 0"),
    (DIAGNOSE + ["--batch-size", "0"], "--batch-size", ">= 1", "got 0"),
    (DIAGNOSE + ["--max-length", "-5"], "--max-length", ">= 1", "got -5"),
    (DIAGNOSE + ["--limit", "0"], "--limit", ">= 1", "got 0"),
    (DIAGNOSE + ["--seed", "-3"], "--seed", ">= 0", "got -3"),
    (SURGERY + ["--drop-last", "-1"], "--drop-last", ">= 0", "got -1"),
    (SURGERY + ["--reinit-last", "-1"], "--reinit-last", ">= 0", "got -1"),
    (SURGERY + ["--seed", "-1"], "--seed", ">= 0", "got -1"),
    (FINETUNE + ["--lr", "0"], "--lr", "> 0", "got 0"),
    (FINETUNE + ["--lr=-1e-4"], "--lr", "> 0", "got -1e-4"),
    (FINETUNE + ["--steps", "0"], "--steps", ">= 1", "got 0"),
    (FINETUNE + ["--batch-size", "0"], "--batch-size", ">= 1", "got 0"),
    (FINETUNE + ["--eval-every", "0"], "--eval-every", ">= 1", "got 0"),
    (FINETUNE + ["--warmup", "1"], "--warmup", "in [0, 1)", "got 1"),
    (FINETUNE + ["--weight-decay", "-0.1"], "--weight-decay", ">= 0", "got -0.1"),
    (FINETUNE + ["--max-length", "0"], "--max-length", ">= 1", "got 0"),
    (FINETUNE + ["--seed", "-1"], "--seed", ">= 0", "got -1"),
    (FINETUNE + ["--drop-last", "-1"], "--drop-last", ">= 0", "got -1"),
    (FINETUNE + ["--reinit-last", "-2"], "--reinit-last", ">= 0", "got -2"),
    (FINETUNE + ["--train-limit", "0"], "--train-limit", ">= 1", "got 0"),
    (FINETUNE + ["--eval-limit", "0"], "--eval-limit", ">= 1", "got 0"),
    (FINETUNE + ["--class-weights", "1,-2"], "--class-weights", "non-negative numbers", "-2 (the 2nd value) is not >= 0"),
    (FINETUNE + ["--class-weights", "1,2,3,4,5,6,7,8,9,10,x"], "--class-weights", "numbers", "'x' (the 11th value)"),
    (FINETUNE + ["--class-weights", "heavy"], "--class-weights", "balanced", "heavy"),
]


def _one_line_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.out == "" and "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize(("argv", "flag", "accepted", "got"), BAD, ids=[" ".join([b[0][0], *b[0][-2:]]) for b in BAD])
def test_bad_option_value_is_one_line_exit_2(capsys, tmp_path, argv, flag, accepted, got):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    line = _one_line_error(capsys, argv)
    assert line.startswith(f"gradflow: error: {flag} must be ")
    assert accepted in line and got in line
    assert not (tmp_path / "out").exists()


def test_mask_rate_message_says_what_the_option_means(capsys, tmp_path):
    line = _one_line_error(capsys, ["record", "--out", str(tmp_path / "o"), "--mask-rate", "1.5"])
    assert line == ("gradflow: error: --mask-rate must be in (0, 1] (bert and span: the fraction of maskable "
                    "tokens selected for the loss), got 1.5")


def test_a_bad_value_in_a_list_option_is_named_with_its_place_and_the_range(capsys, tmp_path):
    """Issue 59: ``--mask-ratios 0.1,0,0.9`` did not say which value was wrong."""
    line = _one_line_error(capsys, ["record", "--out", str(tmp_path / "o"), "--objective", "diffusion",
                                    "--mask-ratios", "0.1,0,0.9"])
    assert line == ("gradflow: error: --mask-ratios must be comma-separated numbers in (0, 1] (masking ratios t), "
                    "got '0.1,0,0.9': 0 (the 2nd value) is not in (0, 1]")


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert f"\n    {command} " in out, command


def test_finetune_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["finetune", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo the help formatter's line breaks
    for option in ("--model", "--task", "--out", "--lr", "--steps", "--drop-last", "--reinit-last", "--class-weights",
                   "--head-only", "--autocast", "--save-model", "--no-progress"):
        assert option in out
    assert all(name in _option("finetune", "--task").help for name in BUILTIN_TASKS)


def _option(command: str, flag: str) -> argparse.Action:
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return subparsers.choices[command]._option_string_actions[flag]


def test_choices_come_from_the_registries():
    assert list(_option("record", "--loss").choices) == list(LOSSES)
    assert list(_option("record", "--reduction").choices) == list(REDUCTIONS)
    assert list(_option("record", "--dtype").choices) == list(DTYPES)
    assert list(_option("channels", "--quantity").choices) == list(QUANTITIES)
    assert list(_option("report", "--width").choices) == list(WIDTHS)
    assert list(_option("compare", "--width").choices) == list(WIDTHS)
    for command in ("record", "channels", "diagnose", "surgery", "finetune"):
        assert all(name in _option(command, "--model").help for name in EMBEDDED_MODELS)


def test_unknown_choice_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["record", "--out", str(tmp_path / "o"), "--loss", "nonexistent"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--loss" in err and all(name in err for name in LOSSES)


def test_compare_with_one_run_points_to_report(capsys, tmp_path):
    line = _one_line_error(capsys, ["compare", str(tmp_path / "run"), "--out", str(tmp_path / "cmp")])
    assert "gradflow report RUN_DIR --out DIR" in line
    assert "write_report" not in line
