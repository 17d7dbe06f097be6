"""`eaglewire train`'s command line (train/cli.py): flags parsed into a TrainConfig. The training itself is
test_train.py's."""


def test_taps_default_is_the_data_s_or_the_default_not_a_string():
    """`train --taps default` means what leaving --taps out means (taps.parse_taps), in the config too."""
    import argparse

    from eaglewire.train.cli import config_from_args, register

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    parser = sub.choices["train"]
    base = ["--target", "t", "--data", "d", "--out", "o"]
    assert config_from_args(parser.parse_args(base + ["--taps", "default"])).taps is None
    assert config_from_args(parser.parse_args(base + ["--taps", "2, 15,27"])).taps == (2, 15, 27)


def test_train_takes_budget_from_on_its_command_line():
    from eaglewire.cli import build_parser
    from eaglewire.train.cli import config_from_args

    args = build_parser().parse_args(["train", "--target", "t", "--data", "d", "--out", "o", "--budget-from",
                                      "first-step"])
    assert config_from_args(args).budget_from == "first-step"


def test_train_takes_max_train_samples_on_its_command_line():
    from eaglewire.cli import build_parser
    from eaglewire.train.cli import config_from_args

    base = ["train", "--target", "t", "--data", "d", "--out", "o"]
    assert config_from_args(build_parser().parse_args(base)).max_train_samples is None
    assert config_from_args(build_parser().parse_args(base + ["--max-train-samples", "500"])).max_train_samples == 500
