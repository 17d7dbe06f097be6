"""Importing every ecosystem's layout (built here from each project's documented names and keys) and
refusing to guess where the files alone do not say which convention wrote them."""

import json

import pytest
import torch
from safetensors.torch import save_file

from eaglewire import interop
from eaglewire.checkpoint import load_draft
from eaglewire.errors import EaglewireError, UsageError
from eaglewire.interop.common import assert_same_draft, hf_fields
from eaglewire.taps import TapContract

from interop_tiny import DEEPSEEK, LLAMA, save_tiny, tiny_draft
from tiny import tiny_model


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny llama target (8 layers, hidden 32, vocab 128) saved as an HF directory."""
    path = tmp_path_factory.mktemp("target")
    tiny_model("llama").save_pretrained(path)
    return path


def _with_target_embedding(m, target_dir):
    from transformers import AutoModelForCausalLM

    m.load_target_embedding(AutoModelForCausalLM.from_pretrained(target_dir).model.embed_tokens.weight)
    return m


def _write(path, cfg, tensors, bin_file=False):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    if bin_file:
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def _sd(m, rename=lambda k: k, drop=("embed_tokens.weight",)):
    return {rename(k): v for k, v in m.state_dict().items() if k not in drop}


def _mid(k):
    return k.replace("layers.0.", "midlayer.")


def specforge_dir(path, m, ids, **extra):
    """SpecForge configs/*.json + export/to_sglang.py: midlayer.*, nested ids, no embedding."""
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **hf_fields(m.config), "draft_vocab_size": 64,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}, **extra}
    return _write(path, cfg, _sd(m, _mid))


def test_specforge_llama_needs_target_for_embedding_and_layers(tmp_path, target_dir):
    """SpecForge ids are the 0-based OUTPUT of layer j (model_providers.py): ids [1, 3, 4] = taps [2, 4, 5];
    SGLang (llama.py +1) reads them the same, so no --source is needed."""
    m = _with_target_embedding(tiny_draft(), target_dir)
    d = specforge_dir(tmp_path / "sf", m, [1, 3, 4])
    with pytest.raises(UsageError, match="--target"):
        interop.load_any(d)
    path, meta = interop.import_draft(d, tmp_path / "back", target=str(target_dir))
    back, bmeta = load_draft(path)
    assert_same_draft(m, back, "specforge import")
    assert bmeta.contract == TapContract(8, (2, 4, 5))
    assert bmeta.target["weights_hash"] and bmeta.target["num_layers"] == 8  # the full target fingerprint


def test_specforge_defaults_when_ids_absent(tmp_path, target_dir):
    """resolve_eagle_capture_layers: no ids -> [1, N//2-1, N-4], i.e. taps {2, N//2, N-3}."""
    m = _with_target_embedding(tiny_draft(), target_dir)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **hf_fields(m.config), "draft_vocab_size": 64}
    d = _write(tmp_path / "sf", cfg, _sd(m, _mid))
    _, meta = interop.load_any(d, source="specforge", target=str(target_dir))
    assert meta.contract.taps == (2, 4, 5)


def test_deepseek_ids_not_starting_at_one_need_source(tmp_path):
    """For DeepSeek-family targets SpecForge ids [2, 30, 58] mean taps [3, 31, 59]; SGLang >= 0.5.13
    reads them as taps [2, 30, 58]: the files cannot tell, so eaglewire asks."""
    m = tiny_draft()
    d = specforge_dir(tmp_path / "sf", m, [2, 30, 58])
    t = interop.TargetInfo(fingerprint=dict(DEEPSEEK), embedding=m.embed_tokens.weight)
    with pytest.raises(UsageError, match="--source"):
        interop.load_any(d, target=t)
    _, meta = interop.load_any(d, source="specforge", target=t)
    assert meta.contract.taps == (3, 31, 59)
    with pytest.raises(UsageError, match="--engine-version"):
        interop.load_any(d, source="sglang", target=t)
    assert interop.load_any(d, source="sglang", engine_version="0.5.13", target=t)[1].contract.taps == (2, 30, 58)
    assert interop.load_any(d, source="sglang", engine_version="0.5.12", target=t)[1].contract.taps == (3, 31, 59)


def test_norm_output_means_different_things(tmp_path):
    """SpecForge llama3_eagle.py: norm_output = 'norm before lm_head' (the next step gets the pre-norm state);
    SGLang >= 0.5.12 llama_eagle3.py: norm_output = feed the post-norm state back. Same file, two drafts."""
    m = tiny_draft()
    d = specforge_dir(tmp_path / "sf", m, [1, 3, 4], norm_output=True)
    t = interop.TargetInfo(fingerprint=dict(LLAMA), embedding=m.embed_tokens.weight)
    with pytest.raises(UsageError, match="norm_output"):
        interop.load_any(d, target=t)
    assert interop.load_any(d, source="specforge", target=t)[0].config.norm_output is False
    assert interop.load_any(d, source="sglang", target=t)[0].config.norm_output is True


def test_eagle_reference_pickled_weights_fixed_taps(tmp_path, target_dir):
    """SafeAILab/EAGLE: LlamaForCausalLM config + draft_vocab_size (traineagle3/config.json), weights in
    pytorch_model.bin (ea_model.py), taps hard-coded as inputs of layers 2, N//2, N-3 (modeling_llama_kv.py)."""
    m = _with_target_embedding(tiny_draft(), target_dir)
    cfg = {"architectures": ["LlamaForCausalLM"], **hf_fields(m.config), "draft_vocab_size": 64}
    d = _write(tmp_path / "eagle", cfg, _sd(m, _mid), bin_file=True)
    back, meta = interop.load_any(d, target=str(target_dir))
    assert meta.source == "eagle" and meta.contract.taps == (2, 4, 5)
    assert_same_draft(m, back, "eagle import")


def test_modelopt_frequency_ordered_d2t_without_t2d(tmp_path):
    """ModelOpt hf_spec_export.py: layers.0.* names, d2t only (frequency order), nested ids = output of
    layer j (hf_eagle.py forward hooks). t2d is rebuilt with vocab.t2d_from_d2t."""
    m = tiny_draft()
    order = torch.randperm(64)  # frequency order, not target-id order
    ids_by_freq = (m.d2t + torch.arange(64))[order]
    with torch.no_grad():
        m.lm_head.weight.copy_(m.lm_head.weight[order])
    m.d2t.copy_(ids_by_freq - torch.arange(64))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **hf_fields(m.config), "draft_vocab_size": 64,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True,
                            "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True}}
    d = _write(tmp_path / "mo", cfg, _sd(m, drop=("embed_tokens.weight", "t2d")))
    back, meta = interop.load_any(d, target=interop.TargetInfo(fingerprint=dict(LLAMA),
                                                               embedding=m.embed_tokens.weight))
    assert meta.source == "modelopt" and meta.contract.taps == (2, 4, 5)
    assert any("t2d_from_d2t" in n for n in meta.notes)
    assert torch.equal(back.t2d, m.t2d) and torch.equal(back.d2t, m.d2t)
    assert_same_draft(m, back, "modelopt import")


def test_vllm_plain_vs_specforge_top_level_ids_need_source(tmp_path):
    """A LlamaForCausalLMEagle3 config with TOP-LEVEL ids: vLLM (eagle3_utils.py) reads id j as tap j, a
    SpecForge-style trainer as tap j+1. eaglewire refuses to guess."""
    m = tiny_draft()
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **hf_fields(m.config), "draft_vocab_size": 64,
           "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    d = _write(tmp_path / "plain", cfg, _sd(m, _mid, drop=()))
    t = interop.TargetInfo(fingerprint=dict(LLAMA))
    with pytest.raises(UsageError, match="--source"):
        interop.load_any(d, target=t)
    assert interop.load_any(d, source="vllm", target=t)[1].contract.taps == (2, 4, 5)
    assert interop.load_any(d, source="specforge", target=t)[1].contract.taps == (3, 5, 6)


def test_vllm_plain_architecture_is_unambiguous(tmp_path):
    """llama_eagle3.py Eagle3LlamaForCausalLM: a plain config's norm_before_residual is getattr(.., False)."""
    m = tiny_draft()
    cfg = {"architectures": ["Eagle3LlamaForCausalLM"], **hf_fields(m.config), "draft_vocab_size": 64,
           "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    d = _write(tmp_path / "plain", cfg, _sd(m, drop=()))
    back, meta = interop.load_any(d, target=interop.TargetInfo(fingerprint=dict(LLAMA)))
    assert meta.source == "vllm" and meta.contract.taps == (2, 4, 5)
    assert_same_draft(m, back, "vllm plain import")


def test_speculators_config_without_norm_before_residual_needs_source(tmp_path):
    """vllm speculators/algos.py update_eagle3 defaults norm_before_residual to True; the speculators
    library's Eagle3SpeculatorConfig to False: an absent flag means two different drafts."""
    save_tiny(tmp_path / "ck")
    interop.export_draft(tmp_path / "ck", "speculators", tmp_path / "sp")
    cfg = json.loads((tmp_path / "sp" / "config.json").read_text())
    del cfg["norm_before_residual"], cfg["eaglewire"]
    (tmp_path / "sp" / "config.json").write_text(json.dumps(cfg))
    t = interop.TargetInfo(fingerprint=dict(LLAMA))
    with pytest.raises(UsageError, match="--source"):
        interop.load_any(tmp_path / "sp", target=t)
    assert interop.load_any(tmp_path / "sp", source="vllm", target=t)[0].config.norm_before_residual is True
    assert interop.load_any(tmp_path / "sp", source="speculators", target=t)[0].config.norm_before_residual is False


def test_export_edited_afterwards_is_caught(tmp_path):
    save_tiny(tmp_path / "ck")
    interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "sg")
    cfg = json.loads((tmp_path / "sg" / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    (tmp_path / "sg" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EaglewireError, match="edited after export"):
        interop.load_any(tmp_path / "sg")


def test_target_must_match_the_recorded_one(tmp_path, target_dir):
    save_tiny(tmp_path / "ck", taps=(3, 31, 59), target=DEEPSEEK)
    interop.export_draft(tmp_path / "ck", "vllm", tmp_path / "v")
    with pytest.raises(UsageError, match="another target"):
        interop.load_any(tmp_path / "v", target=str(target_dir))


def test_detect_names_the_reason(tmp_path):
    save_tiny(tmp_path / "ck")
    interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "sg")
    sources, why = interop.detect(interop.common.read_dir(tmp_path / "sg"))
    assert sources == ["sglang"] and "eaglewire" in why
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "junk" / "model.safetensors"))
    with pytest.raises(UsageError, match="not recognised"):
        interop.load_any(tmp_path / "junk")


def test_agreeing_readings_are_named_in_the_notes(tmp_path):
    m = tiny_draft()
    d = specforge_dir(tmp_path / "sf", m, [1, 3, 4])
    _, meta = interop.load_any(d, target=interop.TargetInfo(fingerprint=dict(LLAMA), embedding=m.embed_tokens.weight))
    assert any("sglang (sglang)" in n and "specforge (specforge)" in n for n in meta.notes)
