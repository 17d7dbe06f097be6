"""The native draft checkpoint: round trip, atomic writes, and precise errors on bad directories."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglewire import checkpoint as ck
from eaglewire.checkpoint import load_draft, load_meta, save_draft, tap_stats
from eaglewire.draft import DraftConfig, Eagle3Draft
from eaglewire.errors import EaglewireError, UsageError
from eaglewire.taps import TapContract
from eaglewire.vocab import select_draft_vocab

CONTRACT = TapContract(num_layers=8, taps=(2, 4, 5))
FINGERPRINT = {"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 8, "hidden_size": 32,
               "vocab_size": 97, "weights_hash": "0123456789abcdef", "tokenizer_hash": None}


def make_model(**kw):
    torch.manual_seed(0)
    cfg = DraftConfig(**(dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                              vocab_size=97, draft_vocab_size=40, num_layers=2, norm_before_residual=True,
                              fc_norm=True, norm_output=True) | kw))
    m = Eagle3Draft(cfg)
    m.set_vocab(*select_draft_vocab(torch.randint(0, 100, (97,)), 40, always=[2]))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return m.eval()


def outputs(m):
    g = torch.Generator().manual_seed(1)
    taps = torch.randn(2, 6, 96, generator=g)
    ids = torch.randint(0, 97, (2, 6), generator=g)
    with torch.no_grad():
        return m(ids, m.fuse(taps), torch.arange(6).expand(2, 6))


@pytest.fixture
def saved(tmp_path):
    m = make_model()
    out = save_draft(m, tmp_path / "draft", contract=CONTRACT, target_fingerprint=FINGERPRINT,
                     data_manifest_hash="feed", training={"lr": 1e-4, "ttt_steps": 7},
                     metrics={"val_acc": torch.tensor(0.75), "bad": float("nan")},
                     tap_stats=tap_stats(torch.randn(50, 96), 3))
    return m, out


def test_round_trip_gives_identical_outputs_and_metadata(saved, tmp_path):
    m, out = saved
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert os.listdir(tmp_path) == ["draft"]  # no temporary directories left behind
    loaded, meta = load_draft(out)
    for a, b in zip(outputs(m), outputs(loaded)):
        assert torch.equal(a, b)
    assert meta.config == m.config and meta.contract == CONTRACT and meta.target == FINGERPRINT
    assert (meta.data_manifest_hash, meta.training, meta.metrics) == ("feed", {"lr": 1e-4, "ttt_steps": 7},
                                                                     {"val_acc": 0.75, "bad": None})
    assert meta.tap_stats["num_tokens"] == 50 and len(meta.tap_stats["per_tap"]) == 3
    raw = json.loads((out / "config.json").read_text())
    assert list(raw) == ["format", "format_version", "eaglewire_version", "git_commit", "draft", "taps", "target",
                         "data_manifest_hash", "training", "metrics", "tap_stats"]
    assert raw["format"] == "eaglewire-draft" and raw["format_version"] == 1
    assert raw["git_commit"] is None or len(raw["git_commit"]) == 40
    assert raw["draft"]["norm_before_residual"] and raw["draft"]["fc_norm"] and raw["draft"]["norm_output"]
    assert raw["taps"]["in_conventions"]["sglang"] == [1, 3, 4]
    assert torch.equal(loaded.d2t, m.d2t) and torch.equal(loaded.t2d, m.t2d)
    assert not loaded.embed_tokens.weight.requires_grad


def test_load_casts_floating_weights_only(saved):
    _, out = saved
    model, _ = load_draft(out, dtype=torch.bfloat16)
    assert model.fc.weight.dtype == torch.bfloat16 and model.d2t.dtype == torch.long and model.t2d.dtype == torch.bool
    assert model._inv_freq.dtype == torch.float32  # RoPE frequencies stay fp32


def test_draft_narrower_than_target_round_trips(tmp_path):
    m = make_model(target_hidden_size=48, fc_norm=False, norm_before_fc=True)
    out = save_draft(m, tmp_path / "d", contract=CONTRACT, target_fingerprint=FINGERPRINT | {"hidden_size": 48})
    loaded, _ = load_draft(out)
    taps = torch.randn(1, 3, 144)
    assert torch.equal(loaded.fuse(taps), m.fuse(taps)) and loaded.embed_tokens.weight.requires_grad


def test_overwrites_a_checkpoint_but_not_other_directories(saved, tmp_path):
    m, out = saved
    save_draft(make_model(num_layers=1), out, contract=CONTRACT, target_fingerprint=FINGERPRINT)
    assert load_meta(out).config.num_layers == 1
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    with pytest.raises(UsageError, match="not an eaglewire draft checkpoint; refusing"):
        save_draft(m, other, contract=CONTRACT, target_fingerprint=FINGERPRINT)
    assert (other / "todo.txt").read_text() == "keep me"


def test_a_failed_write_leaves_nothing_that_looks_complete(saved, tmp_path, monkeypatch):
    m, out = saved

    def half_written(tensors, path, metadata=None):
        open(path, "wb").write(b"\0" * 10)
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", half_written)
    with pytest.raises(OSError, match="disk full"):
        save_draft(m, tmp_path / "new", contract=CONTRACT, target_fingerprint=FINGERPRINT)
    assert sorted(os.listdir(tmp_path)) == ["draft"]


def test_a_failed_replace_restores_the_previous_checkpoint(saved, tmp_path, monkeypatch):
    m, out = saved
    real, calls = os.replace, []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # moving the new checkpoint into place
            raise OSError("interrupted")
        real(src, dst)

    monkeypatch.setattr(os, "replace", flaky)  # files.atomic_dir renames
    with pytest.raises(OSError, match="interrupted"):
        save_draft(make_model(num_layers=1), out, contract=CONTRACT, target_fingerprint=FINGERPRINT)
    monkeypatch.undo()
    assert load_meta(out).config.num_layers == 2 and sorted(os.listdir(tmp_path)) == ["draft"]


def test_save_refuses_a_contract_or_fingerprint_that_disagrees(tmp_path):
    m = make_model()
    with pytest.raises(UsageError, match="2 taps .* num_taps=3"):
        save_draft(m, tmp_path / "a", contract=TapContract(8, (2, 5)), target_fingerprint=FINGERPRINT)
    with pytest.raises(UsageError, match="target.vocab_size is 98 but draft.vocab_size is 97"):
        save_draft(m, tmp_path / "a", contract=CONTRACT, target_fingerprint=FINGERPRINT | {"vocab_size": 98})
    assert not (tmp_path / "a").exists()


def _edit_config(out, fn):
    raw = json.loads((out / "config.json").read_text())
    fn(raw)
    (out / "config.json").write_text(json.dumps(raw))


def _edit_tensors(out, fn):
    t = load_file(str(out / "model.safetensors"))
    fn(t)
    save_file(t, str(out / "model.safetensors"))


CONFIG_BREAKS = [
    (lambda r: r.update(format="sglang"), "config.json: format: is 'sglang'"),
    (lambda r: r.update(format_version=2), "config.json: format_version: is 2"),
    (lambda r: r.pop("taps"), "config.json: taps: missing"),
    (lambda r: r["draft"].update(midlayer=True), r"config.json: draft: .*unknown field\(s\) \['midlayer'\]"),
    (lambda r: r["draft"].update(num_layers=0), "config.json: draft: .*num_layers must be a positive integer, got 0"),
    (lambda r: r["taps"].update(taps=[2, 4]), r"config.json: taps: 2 taps \[2, 4\] but draft.num_taps is 3"),
    (lambda r: r["taps"].update(taps=[2, 4, 9]), r"config.json: taps: .*taps \[9\] out of range"),
    (lambda r: r["target"].update(hidden_size=64), "config.json: target.hidden_size is 64"),
]


@pytest.mark.parametrize("edit,match", CONFIG_BREAKS)
def test_broken_config_json_names_file_and_field(saved, edit, match):
    _, out = saved
    _edit_config(out, edit)
    with pytest.raises(UsageError, match=match):
        load_draft(out)


def _absolute_d2t(t):
    t["d2t"] = t["d2t"] + torch.arange(40)


TENSOR_BREAKS = [
    (lambda t: t.pop("lm_head.weight"), r"missing \['lm_head.weight'\], unexpected none"),
    (lambda t: t.update({"midlayer.hidden_norm.weight": torch.ones(32)}),
     r"missing none, unexpected \['midlayer.hidden_norm.weight'\]"),
    (lambda t: t.update({"fc.weight": torch.zeros(32, 64)}),
     r"fc.weight has shape \(32, 64\), config.json says \(32, 96\) = \(hidden_size, num_taps 3 x target_hidden"),
    (lambda t: t.update({"lm_head.weight": torch.zeros(41, 32)}), r"lm_head.weight \(41, 32\) != \(40, 32\)"),
    (_absolute_d2t, "d2t/t2d: d2t holds absolute target ids"),
]


@pytest.mark.parametrize("edit,match", TENSOR_BREAKS)
def test_mismatched_tensors_name_the_file_and_the_tensors(saved, edit, match):
    _, out = saved
    _edit_tensors(out, edit)
    with pytest.raises(EaglewireError, match=match) as e:
        load_draft(out)
    assert "model.safetensors" in str(e.value)


def test_missing_or_unreadable_files(saved, tmp_path):
    _, out = saved
    with pytest.raises(UsageError, match="no config.json"):
        load_draft(tmp_path)
    (out / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UsageError, match="model.safetensors: unreadable safetensors"):
        load_draft(out / "config.json")
    (out / "model.safetensors").unlink()
    with pytest.raises(UsageError, match="never pickle"):
        load_draft(out)
    (out / "config.json").write_text("{oops")
    with pytest.raises(UsageError, match="config.json: unreadable JSON"):
        load_meta(out)


def test_tap_stats_per_tap():
    first = torch.full((40, 8), -2.0)
    second = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    s = tap_stats(torch.cat([first, second], -1).reshape(4, 10, 16), 2)
    assert (s["num_tokens"], s["hidden_size"]) == (40, 8)
    assert s["per_tap"][0] == {"mean": -2.0, "std": 0.0, "rms": 2.0, "abs_max": 2.0, "token_rms_mean": 2.0}
    p = s["per_tap"][1]
    assert p["mean"] == pytest.approx(second.mean().item(), abs=1e-6)
    assert p["std"] == pytest.approx(second.std(unbiased=False).item(), rel=1e-5)
    assert p["rms"] == pytest.approx(second.pow(2).mean().sqrt().item(), rel=1e-5)
    assert p["abs_max"] == pytest.approx(second.abs().max().item())
    with pytest.raises(UsageError, match="not a multiple of 3 taps"):
        tap_stats(torch.zeros(2, 16), 3)
