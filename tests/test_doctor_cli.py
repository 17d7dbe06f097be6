"""`eaglewire doctor` on the command line: exit codes 0/1/2, --json, --apply, a probe through a target
directory with a tokenizer (prompts -> the target's own greedy continuation)."""

import json

import pytest
import torch

from eaglewire import interop
from eaglewire.cli import main
from eaglewire.doctor.findings import CODES

import doctor_fixtures as fx


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("cli")
    model = fx.probe_target()
    fx.save_target_dir(d / "target", model)
    fx.save_probe_checkpoint(d / "ck", model)
    interop.export_draft(d / "ck", "sglang", d / "sg")
    return d


def _broken(d, name="broken"):
    out = d / name
    if not out.exists():
        interop.export_draft(d / "ck", "sglang", out)
        cfg = json.loads((out / "config.json").read_text())
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 5]
        cfg.pop("draft_vocab_size")
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_exit_0_on_a_clean_export_and_1_on_a_broken_one(fixtures, capsys):
    assert main(["doctor", "--draft", str(fixtures / "sg")]) == 0
    assert "0 error(s)" in capsys.readouterr().out
    assert main(["doctor", "--draft", str(_broken(fixtures))]) == 1
    out = capsys.readouterr().out
    assert "ERROR   TAPS_SHIFTED" in out and "ERROR   LM_HEAD_REPLACED" in out and "fix:" in out


def test_usage_errors_exit_2(fixtures, capsys):
    sg, ck = str(fixtures / "sg"), str(fixtures / "ck")
    assert main(["doctor", "--draft", str(fixtures / "nowhere")]) == 2
    assert main(["doctor", "--draft", sg, "--probe", "2"]) == 2  # the probe runs the target: --target needed
    assert main(["doctor", "--draft", ck, "--engine-args", "--tp 2"]) == 2  # which engine?
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--draft", sg, "--engine", "trtllm"])
    assert e.value.code == 2
    assert "--probe" in capsys.readouterr().err


def test_the_draft_path_is_checked_before_the_target_loads(fixtures, capsys):
    """A mistyped --draft fails at once, naming --draft, not after the target's load (minutes for a large one)
    or with the target's own error."""
    capsys.readouterr()
    assert main(["doctor", "--draft", str(fixtures / "nowhere"), "--target", "no-such-target"]) == 2
    assert capsys.readouterr().err.strip().endswith("no such directory")
    weights = next((fixtures / "sg").glob("*.safetensors"))
    assert main(["doctor", "--draft", str(weights), "--target", "no-such-target"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"a file; pass the directory that holds it ({fixtures / 'sg'})" in err[0]


def test_a_layer_count_of_the_wrong_type_is_a_finding_not_a_traceback(fixtures, tmp_path, capsys):
    # SGLang's reading of the draft's layers (interop.sglang._params) used to int() it and crash the doctor
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(fixtures / "sg", bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_hidden_layers"] = "one"
    (bad / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["doctor", "--draft", str(bad)]) == 1
    assert "ERROR   CONFIG_TYPE: num_hidden_layers is 'one'" in capsys.readouterr().out


def test_json_report_shape(fixtures, capsys):
    code = main(["doctor", "--draft", str(_broken(fixtures)), "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert code == 1 and set(rep) >= {"findings", "probe"} and rep["probe"] is None
    for f in rep["findings"]:
        assert set(f) == {"code", "severity", "message", "fix"} and f["code"] in CODES


def test_apply_fixes_the_files_and_examines_again(fixtures, capsys):
    out = _broken(fixtures, "to-apply")
    assert main(["doctor", "--draft", str(out), "--apply"]) == 0
    text = capsys.readouterr()
    assert "applied 2 fix(es)" in text.err and "0 error(s)" in text.out


def test_probe_through_a_target_directory_with_a_tokenizer(fixtures, capsys):
    argv = ["doctor", "--draft", str(_broken(fixtures, "probe-broken")), "--target", str(fixtures / "target"),
            "--probe", "3", "--records", str(fixtures / "ck"), "--json"]
    assert main(argv) == 1
    rep = json.loads(capsys.readouterr().out)
    codes = [f["code"] for f in rep["findings"]]
    assert "PROBE_WIRING" in codes and rep["probe"]["prompts"] == 3
    assert rep["probe"]["wirings"][0]["taps"] == [1, 3, 6]


def test_the_documented_codes_are_the_codes():
    """docs/DOCTOR.md's table of checks is CODES, word for word (the registry is the one home)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "DOCTOR.md").read_text()
    for code, what in CODES.items():
        assert f"| `{code}` | {what} |" in doc, code
