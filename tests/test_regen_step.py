"""benchmarks/regen_step.py: regeneration's batched step (data/batchgen.py) timed with each attention spelling."""

import json
import sys
from pathlib import Path

import pytest
import torch
from chat_target import make_target

from eaglewire.runtime import attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from regen_step import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_both_arms_step_the_same_greedy_tokens_and_the_sdpa_arm_uses_sdpa(tmp_path, monkeypatch, capsys):
    """In fp32 the two spellings make the same tokens; only the sdpa arm's steps call
    scaled_dot_product_attention with one row per query head (the prefill calls it in both); the module's
    setting is restored after each arm."""
    make_target(tmp_path / "t")
    sdpa, seen = torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: seen.append(a[0].shape[2]) or sdpa(*a, **kw))
    out = tmp_path / "r.json"
    assert main(["--target", str(tmp_path / "t"), "--device", "cpu", "--rows", "3,5", "--width", "8", "--steps", "4",
                 "--warmup", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["arm"]) for r in results] == [(3, "matmul"), (3, "sdpa"), (5, "matmul"), (5, "sdpa")]
    assert all(r["agree_with_first_arm"] == 1.0 and r["ms_per_step"] > 0 for r in results)
    # 8 layers x 5 steps (1 warm-up + 4) a row count, grouped rows: 2 query heads a K/V head, one row each
    assert seen.count(2) == 2 * 8 * 5
    assert attention.SDPA_MIN_HEADS is None
    assert "   5 sdpa" in capsys.readouterr().out


def test_bad_arguments_are_one_line_errors(capsys):
    assert main(["--attention", "matmul,flash"]) == 2
    assert main(["--rows", "8,x"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["regen_step: error: --attention matmul,flash: choose from matmul, sdpa",
                   "regen_step: error: --rows (each), --width, --steps and --warmup must be positive integers"]
