"""SGLang's loader rules, one test each, read from the sglang wheels' source (SGLang needs CUDA, so
these check eaglewire's reading of a directory against each rule instead of running SGLang)."""

import json

import pytest
from safetensors.torch import save_file

from eaglewire import interop
from eaglewire.errors import UsageError
from eaglewire.interop import sglang
from eaglewire.taps import SGLANG_HEURISTIC_SINCE

from interop_tiny import DEEPSEEK, save_tiny


def _export(tmp_path, **kw):
    save_tiny(tmp_path / "ck", **kw)
    interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "sg")
    return tmp_path / "sg"


def _edit(path, fn=None, rename=None):
    cfg = json.loads((path / "config.json").read_text())
    if fn:
        fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    if rename:
        dd = interop.common.read_dir(path)
        save_file({rename(k): v for k, v in dd.tensors.items()}, str(path / "model.safetensors"))


def test_llama_eagle3_load_weights_drops_layers0_names_before_0_5_12(tmp_path):
    """models/llama_eagle3.py load_weights: names not among the parameters are skipped silently; before
    0.5.12 the first layer is `midlayer`, so `layers.0.*` is dropped (0.5.12 added the rename)."""
    sg = _export(tmp_path)
    _edit(sg, rename=lambda k: k.replace("midlayer.", "layers.0."))
    old = interop.read_engine_view(sg, "sglang", "0.5.11")
    assert "layers.0.self_attn.q_proj.weight" in old.weights_dropped
    assert "midlayer.self_attn.q_proj.weight" in old.weights_missing
    new = interop.read_engine_view(sg, "sglang", "0.5.12")
    assert new.weights_kept["layers.0.self_attn.q_proj.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert not new.weights_missing


def test_llama_eagle3_load_weights_d2t_used_t2d_skipped(tmp_path):
    """models/llama_eagle3.py load_weights: d2t becomes hot_token_id, t2d is skipped."""
    view = interop.read_engine_view(_export(tmp_path), "sglang")
    assert view.weights_kept["d2t"] == "hot_token_id"
    assert "t2d" in view.weights_dropped


def test_export_to_sglang_required_keys(tmp_path):
    """SpecForge specforge/export/to_sglang.py: fc.weight, norm.weight, lm_head.weight, t2d, d2t required."""
    sg = _export(tmp_path)
    assert not interop.read_engine_view(sg, "sglang").weights_missing
    dd = interop.common.read_dir(sg)
    save_file({k: v for k, v in dd.tensors.items() if k != "t2d"}, str(sg / "model.safetensors"))
    assert interop.read_engine_view(sg, "sglang").weights_missing == ["t2d"]


def test_model_runner_reads_only_nested_ids(tmp_path):
    """model_executor/model_runner.py (spec_aux_hidden_state.py in 0.5.23): ids come only from the nested
    eagle_config inside a try/except; top-level ids are ignored and the default taps are used."""
    sg = _export(tmp_path, taps=(3, 4, 6))

    def move_to_top(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = cfg.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]
    _edit(sg, move_to_top)
    view = interop.read_engine_view(sg, "sglang", model_type="llama", num_layers=8)
    assert view.ids is None and view.default_used
    assert view.ids_ignored == {"eagle_aux_hidden_state_layer_ids (top level)": [2, 3, 5]}
    assert view.captured_taps == [2, 4, 5]  # SGLang's default for N = 8, not the trained taps [3, 4, 6]


def test_llama_py_adds_one_but_not_in_the_default_branch(tmp_path):
    """models/llama.py set_eagle3_layers_to_capture: explicit ids -> val + 1; None -> [2, N//2, N-3]
    as-is. Writing the default ids explicitly shifts every tap (sglang #23569)."""
    sg = _export(tmp_path, taps=(3, 4, 6))
    _edit(sg, lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}))
    assert interop.read_engine_view(sg, "sglang").captured_taps == [3, 5, 6]
    _edit(sg, lambda c: c.pop("eagle_config"))
    assert interop.read_engine_view(sg, "sglang", model_type="llama", num_layers=8).captured_taps == [2, 4, 5]


@pytest.mark.parametrize("version,ids,taps", [("0.5.12", [3, 31, 59], [4, 32, 60]), ("0.5.13", [3, 31, 59], [3, 31, 59]),
                                              ("0.5.13", [1, 29, 57], [2, 30, 58]), ("0.5.11", [1, 29, 57], [2, 30, 58])])
def test_deepseek_v2_first_id_heuristic_since_0_5_13(tmp_path, version, ids, taps):
    """models/deepseek_v2.py set_eagle3_layers_to_capture: +1 always before 0.5.13; from 0.5.13 (PR #25454)
    +1 only when ids[0] == 1."""
    sg = _export(tmp_path, taps=(3, 31, 59), target=DEEPSEEK)
    _edit(sg, lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": ids}))
    assert interop.read_engine_view(sg, "sglang", version).captured_taps == taps


def test_deepseek_v2_captures_the_embedding_at_id_0_since_0_5_13(tmp_path):
    """0.5.17 models/deepseek_v2.py:2825-2826 hands layer i the capture when i is in layers_to_capture, and
    layers/communicator.py:505-535 appends the residual after prepare_attn, which at layer 0 is the embedding
    (:619-620). So ids [0, ...] (first id not 1: as-is) capture tap 0; no layer captures the last one's output
    (deepseek_v2.py:2888-2890). Llama's SGLang cannot capture the embedding (llama.py:885-897 adds 1)."""
    sg = _export(tmp_path, taps=(3, 31, 59), target=DEEPSEEK)
    _edit(sg, lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [0, 31, 59]}))
    assert interop.read_engine_view(sg, "sglang", "0.5.17").captured_taps == [0, 31, 59]
    # a draft trained on the embedding exports as such for 0.5.13+, and is refused for older SGLang (always +1)
    save_tiny(tmp_path / "emb", taps=(0, 31, 59), target=DEEPSEEK)
    interop.export_draft(tmp_path / "emb", "sglang", tmp_path / "emb-sg", engine_version="0.5.17")
    cfg = json.loads((tmp_path / "emb-sg" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 31, 59]
    with pytest.raises(UsageError, match="cannot capture"):
        interop.export_draft(tmp_path / "emb", "sglang", tmp_path / "emb-old", engine_version="0.5.12")
    with pytest.raises(UsageError, match="cannot capture"):
        save_tiny(tmp_path / "last", taps=(3, 31, 61), target=DEEPSEEK)
        interop.export_draft(tmp_path / "last", "sglang", tmp_path / "last-sg", engine_version="0.5.17")


def _family(model_type, num_layers=36):
    return {**DEEPSEEK, "architecture": "X", "model_type": model_type, "num_layers": num_layers}


def _ids(path):
    return json.loads((path / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


def test_gpt_oss_exports_the_last_layers_output_as_id_n_minus_1(tmp_path):
    """0.5.17 models/gpt_oss.py:1328-1343 reads ids ending at N as they are and any other list +1; :736-741
    captures the output after layer i as boundary i + 1. The export writes +1 always: the form both read alike.
    Releases before 0.5.17 were not read for gpt_oss, so tap N is refused for them (llama's rule)."""
    target = _family("gpt_oss")
    save_tiny(tmp_path / "ck", taps=(2, 18, 36), target=target)
    interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "sg", engine_version="0.5.17")
    assert _ids(tmp_path / "sg") == [1, 17, 35]
    assert interop.read_engine_view(tmp_path / "sg", "sglang", "0.5.17", model_type="gpt_oss",
                                    num_layers=36).captured_taps == [2, 18, 36]
    _edit(tmp_path / "sg", lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [2, 18, 36]}))
    assert interop.read_engine_view(tmp_path / "sg", "sglang", "0.5.17", model_type="gpt_oss",
                                    num_layers=36).captured_taps == [2, 18, 36]
    with pytest.raises(UsageError, match="cannot capture"):
        interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "old", engine_version="0.5.16")


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_deepseek_v2_subclasses_read_the_first_id_heuristic(tmp_path, model_type):
    """0.5.17 models/deepseek_v2.py:3196 (DeepseekV32ForCausalLM) and glm4_moe.py:1461 (GlmMoeDsaForCausalLM)
    subclass DeepseekV2ForCausalLM, whose setter (:3134-3149) adds 1 only when ids[0] == 1: the seed incident's
    ids [2, 30, 58] mean taps [2, 30, 58] there, not [3, 31, 59]."""
    sg = _export(tmp_path, taps=(3, 31, 59), target={**DEEPSEEK, "model_type": model_type})
    assert _ids(sg) == [3, 31, 59]
    _edit(sg, lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}))
    assert interop.read_engine_view(sg, "sglang", "0.5.17", model_type=model_type,
                                    num_layers=61).captured_taps == [2, 30, 58]


def test_glm4_moe_lite_cannot_be_given_the_embedding(tmp_path):
    """0.5.17 models/glm4_moe_lite.py: deepseek_v2's first-id heuristic (:1013-1028) over llama's capture
    (:838-840, residual None at layer 0, :814): tap 0 is refused, where deepseek_v2 itself captures it."""
    target = _family("glm4_moe_lite", 47)
    save_tiny(tmp_path / "emb", taps=(0, 20, 40), target=target)
    with pytest.raises(UsageError, match="taps 0 and 1 cannot be written"):
        interop.export_draft(tmp_path / "emb", "sglang", tmp_path / "sg", engine_version="0.5.17")
    save_tiny(tmp_path / "ck", taps=(2, 20, 40), target=target)
    interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "ok", engine_version="0.5.17")
    assert _ids(tmp_path / "ok") == [1, 19, 39]  # read as [2, 20, 40] before and after PR #25454


def test_moe_families_export_the_embedding_as_id_minus_1(tmp_path):
    """0.5.17 models/qwen3_moe.py:1073-1087 (+1) over qwen2_moe.py:891-894 (layers[id] flagged) and
    layers/communicator.py:505-535 (the residual cloned as layer 0 starts: the embedding): tap 0 is id -1."""
    save_tiny(tmp_path / "ck", taps=(0, 24, 45), target=_family("qwen3_moe", 48))
    interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "sg", engine_version="0.5.17")
    assert _ids(tmp_path / "sg") == [-1, 23, 44]
    assert interop.read_engine_view(tmp_path / "sg", "sglang", "0.5.17", model_type="qwen3_moe",
                                    num_layers=48).captured_taps == [0, 24, 45]


def test_fc_width_follows_ids_from_0_5_12(tmp_path):
    """models/llama_eagle3.py: fc is hidden_size_in * 3 before 0.5.12; after, * num_aux_hidden_states if set, else *
    len(nested ids), else * 3 (0.5.17 :148-153, 0.5.12 :154-158)."""
    sg = _export(tmp_path, taps=(2, 3, 4, 5))
    assert interop.read_engine_view(sg, "sglang", "0.5.12").num_aux_expected == 4
    old = interop.read_engine_view(sg, "sglang", "0.5.11")
    assert old.num_aux_expected == 3 and any("fc.weight is 128 wide" in p for p in old.problems)
    _edit(sg, lambda c: c.__setitem__("num_aux_hidden_states", 3))
    stated = interop.read_engine_view(sg, "sglang", "0.5.17")
    assert stated.num_aux_expected == 3 and any("fc.weight is 128 wide" in p for p in stated.problems)


def test_lm_head_from_target_when_draft_vocab_size_is_null(tmp_path):
    """models/llama_eagle3.py:292-297 (0.5.17): draft_vocab_size None -> load_lm_head_from_target (full vocab); absent,
    `config.draft_vocab_size` raises (no lm_head is loaded at all: doctor's LM_HEAD_REPLACED says so);
    tie_word_embeddings -> lm_head IS the embedding, so a stored lm_head.weight is dropped."""
    sg = _export(tmp_path)
    assert not interop.read_engine_view(sg, "sglang").lm_head_from_target
    _edit(sg, lambda c: c.__setitem__("draft_vocab_size", None))
    assert interop.read_engine_view(sg, "sglang").lm_head_from_target
    _edit(sg, lambda c: c.pop("draft_vocab_size"))
    assert not interop.read_engine_view(sg, "sglang").lm_head_from_target
    _edit(sg, lambda c: c.update(tie_word_embeddings=True, draft_vocab_size=64))
    assert "lm_head.weight" in interop.read_engine_view(sg, "sglang").weights_dropped


def test_norm_flags_by_version(tmp_path):
    """models/llama_eagle3.py: the residual is always the raw fc output (norm_before_residual unsupported);
    fc_norm and norm_output are read from 0.5.12, norm_before_fc from 0.5.17."""
    sg = _export(tmp_path)
    _edit(sg, lambda c: c.update(norm_before_residual=True, fc_norm=True, norm_before_fc=True))
    f11 = interop.read_engine_view(sg, "sglang", "0.5.11").norm_flags
    assert not f11["norm_before_residual"].supported and not f11["fc_norm"].supported
    f16 = interop.read_engine_view(sg, "sglang", "0.5.16").norm_flags
    assert f16["fc_norm"].effective and not f16["norm_before_fc"].supported
    assert interop.read_engine_view(sg, "sglang", "0.5.17").norm_flags["norm_before_fc"].effective
    with pytest.raises(Exception, match="would not run"):
        interop.load_any(sg, source="sglang", engine_version="0.5.17")


def test_engine_view_is_plain_data(tmp_path):
    view = interop.read_engine_view(_export(tmp_path), "sglang")
    d = view.to_dict()
    json.dumps(d)
    assert d["ids_where"] == "eagle_config.eagle_aux_hidden_state_layer_ids" and d["ids"] == [1, 3, 4]
    assert d["norm_flags"]["norm_before_residual"] == {"written": False, "where": "norm_before_residual",
                                                       "engine_default": None, "effective": False,
                                                       "supported": True}


def test_versions_parse():
    assert sglang.parse_version("0.5.12.post1") > sglang.parse_version("0.5.12")
    assert sglang.parse_version("v0.5.13") >= SGLANG_HEURISTIC_SINCE > sglang.parse_version("0.5.12.post1")
    with pytest.raises(Exception, match="engine-version"):
        sglang.parse_version("new")


@pytest.mark.parametrize("model_type,taps", [("glm4_moe", [4, 32, 60]), ("glm4_moe_lite", [3, 31, 59]),
                                             ("kimi_k25", [3, 31, 59]), ("qwen3_moe", [4, 32, 60])])
def test_which_families_use_the_first_id_heuristic(tmp_path, model_type, taps):
    """0.5.13+: models/deepseek_v2.py (DeepSeek V2/V3, Kimi via kimi_k25.py) and glm4_moe_lite.py use the
    first-id heuristic; glm4_moe.py, qwen3_moe.py and the llama/qwen families keep the unconditional +1."""
    sg = _export(tmp_path, taps=(3, 31, 59), target=DEEPSEEK)
    view = interop.read_engine_view(sg, "sglang", "0.5.13", model_type=model_type, num_layers=61)
    assert view.ids == [3, 31, 59] and view.captured_taps == taps
