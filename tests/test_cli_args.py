"""`train --resume` refuses to start a fresh run in silence."""

import pytest

from eaglewire import cli


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
