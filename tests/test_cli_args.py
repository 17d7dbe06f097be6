"""The command line refuses values that cannot make sense as it parses them, and `train --resume` refuses to
start a fresh run in silence. Every int or float option of every subcommand is walked, so a flag added later
without a validating type fails here."""

import argparse
import math
import re

import pytest

from eaglewire import cli, cli_args

# Options whose 0 has a meaning their help gives (greedy, off, none, no evaluation, a seed). Every other
# numeric option must refuse 0 as well as a negative value.
ZERO_MEANS = {
    "generate": {"--temperature", "--top-k", "--seed"},
    "bench": {"--temperature", "--top-k", "--seed"},
    "datagen": {"--temperature", "--seed"},
    "train": {"--min-lr-ratio", "--warmup-steps", "--weight-decay", "--betas", "--clip-grad", "--eval-fraction",
              "--ckpt-every", "--seed", "--num-workers", "--regen-temperature"},
    "recipe": {"--self-prompts", "--seed"},
}


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def typed_options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings and a.type is not None]


def refused(capsys, command: str, action: argparse.Action, value: str) -> str:
    """The one error line `eaglewire COMMAND FLAG VALUE` ends with (asserting exit 2)."""
    flag = action.option_strings[0]
    n = action.nargs if isinstance(action.nargs, int) else 1
    with pytest.raises(SystemExit) as e:
        cli.main([command, flag, *[value] * n])
    assert e.value.code == 2, f"{command} {flag} {value} was accepted"
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error:" in line]
    assert errors == [err[-1]], f"{command} {flag} {value}: not one error line: {err}"
    return err[-1]


def test_no_option_takes_a_bare_int_or_float():
    bare = [f"{name} {a.option_strings[0]}" for name, p in subparsers().items() for a in p._actions
            if a.option_strings and (a.type in (int, float) or (
                a.type is None and a.nargs != 0 and not isinstance(a.default, bool)
                and isinstance(a.default, (int, float))))]
    assert not bare, f"numeric options without a validating type (use cli_args.positive_int etc.): {bare}"


def test_every_numeric_option_refuses_a_negative_value_and_zero_unless_it_means_something(capsys):
    seen = set()
    for name, p in subparsers().items():
        for a in typed_options(p):
            flag = a.option_strings[0]
            seen.add((name, flag))
            line = refused(capsys, name, a, "-1")
            assert line.startswith(f"eaglewire {name}: error: argument {flag}: ") and "'-1'" in line, line
            assert re.search(r"must be \S", line), line  # what it must be
            if flag in ZERO_MEANS.get(name, ()):
                a.type("0")  # accepted, and the help says what it means
                assert re.search(r"\b0\b", a.help or ""), f"{name} {flag}: 0 accepted, its help does not say why"
            else:
                assert "'0'" in refused(capsys, name, a, "0")
    listed = {(n, f) for n, flags in ZERO_MEANS.items() for f in flags}
    assert listed <= seen, f"ZERO_MEANS names options that do not exist: {listed - seen}"
    assert len(seen) > 50  # the walk reached every command's options


@pytest.mark.parametrize("argv, says", [
    (["doctor", "--draft", "d", "--probe", "0"], "argument --probe: invalid value '0': must be an integer >= 1"),
    (["doctor", "--draft", "d", "--probe-tokens", "1"], "must be an integer >= 2"),
    (["train", "--target", "t", "--data", "d", "--out", "o", "--lr", "nan"], "argument --lr: invalid value 'nan'"),
    (["train", "--target", "t", "--data", "d", "--out", "o", "--ttt-decay", "1.5"], "in (0, 1]"),
    (["train", "--target", "t", "--data", "d", "--out", "o", "--eval-fraction", "1"], "in [0, 1)"),
    (["datagen", "--target", "t", "--prompts", "p", "--out", "o", "--batch-size", "2.5"], "an integer >= 1"),
    (["serve-check", "--draft", "d", "--gpu-memory-utilization", "1.5"], "memory the engine may take, in (0, 1]"),
    (["recipe", "demo", "--out", "o", "--turns", "0"], "argument --turns: invalid value '0'"),
    (["recipe", "demo", "--out", "o", "--budget-s", "inf"], "argument --budget-s: invalid value 'inf'"),
])
def test_out_of_range_values_name_the_flag_and_the_range(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err.strip().splitlines()[-1]


def test_validators_keep_what_makes_sense():
    assert cli_args.positive_int("3") == 3 and cli_args.nonneg_int("0") == 0
    assert cli_args.fraction("1") == 1.0 and cli_args.ratio("0") == 0.0 and cli_args.positive_float("1e-4") == 1e-4
    assert cli_args.int_at_least(2)("2") == 2
    for check, text in [(cli_args.positive_int, "0"), (cli_args.positive_int, "1.0"), (cli_args.nonneg_int, "-1"),
                        (cli_args.positive_float, "0"), (cli_args.nonneg_float, "-inf"), (cli_args.fraction, "0"),
                        (cli_args.ratio, "1"), (cli_args.int_at_least(2), "1"), (cli_args.positive_float, "x")]:
        with pytest.raises(argparse.ArgumentTypeError):
            check(text)
    assert not math.isnan(cli_args.nonneg_float("0"))


@pytest.mark.parametrize("holds", ["nothing", "empty", "a log"])
def test_train_resume_with_nothing_to_resume_is_a_usage_error(tmp_path, capsys, holds):
    """A mistyped --out must not start a fresh day-long run: one line, exit 2, --out left as it was."""
    data = tmp_path / "data"
    data.mkdir()
    out = tmp_path / "run"
    if holds != "nothing":
        out.mkdir()
    if holds == "a log":  # a run killed before its first resume state
        (out / "train_log.jsonl").write_text('{"kind": "train", "step": 1}\n')
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    code = cli.main(["train", "--target", "never-loaded", "--data", str(data), "--out", str(out), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"eaglewire train: error: --out {out}: ") and "nothing to resume" in err[0]
    assert "to start a fresh run there, drop --resume" in err[0]
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before
