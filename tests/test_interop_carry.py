"""Round trips that lose nothing: a directory as the other tool writes it -> `eaglewire import` -> `export` to
the same format gives the same tensors, the same config fields its engine reads, and the same logits; a draft
with a sliding window keeps it. Each case names the writer it imitates."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglewire import interop
from eaglewire.checkpoint import load_draft, save_draft
from eaglewire.draft import DraftConfig, Eagle3Draft
from eaglewire.errors import UsageError
from eaglewire.interop.common import probe_logits
from eaglewire.taps import TapContract

from interop_tiny import LLAMA, tiny_draft
from tiny import tiny_model

# What vLLM builds the draft's layer from (transformers_utils/configs/speculators/algos.py update_eagle3 and
# model_executor/models/llama.py; the window through layer_types, llama.py:182-201) and what speculators'
# Eagle3DraftModel reads (models/eagle3/core.py), per level of the config.
LAYER_READ = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "num_hidden_layers", "vocab_size", "max_position_embeddings", "rope_parameters",
              "rope_theta", "rope_scaling", "rms_norm_eps", "hidden_act", "attention_bias", "mlp_bias",
              "tie_word_embeddings", "sliding_window", "layer_types", "use_sliding_window")
TOP_READ = ("speculators_model_type", "architectures", "draft_vocab_size", "target_hidden_size",
            "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "eagle_aux_hidden_state_layer_ids")


def _speculators_dir(path, verifier: str | None, window: int | None = 4, seed: int = 3):
    """A draft directory the way speculators 0.9.0's save_pretrained writes one for a draft built by its
    scripts/train.py create_transformer_layer_config on transformers 5: the layer config keeps RoPE in
    rope_parameters (no rope_theta), every draft layer "sliding_attention" with sliding_window and
    use_sliding_window, the verifier's path and architectures in speculators_config.verifier; weights under
    speculators' names (layers.0.*, fc, norm, lm_head, d2t, t2d), no embed_tokens (it is the verifier's)."""
    m = tiny_draft(seed=seed)
    layer = {"model_type": "llama", "architectures": None, "vocab_size": 128, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 8, "hidden_act": "silu", "max_position_embeddings": 256, "initializer_range": 0.02,
             "rms_norm_eps": 1e-6, "use_cache": True, "pretraining_tp": 1, "attention_bias": False,
             "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
             "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "dtype": "float32"}
    if window is not None:
        layer |= {"sliding_window": window, "use_sliding_window": True, "layer_types": ["sliding_attention"]}
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
           "transformer_layer_config": layer, "draft_vocab_size": 64, "norm_before_residual": False,
           "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": [2, 4, 5], "norm_before_fc": False,
           "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                        "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                  "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}}}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {k: v.contiguous() for k, v in m.state_dict().items() if k != "embed_tokens.weight"}
    save_file(tensors, str(path / "model.safetensors"))
    return cfg, tensors


def _verifier(tmp_path):
    """The verifier a speculators config names: a local model directory (tiny Llama, 8 layers)."""
    d = tmp_path / "verifier"
    tiny_model("llama").save_pretrained(d)
    return d


def _read(cfg: dict) -> tuple[dict, dict]:
    layer = cfg["transformer_layer_config"]
    return ({k: cfg.get(k) for k in TOP_READ} | {"verifier": cfg["speculators_config"]["verifier"]},
            {k: layer[k] for k in LAYER_READ if k in layer})


@pytest.mark.parametrize("window", [4, None])
def test_speculators_directory_round_trips_through_import_and_export(tmp_path, window):
    verifier = _verifier(tmp_path)
    cfg, tensors = _speculators_dir(tmp_path / "theirs", str(verifier), window)
    path, meta = interop.import_draft(tmp_path / "theirs", tmp_path / "ck")  # no --target: the recorded verifier
    assert meta.target_from.startswith(str(verifier)) and "verifier.name_or_path" in meta.target_from
    m, _ = load_draft(path)
    assert m.config.sliding_window == window
    interop.export_draft(path, "speculators", tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert _read(again) == _read(cfg)  # rope_parameters as written, the window, the verifier: all kept
    back = load_file(tmp_path / "again" / "model.safetensors")
    assert set(back) == set(tensors) | {"embed_tokens.weight"}  # the verifier's embedding, copied in on import
    assert torch.equal(back["embed_tokens.weight"], tiny_model("llama").get_input_embeddings().weight.detach())
    for k, v in tensors.items():
        assert torch.equal(back[k], v), k
    m2, _ = interop.load_any(tmp_path / "again")
    for a, b in zip(probe_logits(m), probe_logits(m2)):
        assert torch.equal(a, b)


def test_speculators_window_changes_logits_only_past_the_window(tmp_path):
    """The imported window is the one the draft attends with: a speculators draft with sliding_window 4 against the
    same weights imported without it (layer_types dropped): equal inside the window, different past it."""
    verifier = _verifier(tmp_path)
    _speculators_dir(tmp_path / "w", str(verifier), window=4)
    _speculators_dir(tmp_path / "full", str(verifier), window=None)
    windowed, _ = interop.load_any(tmp_path / "w")
    full, _ = interop.load_any(tmp_path / "full")
    assert windowed.config.sliding_window == 4 and full.config.sliding_window is None
    g = torch.Generator().manual_seed(0)
    ids, taps = torch.randint(0, 128, (1, 9), generator=g), torch.randn(1, 9, 96, generator=g)
    with torch.no_grad():
        a, _ = windowed(ids, windowed.fuse(taps), torch.arange(9)[None])
        b, _ = full(ids, full.fuse(taps), torch.arange(9)[None])
    assert torch.equal(a[0, :4], b[0, :4]) and not torch.allclose(a[0, 4:], b[0, 4:])


def test_a_recorded_target_that_is_not_here_is_named_and_not_fetched(tmp_path):
    _speculators_dir(tmp_path / "theirs", "some-org/some-model-not-on-this-disk")
    with pytest.raises(UsageError, match="pass --target"):  # the layer count is unknown without a target
        interop.import_draft(tmp_path / "theirs", tmp_path / "ck")
    path, meta = interop.import_draft(tmp_path / "theirs", tmp_path / "ck2",
                                      target=interop.TargetInfo(fingerprint=dict(LLAMA), embedding=torch.zeros(128, 32)))
    assert meta.target_from is None


def test_mixed_layer_types_are_refused_with_the_reason(tmp_path):
    """speculators' --full-attention-indices makes some layers full (scripts/train.py create_transformer_layer_config);
    an eaglewire draft has one window for all its layers, so such a draft is refused, naming the field."""
    cfg, tensors = _speculators_dir(tmp_path / "theirs", None)
    cfg["transformer_layer_config"] |= {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    (tmp_path / "theirs" / "config.json").write_text(json.dumps(cfg))
    second = {k.replace("layers.0.", "layers.1."): v.clone() for k, v in tensors.items()
              if k.startswith("layers.0.") and "hidden_norm" not in k}  # refused before any shape is checked
    save_file(tensors | second, str(tmp_path / "theirs" / "model.safetensors"))
    with pytest.raises(UsageError, match="transformer_layer_config: layer_types .* mixes sliding and full"):
        interop.load_any(tmp_path / "theirs", target=interop.TargetInfo(fingerprint=dict(LLAMA)))
    save_file(tensors, str(tmp_path / "theirs" / "model.safetensors"))
    cfg["transformer_layer_config"] |= {"num_hidden_layers": 1, "layer_types": ["sliding_attention"],
                                        "sliding_window": None}
    (tmp_path / "theirs" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="sliding_window is None"):
        interop.load_any(tmp_path / "theirs", target=interop.TargetInfo(fingerprint=dict(LLAMA)))


def _windowed_checkpoint(path, window=4):
    base = tiny_draft(seed=5)
    m = Eagle3Draft(DraftConfig(**{**base.config.to_dict(), "sliding_window": window})).eval()
    m.load_state_dict(base.state_dict())
    save_draft(m, path, contract=TapContract(8, (2, 4, 5)), target_fingerprint=dict(LLAMA))
    return m


@pytest.mark.parametrize("fmt", ["vllm", "speculators", "sglang"])
def test_a_windowed_native_draft_exports_its_window_and_reads_back(tmp_path, fmt):
    m = _windowed_checkpoint(tmp_path / "ck")
    res = interop.export_draft(tmp_path / "ck", fmt, tmp_path / "out")  # verified by reading back: same logits
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    layer = cfg.get("transformer_layer_config", cfg)
    assert (layer["sliding_window"], layer["layer_types"], layer["use_sliding_window"]) == \
        (4, ["sliding_attention"], True)
    back, _ = interop.load_any(tmp_path / "out")
    assert back.config.sliding_window == 4
    if fmt == "sglang":  # SGLang takes the window from its server flag alone (llama_eagle3.py)
        assert "--speculative-draft-window-size 4" in res.serve_text
    else:
        assert "window-size" not in res.serve_text


def test_no_window_exports_exactly_as_before(tmp_path):
    from interop_tiny import save_tiny

    save_tiny(tmp_path / "ck")
    interop.export_draft(tmp_path / "ck", "speculators", tmp_path / "out")
    layer = json.loads((tmp_path / "out" / "config.json").read_text())["transformer_layer_config"]
    assert not {"sliding_window", "layer_types", "use_sliding_window", "rope_parameters"} & set(layer)
    assert layer["rope_theta"] == 10000.0


SGLANG_READ = ("architectures", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "num_hidden_layers", "vocab_size", "max_position_embeddings", "rope_parameters",
               "rope_theta", "rope_scaling", "rms_norm_eps", "hidden_act", "tie_word_embeddings", "draft_vocab_size",
               "eagle_config")  # and the norm flags, compared as SGLang resolves them (absent = its default)


def test_specforge_hf_export_round_trips_into_the_sglang_format(tmp_path):
    """SpecForge's `export --to hf` directory as it writes one under transformers 5 (a LlamaConfig's to_dict:
    RoPE in rope_parameters, no rope_theta; midlayer.*, nested ids, d2t/t2d, no embedding; cf.
    tests/test_peers_specforge.py for the real exporter) -> import -> export --format sglang: SGLang reads the same
    config fields and the same tensors (names through SGLang's own loading rules), and the draft the same logits."""
    from eaglewire.interop.readers import read_engine_view

    m = tiny_draft(seed=7)
    layer = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 1, "vocab_size": 128,
             "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
             "mlp_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02, "pad_token_id": None,
             "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": 64,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}}
    src = tmp_path / "specforge"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    save_file({k.replace("layers.0.", "midlayer."): v.contiguous() for k, v in m.state_dict().items()
               if k != "embed_tokens.weight"}, str(src / "model.safetensors"))
    target = interop.TargetInfo(fingerprint=dict(LLAMA), embedding=m.embed_tokens.weight.detach().clone())
    path, meta = interop.import_draft(src, tmp_path / "ck", target=target)
    assert load_draft(path)[0].config.rope_theta == 500000.0
    interop.export_draft(path, "sglang", tmp_path / "out")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: out.get(k) for k in SGLANG_READ} == {k: cfg.get(k) for k in SGLANG_READ}
    theirs, ours = (read_engine_view(d, "sglang", model_type="llama", num_layers=8) for d in (src, tmp_path / "out"))
    assert ours.captured_taps == theirs.captured_taps == [2, 4, 5]
    assert {f: v.effective for f, v in ours.norm_flags.items()} == {f: v.effective for f, v in theirs.norm_flags.items()}
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    kept_a = {p: a[n] for n, p in theirs.weights_kept.items()}
    kept_b = {p: b[n] for n, p in ours.weights_kept.items()}
    assert set(kept_b) == set(kept_a) | {"model.embed_tokens.weight"}  # SGLang takes the target's (SERVE.md says so)
    assert all(torch.equal(kept_a[p], kept_b[p]) for p in kept_a)
    first, _ = interop.load_any(src, target=target)
    again, _ = interop.load_any(tmp_path / "out")
    for x, y in zip(probe_logits(first), probe_logits(again)):
        assert torch.equal(x, y)


def test_the_import_command_says_which_target_it_used(tmp_path, capsys):
    from eaglewire.cli import main

    verifier = _verifier(tmp_path)
    _speculators_dir(tmp_path / "theirs", str(verifier))
    assert main(["import", "--from", str(tmp_path / "theirs"), "--out", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert f"target {verifier} (config.json speculators_config.verifier.name_or_path" in out
