"""native -> each format -> native is the identity (weights, taps, flags), per target family; refusals."""

import json

import pytest
import torch

from eaglewire import interop
from eaglewire.checkpoint import load_draft
from eaglewire.errors import UsageError
from eaglewire.interop.common import assert_same_draft
from eaglewire.interop.serve import SpecArgs
from eaglewire.taps import TapContract

from interop_tiny import DEEPSEEK, LLAMA, save_tiny

EXPORTS = [("sglang", None), ("sglang", "0.5.12"), ("vllm", None), ("speculators", None)]


def _roundtrip(tmp_path, fmt, version, taps, target, **flags):
    m = save_tiny(tmp_path / "ck", taps=taps, target=target, **flags)
    res = interop.export_draft(tmp_path / "ck", fmt, tmp_path / "out", engine_version=version)
    path, meta = interop.import_draft(tmp_path / "out", tmp_path / "back")
    back, bmeta = load_draft(path)
    assert_same_draft(m, back, "round trip")  # config (incl. every flag), d2t/t2d, logits of two steps
    for k, v in m.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    assert bmeta.contract == TapContract(target["num_layers"], taps)
    assert meta.source == fmt
    return res, json.loads((tmp_path / "out" / "config.json").read_text())


@pytest.mark.parametrize("fmt,version", EXPORTS)
@pytest.mark.parametrize("target,taps", [(LLAMA, (2, 4, 5)), (DEEPSEEK, (3, 31, 59)), (DEEPSEEK, (2, 30, 58))])
def test_roundtrip_is_identity(tmp_path, fmt, version, target, taps):
    _roundtrip(tmp_path, fmt, version, taps, target)


@pytest.mark.parametrize("fmt,version", [("sglang", None), ("vllm", None), ("speculators", None)])
def test_roundtrip_keeps_eagle31_flags(tmp_path, fmt, version):
    flags = dict(fc_norm=True, norm_output=True) if fmt == "sglang" else \
        dict(fc_norm=True, norm_output=True, norm_before_residual=True)
    _, cfg = _roundtrip(tmp_path, fmt, version, (2, 4, 5), LLAMA, **flags)
    for f, v in flags.items():
        assert cfg[f] is v


def test_roundtrip_norm_before_fc_and_two_layers(tmp_path):
    from interop_tiny import tiny_draft
    from eaglewire.checkpoint import save_draft
    from eaglewire.draft import DraftConfig, Eagle3Draft

    base = tiny_draft(norm_before_fc=True)
    cfg = DraftConfig(**{**base.config.to_dict(), "num_layers": 2})
    m = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    m.set_vocab(base.d2t, base.t2d)
    save_draft(m, tmp_path / "ck", contract=TapContract(8, (2, 4, 5)), target_fingerprint=LLAMA)
    for fmt in ("sglang", "vllm"):
        interop.export_draft(tmp_path / "ck", fmt, tmp_path / fmt)
        names = set(interop.common.read_dir(tmp_path / fmt).tensors)
        assert "input_norm.weight" in names and "fc_input_norm.weight" not in names
        back, _ = interop.load_any(tmp_path / fmt)
        assert_same_draft(m, back, fmt)
    # SGLang names the pre-attention norm of layers >= 1 hidden_norm (llama_eagle3.py, 0.5.12+).
    sg = set(interop.common.read_dir(tmp_path / "sglang").tensors)
    assert "layers.1.hidden_norm.weight" in sg and "midlayer.hidden_norm.weight" in sg


def test_kimi_seed_incident_ids_by_sglang_version(tmp_path):
    """Kimi-K2.5 (61 layers) trained on taps [3, 31, 59]: SGLang >= 0.5.13 (deepseek_v2.py first-id
    heuristic, PR #25454) needs ids [3, 31, 59]; older SGLang (unconditional +1) needs [2, 30, 58]."""
    save_tiny(tmp_path / "ck", taps=(3, 31, 59), target=DEEPSEEK)
    new = interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "new", engine_version="0.5.13")
    old = interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "old", engine_version="0.5.12.post1")
    assert new.ids == [3, 31, 59] and new.convention == "sglang-deepseek"
    assert old.ids == [2, 30, 58] and old.convention == "sglang-deepseek-legacy"
    assert json.loads((tmp_path / "new" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [3, 31, 59]
    # What each SGLang captures from the other's ids: the incident, reproduced.
    assert interop.read_engine_view(tmp_path / "old", "sglang", "0.5.13").captured_taps == [2, 30, 58]
    assert interop.read_engine_view(tmp_path / "new", "sglang", "0.5.13").captured_taps == [3, 31, 59]
    assert interop.read_engine_view(tmp_path / "old", "sglang", "0.5.12").captured_taps == [3, 31, 59]
    # vLLM's ids are the taps themselves, whatever the family.
    assert interop.export_draft(tmp_path / "ck", "vllm", tmp_path / "v").ids == [3, 31, 59]


def test_deepseek_default_taps_get_version_proof_ids(tmp_path):
    """Taps starting at 2 have ids starting at 1, read alike before and after PR #25454."""
    save_tiny(tmp_path / "ck", taps=(2, 30, 58), target=DEEPSEEK)
    res = interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "out")
    assert res.ids == [1, 29, 57]
    for v in ("0.5.11", "0.5.13", "latest"):
        assert interop.read_engine_view(tmp_path / "out", "sglang", v).captured_taps == [2, 30, 58]


@pytest.mark.parametrize("taps", [(0, 4, 5), (2, 4, 8)])
def test_sglang_refuses_uncapturable_taps_and_writes_nothing(tmp_path, taps):
    """SGLang never captures the embedding (llama.py: residual is None at layer 0) nor the last output."""
    save_tiny(tmp_path / "ck", taps=taps)
    with pytest.raises(UsageError, match="SGLang cannot capture"):
        interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary directory left either
    if 0 in taps:  # vLLM feeds the last layer's state at id 0 (taps.py _VLLM_ID0): refused too
        with pytest.raises(UsageError, match="not the embedding"):
            interop.export_draft(tmp_path / "ck", "vllm", tmp_path / "v")
        assert not (tmp_path / "v").exists()
    else:
        assert interop.export_draft(tmp_path / "ck", "vllm", tmp_path / "v").ids == list(taps)


@pytest.mark.parametrize("flags,version,match", [
    (dict(norm_before_residual=True), None, "norm_before_residual"),
    (dict(fc_norm=True), "0.5.11", "fc_norm"),
    (dict(norm_output=True), "0.5.11", "norm_output"),
    (dict(norm_before_fc=True), "0.5.16", "norm_before_fc"),
])
def test_sglang_refuses_flags_it_cannot_run(tmp_path, flags, version, match):
    save_tiny(tmp_path / "ck", **flags)
    with pytest.raises(UsageError, match=match):
        interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "out", engine_version=version)
    assert not (tmp_path / "out").exists()


def test_four_taps_old_sglang_refuses_and_vllm_gets_its_fc_width_written(tmp_path):
    """SGLang before 0.5.12 builds fc for 3 taps (llama_eagle3.py); vLLM 0.26.0 sizes it by the layer config's
    num_aux_hidden_states (llama_eagle3.py:176-182), which the speculators config carries over as the draft's
    config (transformers_utils/configs/speculators/base.py:61-65), else 3."""
    save_tiny(tmp_path / "ck", taps=(2, 3, 4, 5))
    with pytest.raises(UsageError, match="tap count"):
        interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "a", engine_version="0.5.11")
    assert interop.export_draft(tmp_path / "ck", "vllm", tmp_path / "b").ids == [2, 3, 4, 5]
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["transformer_layer_config"]["num_aux_hidden_states"] == 4
    view = interop.read_engine_view(tmp_path / "b", "vllm", num_layers=8)
    assert view.num_aux_expected == 4 and not [p for p in view.problems if "fc.weight" in p]
    del cfg["transformer_layer_config"]["num_aux_hidden_states"]  # what an export without it reads as
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    assert interop.read_engine_view(tmp_path / "b", "vllm", num_layers=8).num_aux_expected == 3
    assert interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "c").ids == [1, 2, 3, 4]
    assert interop.export_draft(tmp_path / "ck", "speculators", tmp_path / "d").ids == [2, 3, 4, 5]
    three = tmp_path / "three"
    save_tiny(tmp_path / "ck3")
    interop.export_draft(tmp_path / "ck3", "vllm", three)
    assert "num_aux_hidden_states" not in json.loads((three / "config.json").read_text())["transformer_layer_config"]


def test_export_refuses_a_non_empty_out_dir(tmp_path):
    save_tiny(tmp_path / "ck")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(UsageError, match="not empty"):
        interop.export_draft(tmp_path / "ck", "vllm", tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_serve_md_has_the_exact_commands(tmp_path):
    save_tiny(tmp_path / "ck")
    sg = interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "sg", spec=SpecArgs(num_steps=5),
                              target_path="my/target")
    text = (tmp_path / "sg" / "SERVE.md").read_text()
    assert text == sg.serve_text
    assert ("--speculative-algorithm EAGLE3 --speculative-draft-model-path " + str(tmp_path / "sg")) in text
    assert "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6" in text
    assert "--model-path my/target" in text and "[1, 3, 4]" in text and "[2, 4, 5]" in text
    interop.export_draft(tmp_path / "ck", "vllm", tmp_path / "v", spec=SpecArgs(num_steps=4))
    text = (tmp_path / "v" / "SERVE.md").read_text()
    spec = json.loads(text.split("--speculative-config '")[1].split("'")[0])
    assert spec == {"method": "eagle3", "model": str(tmp_path / "v"), "num_speculative_tokens": 4}


def test_spec_args_never_let_sglang_override_them():
    """SGLang forces num_draft_tokens = num_steps + 1 when topk == 1 (docs/CONVENTIONS.md section 5, the
    seed incident: steps 1 + topk 1 turned 16 draft tokens into 2)."""
    assert SpecArgs(num_steps=3).draft_tokens == 4
    with pytest.raises(UsageError, match="silently replace"):
        SpecArgs(num_steps=1, topk=1, draft_tokens=16)
    with pytest.raises(UsageError, match="draft-tokens"):
        SpecArgs(num_steps=3, topk=4)
    assert SpecArgs(num_steps=3, topk=4, draft_tokens=8).draft_tokens == 8


def test_spec_args_take_every_tree_sglang_can_build():
    """SGLang scores topk candidates at the first step and topk^2 at each later one, then verifies the best
    num_draft_tokens - 1 and the root (sglang/srt/speculative/eagle_utils.py, organize_draft_results): steps 6,
    topk 8 hold 8 + 5 x 64 = 328 candidates, so 64 draft tokens are a tree SGLang builds."""
    assert SpecArgs(num_steps=6, topk=8, draft_tokens=64).max_draft_tokens == 329
    assert SpecArgs(num_steps=2, topk=2, draft_tokens=7).draft_tokens == 7  # 2 + 4 candidates and the root
    with pytest.raises(UsageError, match=r"topk \+ \(num_steps - 1\) x topk\^2 \+ 1 = 7"):
        SpecArgs(num_steps=2, topk=2, draft_tokens=8)


def test_cli_export_and_import(tmp_path, capsys):
    import argparse

    from eaglewire.interop import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    m = save_tiny(tmp_path / "ck")
    args = parser.parse_args(["export", "--draft", str(tmp_path / "ck"), "--format", "sglang", "--out",
                              str(tmp_path / "sg")])
    assert args.func(args) == 0
    assert "--speculative-num-draft-tokens 4" in capsys.readouterr().out
    args = parser.parse_args(["import", "--from", str(tmp_path / "sg"), "--out", str(tmp_path / "back")])
    assert args.func(args) == 0
    assert "taps [2, 4, 5]" in capsys.readouterr().out
    assert_same_draft(m, load_draft(tmp_path / "back")[0], "cli")
