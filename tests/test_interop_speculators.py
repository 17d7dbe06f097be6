"""Proof against the real client: vllm-project/speculators 0.9.0 (its own Eagle3DraftModel, in its own
venv, see speculators_env.py) loads our speculators export and computes the same logits as our draft,
and a checkpoint written by speculators' own save_pretrained imports into ours with the same logits.

All speculators work runs in ONE subprocess (speculators_probe.py batch): importing it takes seconds.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglewire import interop
from eaglewire.checkpoint import load_draft

from interop_tiny import LLAMA, draft_steps, save_tiny
from speculators_env import run_probe, speculators_python
from tiny import tiny_model

ATOL = 1e-5  # fp32; HF eager attention vs SDPA differ by ~1e-7
FLAG_NAMES = ("norm_before_residual", "fc_norm", "norm_output", "norm_before_fc")
OURS = {"eagle3": {}, "eagle3.1": dict(norm_before_residual=True, fc_norm=True, norm_output=True),
        "norm_before_fc": dict(norm_before_fc=True)}
THEIRS = {"plain": dict(norm_before_residual=False, ids=[2, 4, 5]),
          "flags": dict(norm_before_residual=True, norm_before_fc=True, norm_output=True, ids=[1, 3, 7])}


def _inputs(path, width, T=7):
    g = torch.Generator().manual_seed(7)
    inputs = {"taps": torch.randn(1, T, width, generator=g), "input_ids": torch.randint(0, 128, (1, T), generator=g),
              "position_ids": torch.arange(T)[None]}
    save_file(inputs, str(path))
    return inputs


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """Every case prepared here, then one speculators process runs them all: name -> (dir, info)."""
    py = speculators_python()
    root = tmp_path_factory.mktemp("speculators")
    verifier = root / "verifier"  # from_pretrained loads its verifier's embedding, norm and lm_head
    tiny_model("llama").save_pretrained(verifier)
    jobs, cases = {}, {}
    for name, flags in OURS.items():
        d = root / f"ours-{name}"
        d.mkdir()
        m = save_tiny(d / "ck", **flags)
        interop.export_draft(d / "ck", "speculators", d / "sp", target_path=str(verifier))
        cases[name] = (d, m, _inputs(d / "in.safetensors", m.config.fc_in_features))
        jobs[name] = ["run", str(d / "sp"), str(d / "in.safetensors"), str(d / "out.safetensors")]
    for name, flags in THEIRS.items():
        d = root / f"theirs-{name}"
        d.mkdir()
        cases[name] = (d, None, _inputs(d / "in.safetensors", 3 * 32))
        jobs[name] = ["write", str(d / "theirs"), str(d / "in.safetensors"), str(d / "out.safetensors"),
                      json.dumps(flags)]
    (root / "jobs.json").write_text(json.dumps(jobs))
    infos = json.loads(run_probe(py, "batch", root / "jobs.json").strip().splitlines()[-1])
    return {k: (*cases[k], infos[k]) for k in cases}


def _same_logits(ours, theirs):
    for step, (a, b) in enumerate(zip(ours, (theirs["logits0"], theirs["logits1"]))):
        assert torch.allclose(a, b, atol=ATOL, rtol=0), f"TTT step {step}: max |diff| {(a - b).abs().max()}"


@pytest.mark.parametrize("name", list(OURS))
def test_speculators_loads_our_export_with_the_same_logits(probed, name):
    d, m, inputs, info = probed[name]
    assert info["class"] == "Eagle3DraftModel" and info["layer_ids"] == [2, 4, 5]
    assert {f: info[f] for f in FLAG_NAMES} == {f: getattr(m.config, f) for f in FLAG_NAMES}
    theirs = load_file(d / "out.safetensors")
    _same_logits(draft_steps(m, inputs["taps"], inputs["input_ids"], inputs["position_ids"]), theirs)
    assert torch.equal(theirs["d2t"], m.d2t) and torch.equal(theirs["t2d"], m.t2d)


@pytest.mark.parametrize("name", list(THEIRS))
def test_speculators_own_checkpoint_imports_with_the_same_logits(probed, name, tmp_path):
    d, _, inputs, info = probed[name]
    flags = THEIRS[name]
    assert info["class"] == "Eagle3DraftModel"
    path, meta = interop.import_draft(d / "theirs", tmp_path / "ours", target=interop.TargetInfo(fingerprint=dict(LLAMA)))
    assert meta.source in ("speculators", "vllm") and list(meta.contract.taps) == flags["ids"]
    m, _ = load_draft(path)
    for f in FLAG_NAMES:
        assert getattr(m.config, f) is flags.get(f, False), f
    theirs = load_file(d / "out.safetensors")
    _same_logits(draft_steps(m, inputs["taps"], inputs["input_ids"], inputs["position_ids"]), theirs)
