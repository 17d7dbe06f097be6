"""benchmarks/data_curve.py end to end on a tiny chat target (CPU): nested prefixes of one datagen dataset, each
trained and replayed on a suite, the curve written; a rerun trains and measures nothing; bad input is refused
before anything is written. Online (--replies): the same plan as the same file's datagen shards, encoded once."""

import json
import math
import sys
from pathlib import Path

import pytest
from chat_target import CONTRACT, conversations_file, make_target

from eaglewire import checkpoint, prompts, targets
from eaglewire.data import shards
from eaglewire.data.datagen import GenConfig, regenerate, run_datagen
from eaglewire.prompts import write_conversations
from eaglewire.train import data as train_data

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import data_curve  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SUITE = [f"Words {i}?" for i in range(900, 904)]
K = 3
# The CPU's sizes: micro-batches of a few samples (several steps a point), a draft vocabulary the toy target has,
# and passes enough for the toy draft to learn
SETS = ["batch_tokens=512", "max_len=256", "eval_fraction=0.2", "draft_vocab_size=64", "log_every=2", "lr=1e-2",
        "epochs=4"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The target's own replies (datagen --regen), so that what the drafts learn carries to the suite's greedy text."""
    root = tmp_path_factory.mktemp("data_curve")
    target = make_target(root / "target")
    prompts = conversations_file(root / "convs.jsonl", 60)
    run_datagen(targets.load_target(str(target), device="cpu"), prompts, root / "data", CONTRACT, regen=True,
                max_len=256, gen=GenConfig(max_new_tokens=24, batch_size=30), dtype="fp32", batch_size=10,
                progress=False)
    (root / "suite.txt").write_text("\n".join(SUITE) + "\n")
    return root


def argv(root, out, *more):
    return ["--target", str(root / "target"), "--data", str(root / "data"), "--out", str(out),
            "--fractions", "0.25,0.5,1", "--suites", str(root / "suite.txt"), "--prompts", str(len(SUITE)),
            "--new-tokens", "12", "--chain", str(K), "--device", "cpu",
            *[x for s in SETS for x in ("--set", s)], *more]


class Counted:
    """data_curve's train and suite_text, counted (and the real ones run)."""

    def __init__(self, mp):
        self.trained, self.texts = [], 0
        real_train, real_text = data_curve.train, data_curve.measure.suite_text

        def train(cfg, *args, **kw):
            self.trained.append(cfg.max_train_samples)
            return real_train(cfg, *args, **kw)

        def suite_text(*args, **kw):
            self.texts += 1
            return real_text(*args, **kw)

        mp.setattr(data_curve, "train", train)
        mp.setattr(data_curve.measure, "suite_text", suite_text)


@pytest.fixture(scope="module")
def done(made):
    out = made / "curve"
    with pytest.MonkeyPatch.context() as mp:
        count = Counted(mp)
        assert data_curve.main(argv(made, out)) == 0
    return out, count, json.loads((out / "curve.json").read_text())


def test_points_are_nested_prefixes_of_the_training_split_with_one_held_out_split(made, done):
    out, count, curve = done
    pts = curve["points"]
    assert [p["fraction"] for p in pts] == [0.25, 0.5, 1.0]
    # Independently of the script's count: the split by content, then the shards' own masks of the first n samples
    ds = shards.open_dataset(made / "data")
    items = [ds[i] for i in range(len(ds))]
    train_idx, held = train_data.split([train_data.content_key(x["input_ids"]) for x in items], 0.2, 0)
    assert curve["meta"]["data"] == {**curve["meta"]["data"], "samples": len(ds), "train_split": len(train_idx),
                                     "heldout_split": len(held)}
    n = [p["train_samples"] for p in pts]
    assert n == [math.floor(f * len(train_idx) + 0.5) for f in (0.25, 0.5, 1)] and n[0] < n[1] < n[2]  # half up
    assert count.trained == n and count.texts == 1  # one text for all points: they are paired
    for p in pts:
        assert p["heldout_samples"] == len(held) > 0
        assert p["reply_tokens"] == sum(int(items[i]["loss_mask"][2:].sum()) for i in train_idx[:p["train_samples"]])
        assert p["reply_tokens_seen"] == p["reply_tokens"] * p["passes"] and p["passes"] == 4
        meta = checkpoint.load_meta(out / p["draft"])
        assert meta.metrics["train_samples"] == p["train_samples"] and meta.metrics["eval_samples"] == len(held)
        assert meta.training["config"]["max_train_samples"] == p["train_samples"] and meta.training["config"][
            "optimizer"] == "muon"  # recipe full's settings
        assert meta.training["steps"] == p["steps"] and meta.training["config"]["time_budget_s"] is None
    assert pts[0]["steps"] < pts[1]["steps"] < pts[2]["steps"]
    assert pts[0]["reply_tokens"] < pts[1]["reply_tokens"] < pts[2]["reply_tokens"]


def test_each_point_is_measured_on_the_suite_and_paired_against_the_largest(made, done):
    out, _, curve = done
    name = str(made / "suite.txt")
    for p in curve["points"]:
        r = p["suites"][name]
        assert r["prompts"] == len(SUITE) and 1.0 <= r["acceptance_length"] <= K + 1
        assert r["interval"][0] <= r["acceptance_length"] <= r["interval"][1] and 0 <= r["acc1"] <= 1
        assert "per_prompt" not in r  # kept in points/, not in the curve
        assert 1.0 <= p["heldout"]["acceptance_length"] and len(p["heldout"]["acc"]) == 3  # recipe full's TTT steps
    kept = json.loads((out / "points" / "0.25.json").read_text())["suites"][name]["per_prompt"]
    assert len(kept["tokens"]) == len(SUITE)
    small, largest = curve["points"][0]["suites"][name], curve["points"][-1]["suites"][name]
    assert largest["vs_largest"] is None
    vs = small["vs_largest"]
    assert vs["difference"] == pytest.approx(small["acceptance_length"] - largest["acceptance_length"], abs=1e-9)
    assert vs["interval"][0] <= vs["difference"] <= vs["interval"][1]
    # the toy draft learns: four times the data at equal passes accepts more, on the suite and held out
    assert largest["acceptance_length"] > 1.5 and vs["difference"] < 0
    held = [p["heldout"]["acceptance_length"] for p in curve["points"]]
    assert held[0] < held[-1]
    png = (out / "curve.png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 20_000
    assert sorted(p.name for p in (out / "drafts").iterdir()) == ["0.25", "0.5", "1"]


def test_a_rerun_trains_and_measures_nothing_and_a_lost_point_is_measured_not_trained(made, done, capsys):
    out, _, curve = done
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "points").iterdir()}
    with pytest.MonkeyPatch.context() as mp:
        count = Counted(mp)
        assert data_curve.main(argv(made, out)) == 0
    assert count.trained == [] and count.texts == 0
    assert {p.name: p.stat().st_mtime_ns for p in (out / "points").iterdir()} == stamps
    printed = capsys.readouterr()
    assert printed.out.startswith("| fraction | samples |") and len(printed.out.strip().splitlines()) == 2 + 3
    d = curve["meta"]["data"]
    assert (f"3 points over {d['train_split']} training samples ({d['heldout_split']} held out, the same for every "
            "point); 3 already measured") in printed.err
    # A point whose result was lost after its draft was trained: measured again on the same text, not trained
    (out / "points" / "0.5.json").unlink()
    with pytest.MonkeyPatch.context() as mp:
        count = Counted(mp)
        assert data_curve.main(argv(made, out)) == 0
    assert count.trained == [] and count.texts == 1
    again = json.loads((out / "curve.json").read_text())
    name = str(made / "suite.txt")
    assert again["points"][1]["suites"][name] == curve["points"][1]["suites"][name]
    assert "point 2/3 (0.5): its draft is already trained" in capsys.readouterr().err


def test_bad_input_is_one_line_and_exit_2_with_nothing_written(made, done, capsys):
    out, _, _ = done
    fresh = made / "never"
    for more, flag in ((["--fractions", "0.5,0.25"], "--fractions 0.5,0.25: must increase"),
                       (["--fractions", "0,0.5"], "--fractions 0,0.5: each must be in (0, 1]"),
                       (["--suites", "mt-bench,nope"], "--suites nope: not a suite"),
                       (["--set", "steps=3"], "--set steps: the points compare equal passes"),
                       (["--set", "regen=true"], "--set regen: the points train on the replies as given")):
        assert data_curve.main(argv(made, fresh, *more)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("data_curve: " + flag), err
    assert data_curve.main([*argv(made, fresh)[:2], "--data", str(made / "nope"), *argv(made, fresh)[4:]]) == 2
    assert "--data " in capsys.readouterr().err
    assert not fresh.exists()
    # the finished curve's --out, asked with other settings: refused naming what differs, nothing touched
    stamp = (out / "curve.json").stat().st_mtime_ns
    assert data_curve.main(argv(made, out, "--set", "lr=1e-3")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other settings (--set lr: 0.01 there, 0.001 here)" in err[0]
    assert (out / "curve.json").stat().st_mtime_ns == stamp


@pytest.fixture(scope="module")
def online(made):
    """The target's own replies as `recipe --mode replies` writes them (regenerated.jsonl), and the same file as
    datagen shards without --regen: what the online plan must count, counted another way."""
    tgt = targets.load_target(str(made / "target"), device="cpu")
    convs = prompts.load_pool([made / "convs.jsonl"], need_assistant=False).conversations
    kept = [c for c in regenerate(tgt, convs, GenConfig(max_new_tokens=24, batch_size=30), 256)
            if not isinstance(c, prompts.Skip)]
    path = write_conversations(kept, made / "regenerated.jsonl")
    run_datagen(tgt, path, made / "replies-data", CONTRACT, max_len=256, dtype="fp32", batch_size=10, progress=False)
    out = made / "curve-online"
    with pytest.MonkeyPatch.context() as mp:
        count = Counted(mp)
        encoded = []
        real = data_curve.train_data.build_online
        mp.setattr(data_curve.train_data, "build_online", lambda *a, **k: encoded.append(1) or real(*a, **k))
        args = argv(made, out)
        args[args.index("--data"):args.index("--data") + 2] = ["--replies", str(path)]
        assert data_curve.main(args) == 0
    return path, out, count, len(encoded), json.loads((out / "curve.json").read_text()), args


def test_online_points_plan_as_the_same_replies_offline_and_train_on_one_encoding(made, online):
    path, out, count, encoded, curve, _ = online
    assert curve["meta"]["data"]["mode"] == "online" and curve["meta"]["data"]["source"] == ["regenerated.jsonl"]
    ds = shards.open_dataset(made / "replies-data")
    items = [ds[i] for i in range(len(ds))]
    train_idx, held = train_data.split([train_data.content_key(x["input_ids"]) for x in items], 0.2, 0)
    pts = curve["points"]
    n = [p["train_samples"] for p in pts]
    assert n == [math.floor(f * len(train_idx) + 0.5) for f in (0.25, 0.5, 1)] and count.trained == n
    assert encoded == 1  # the plan's encoding is the one every point trained on: the trainer encoded nothing
    for p in pts:
        assert p["heldout_samples"] == len(held)
        assert p["reply_tokens"] == sum(int(items[i]["loss_mask"][2:].sum()) for i in train_idx[:p["train_samples"]])
        meta = checkpoint.load_meta(out / p["draft"])
        assert meta.training["data"]["mode"] == "online" and meta.training["steps"] == p["steps"]
        assert meta.metrics["train_samples"] == p["train_samples"] and meta.metrics["eval_samples"] == len(held)
    # the target's own replies teach the toy draft online too
    name = str(made / "suite.txt")
    assert pts[-1]["suites"][name]["acceptance_length"] > 1.5
    assert pts[0]["heldout"]["acceptance_length"] < pts[-1]["heldout"]["acceptance_length"]


def test_online_rerun_trains_nothing_and_other_replies_are_refused(made, online, capsys):
    path, out, _, _, curve, args = online
    with pytest.MonkeyPatch.context() as mp:
        count = Counted(mp)
        assert data_curve.main(args) == 0
    assert count.trained == [] and count.texts == 0
    capsys.readouterr()
    other = made / "other.jsonl"
    other.write_text(path.read_text().replace("Words 1?", "Words one?"))
    bad = list(args)
    bad[bad.index("--replies") + 1] = str(other)
    stamp = (out / "curve.json").stat().st_mtime_ns
    assert data_curve.main(bad) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other settings (--data/--replies: replies:" in err[0]
    assert (out / "curve.json").stat().st_mtime_ns == stamp
    bad[bad.index("--replies") + 1] = str(made / "nope.jsonl")
    assert data_curve.main(bad) == 2
    assert capsys.readouterr().err.strip().startswith("data_curve: --replies ")
    # prompts without replies: named as --replies, with the command that writes replies
    bad[bad.index("--replies") + 1] = str(made / "suite.txt")
    bad[bad.index("--out") + 1] = str(made / "never-online")
    assert data_curve.main(bad) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"data_curve: --replies {made / 'suite.txt'}: no usable conversation") \
        and "`eaglewire recipe full --mode replies`" in err[-1] and not (made / "never-online").exists()
