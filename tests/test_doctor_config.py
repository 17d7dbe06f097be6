"""The doctor's architecture-field checks (doctor/config_checks.py): each field the engines build the draft
from, edited on a tiny eaglewire export, found with its code, its fix applied and the doctor run again.

Sources (SGLang 0.5.17 wheel, vLLM 0.26.0 wheel; python/sglang/srt/... and vllm/...):
- SGLang models/llama_eagle3.py:69-78 (intermediate_size, hidden_act, rms_norm_eps), :124-128 (rope_parameters,
  else rope_scaling), :136-146 (vocab_size, hidden_size, target_hidden_size), :149-159 (fc width), :193 (layers),
  :292-303 (tie_word_embeddings, draft_vocab_size); models/llama.py:173-174 (head_dim, else hidden // heads),
  :293-339 (rope theta, max_position_embeddings, heads, kv heads).
- vLLM model_executor/models/llama.py:155-156 (head_dim), :240-245 (rope_parameters), :262-287 (max positions,
  heads, kv heads); llama_eagle3.py:139-221 (vocab, hidden, layers, target_hidden_size, eps), :275-305
  (draft_vocab_size), :341-357 (logits over vocab_size); transformers_utils/configs/speculators/base.py:61
  (transformer_layer_config).
- transformers' LlamaConfig (5.25 here): strict int/float fields, rope_parameters' theta wins over rope_theta,
  max_position_embeddings defaults to 2048.
"""

import json

import pytest

from eaglewire import interop
from eaglewire.doctor import CODES, DoctorRequest, diagnose
from eaglewire.doctor.config_checks import _rope, engine_value
from eaglewire.errors import UsageError

from interop_tiny import LLAMA, save_tiny


def export(tmp_path, fmt, name=None):
    ck = tmp_path / "ck"
    if not ck.exists():
        save_tiny(ck, taps=(2, 4, 5), target=LLAMA)
    out = tmp_path / (name or fmt)
    interop.export_draft(ck, fmt, out)
    return out


def edit(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def layer(cfg):
    return cfg["transformer_layer_config"] if "transformer_layer_config" in cfg else cfg


def engine_of(fmt):
    return "vllm" if fmt == "speculators" else fmt


def fix_and_rerun(report, code, path, engine):
    f = next(f for f in report.findings if f.code == code)
    assert f.remedy is not None and f.remedy.edits_files, f
    f.remedy.apply(path)
    again = diagnose(DoctorRequest(path, engine=engine))
    assert code not in again.codes(), again.findings
    return again


def test_codes_are_declared():
    assert {"CONFIG_TYPE", "CONFIG_SHAPE", "CONFIG_DRIFT"} <= set(CODES)


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
def test_eaglewire_exports_pass_clean(tmp_path, fmt):
    r = diagnose(DoctorRequest(export(tmp_path, fmt), engine=engine_of(fmt)))
    assert not [c for c in r.codes() if c.startswith("CONFIG_")], r.findings
    assert r.exit_code == 0


# --- against the draft's own tensors: the engine's weight loader refuses another shape -------------------

@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
@pytest.mark.parametrize("field,bad", [
    ("hidden_size", 48),  # SGLang llama_eagle3.py:136-146, vLLM llama_eagle3.py:158-221: norm, fc rows
    ("intermediate_size", 96),  # SGLang llama_eagle3.py:69-75, vLLM llama.py LlamaMLP: gate_proj rows
    ("vocab_size", 100),  # SGLang llama_eagle3.py:136-140: VocabParallelEmbedding(vocab_size) before set_embed
])
def test_shape_fields_against_the_tensors(tmp_path, fmt, field, bad):
    out = export(tmp_path, fmt)
    if field == "vocab_size":  # the exports store no embedding: a trainer's directory does
        from safetensors.torch import load_file, save_file
        import torch
        st = load_file(str(out / "model.safetensors"))
        st["embed_tokens.weight"] = torch.zeros(128, 32)
        save_file(st, str(out / "model.safetensors"))
    edit(out, lambda c: layer(c).__setitem__(field, bad))
    r = diagnose(DoctorRequest(out, engine=engine_of(fmt)))
    f = next(f for f in r.findings if f.code == "CONFIG_SHAPE")
    assert f.severity == "error" and field in f.message, f
    assert not [d for d in r.findings if d.code == "CONFIG_DRIFT" and f"{field} is" in d.message]
    fix_and_rerun(r, "CONFIG_SHAPE", out, engine_of(fmt))


@pytest.mark.parametrize("field,bad", [
    ("num_attention_heads", 2),  # SGLang llama.py:317 / vLLM llama.py:285: q_proj rows = heads x head_dim
    ("head_dim", 16),  # SGLang llama.py:173-174, vLLM llama.py:155-156
    ("num_key_value_heads", 4),  # SGLang llama.py:318, vLLM llama.py:286-288: k_proj rows = kv heads x head_dim
])
def test_heads_and_head_dim_against_the_projections(tmp_path, field, bad):
    out = export(tmp_path, "sglang")
    edit(out, lambda c: c.__setitem__(field, bad))
    r = diagnose(DoctorRequest(out, engine="sglang"))
    f = next(f for f in r.findings if f.code == "CONFIG_SHAPE")
    assert f.severity == "error" and "x head_dim" in f.message and f.remedy is None
    # the product alone does not say which field: the record does
    drift = [f for f in r.findings if f.code == "CONFIG_DRIFT" and field in f.message]
    assert drift and drift[0].severity == "error"


def test_absent_hidden_size_is_llama_config_default(tmp_path):
    out = export(tmp_path, "sglang")
    edit(out, lambda c: c.pop("hidden_size"))
    r = diagnose(DoctorRequest(out, engine="sglang"))
    f = next(f for f in r.findings if f.code == "CONFIG_SHAPE")
    assert "absent (LlamaConfig's default 4096)" in f.message
    fix_and_rerun(r, "CONFIG_SHAPE", out, "sglang")


# --- against the training record: the same shapes, other arithmetic --------------------------------------

@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
@pytest.mark.parametrize("field,bad", [
    ("rms_norm_eps", 1e-5),  # SGLang llama_eagle3.py:78/197, vLLM llama_eagle3.py:66/192/221
    ("rope_theta", 500000.0),  # SGLang llama.py:294-300, vLLM llama.py:240-245 (through rope_parameters)
    ("max_position_embeddings", 128),  # SGLang llama.py:308, vLLM llama.py:263
])
def test_arithmetic_fields_against_the_record(tmp_path, fmt, field, bad):
    out = export(tmp_path, fmt)
    edit(out, lambda c: layer(c).__setitem__(field, bad))
    r = diagnose(DoctorRequest(out, engine=engine_of(fmt)))
    f = next(f for f in r.findings if f.code == "CONFIG_DRIFT")
    assert f.severity == "error" and field in f.message and "trained with" in f.message, f
    assert not r.codes("warning") or set(r.codes("warning")) <= {"CONFIG_DRIFT"}
    again = fix_and_rerun(r, "CONFIG_DRIFT", out, engine_of(fmt))
    assert again.exit_code == 0


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_hidden_act_other_than_silu_is_refused(tmp_path, fmt):
    # SGLang llama.py:104-107 and vLLM llama.py:109-111: LlamaMLP raises 'Unsupported activation'
    out = export(tmp_path, fmt)
    edit(out, lambda c: layer(c).__setitem__("hidden_act", "gelu"))
    r = diagnose(DoctorRequest(out, engine=engine_of(fmt)))
    f = next(f for f in r.findings if f.code == "CONFIG_TYPE")
    assert f.severity == "error" and "Unsupported activation" in f.message
    assert fix_and_rerun(r, "CONFIG_TYPE", out, engine_of(fmt)).exit_code == 0


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
def test_export_refuses_a_draft_neither_engine_can_build(tmp_path, fmt):
    """A gelu draft trains and decodes in eaglewire, but both engines' LlamaMLP refuse it at load (above): the
    export says so instead of writing it."""
    save_tiny(tmp_path / "gelu", hidden_act="gelu")
    with pytest.raises(UsageError, match="hidden_act 'gelu'.*retrain with silu"):
        interop.export_draft(tmp_path / "gelu", fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_rope_parameters_win_over_rope_theta(tmp_path):
    # transformers' LlamaConfig: with both written, rope_parameters' theta is the one the engine uses
    out = export(tmp_path, "sglang")
    edit(out, lambda c: c.__setitem__("rope_parameters", {"rope_type": "default", "rope_theta": 250000.0}))
    cfg = json.loads((out / "config.json").read_text())
    assert _rope(cfg)[:2] == (250000.0, "rope_parameters.rope_theta")
    r = diagnose(DoctorRequest(out, engine="sglang"))
    f = next(f for f in r.findings if f.code == "CONFIG_DRIFT")
    assert "rope_parameters.rope_theta is 250000.0" in f.message
    fix_and_rerun(r, "CONFIG_DRIFT", out, "sglang")


def test_rope_scaling_against_the_record(tmp_path):
    out = export(tmp_path, "vllm")
    edit(out, lambda c: layer(c).__setitem__("rope_scaling", {"rope_type": "linear", "factor": 2.0}))
    r = diagnose(DoctorRequest(out, engine="vllm"))
    f = next(f for f in r.findings if f.code == "CONFIG_DRIFT")
    assert "rope scaling" in f.message and "'linear'" in f.message
    fix_and_rerun(r, "CONFIG_DRIFT", out, "vllm")


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_num_hidden_layers_absent_builds_32_layers(tmp_path, fmt):
    # LlamaConfig's default 32; SGLang llama_eagle3.py:193 / vLLM llama_eagle3.py:172 build that many layers
    out = export(tmp_path, fmt)
    edit(out, lambda c: layer(c).pop("num_hidden_layers"))
    r = diagnose(DoctorRequest(out, engine=engine_of(fmt)))
    f = next(f for f in r.findings if f.code == "CONFIG_SHAPE")
    assert "num_hidden_layers is absent (LlamaConfig's default 32)" in f.message and f.severity == "error"
    assert ("random initialisation" if fmt == "sglang" else "refuses") in f.message
    assert fix_and_rerun(r, "CONFIG_SHAPE", out, engine_of(fmt)).exit_code == 0


# --- against the target -----------------------------------------------------------------------------------

def test_vocab_size_against_the_target_vocabulary_in_vllm(tmp_path):
    # vLLM llama_eagle3.py:341-357: logits scattered into config.vocab_size columns; t2d is over the target's
    from safetensors.torch import load_file, save_file
    out = export(tmp_path, "vllm")
    st = load_file(str(out / "model.safetensors"))
    del st["embed_tokens.weight"]  # absent, vLLM shares the target's: only the target's vocabulary disagrees
    save_file(st, str(out / "model.safetensors"))
    edit(out, lambda c: (c["transformer_layer_config"].__setitem__("vocab_size", 120),
                         c["eaglewire"]["draft"].__setitem__("vocab_size", 120)))
    r = diagnose(DoctorRequest(out, engine="vllm"))
    f = next(f for f in r.findings if f.code == "CONFIG_DRIFT")
    assert "vocab_size is 120, the target's vocabulary is 128 (t2d)" in f.message and f.severity == "error"


def test_import_reads_rope_theta_as_the_engines_do(tmp_path):
    # both written, differing: transformers' LlamaConfig (and so both engines) use rope_parameters' theta;
    # eaglewire's import and probe read the same, so a foreign draft is measured as it will be served
    out = export(tmp_path, "sglang")
    edit(out, lambda c: (c.pop("eaglewire"), c.__setitem__("rope_parameters",
                                                            {"rope_type": "default", "rope_theta": 250000.0})))
    reading, _ = interop.read_foreign(out, "sglang", interop.TargetInfo(fingerprint=dict(LLAMA)), None)
    assert reading.config.rope_theta == 250000.0
    r = diagnose(DoctorRequest(out, engine="sglang", source="sglang", target=_facts()))
    assert not [c for c in r.codes() if c.startswith("CONFIG_")], r.findings


def foreign_with_target(tmp_path, fn=None):
    """An SGLang export without its eaglewire record (as a draft from another trainer arrives), with the tiny
    llama target loaded (rope_theta 10000, eps 1e-6, 256 positions: what the tiny draft was made with)."""
    from eaglewire.targets import Target, fingerprint
    from tiny import tiny_model

    out = export(tmp_path, "sglang")
    edit(out, lambda c: (c.pop("eaglewire"), fn(c) if fn else None))
    m = tiny_model("llama", 0)
    t = Target(spec="tiny-llama", model=m, tokenizer=None, fingerprint=fingerprint(m))
    return out, t


def test_foreign_draft_with_its_target_passes_clean(tmp_path):
    out, t = foreign_with_target(tmp_path)
    r = diagnose(DoctorRequest(out, engine="sglang", source="sglang", target=t))
    assert not [c for c in r.codes() if c.startswith("CONFIG_")], r.findings


@pytest.mark.parametrize("field,bad,says", [
    ("rope_theta", 500000.0, "the target's rope_theta is 10000.0"),  # SGLang llama.py:294-300
    ("rms_norm_eps", 1e-5, "the target's 1e-06"),  # SGLang llama_eagle3.py:78/197
    ("max_position_embeddings", 128, "the target's 256"),  # SGLang llama.py:308, vLLM speculative.py:1118-1130
])
def test_foreign_fields_against_the_target_are_warnings(tmp_path, field, bad, says):
    # no record: the draft may have been trained so; only a measurement can tell
    out, t = foreign_with_target(tmp_path, lambda c: c.__setitem__(field, bad))
    r = diagnose(DoctorRequest(out, engine="sglang", source="sglang", target=t))
    f = next(f for f in r.findings if f.code == "CONFIG_DRIFT")
    assert f.severity == "warning" and says in f.message, f
    assert "nothing records" in f.message or "not measured" in f.message
    assert ("--probe" in f.fix) or (f.remedy and f.remedy.config_set == {"max_position_embeddings": 256})


def _facts():
    from eaglewire.doctor.subject import TargetFacts
    return TargetFacts(fingerprint=dict(LLAMA))


# --- types: what the engine's config loader does with a string for a number -------------------------------

@pytest.mark.parametrize("fmt,field,bad,fixed", [
    ("sglang", "hidden_size", "32", 32),  # LlamaConfig strict int field
    ("sglang", "rms_norm_eps", "1e-6", 1e-6),  # LlamaConfig strict float field
    ("speculators", "intermediate_size", 64.0, 64),  # a float for an int is refused too
    ("sglang", "rope_theta", "10000", 10000.0),  # kept as a string, the rotary embedding raises
    ("sglang", "draft_vocab_size", "64", 64),  # SGLang llama_eagle3.py:295-300 ParallelLMHead(draft_vocab_size)
])
def test_wrong_types(tmp_path, fmt, field, bad, fixed):
    out = export(tmp_path, fmt)
    holder = (lambda c: c) if field == "draft_vocab_size" else layer
    edit(out, lambda c: holder(c).__setitem__(field, bad))
    r = diagnose(DoctorRequest(out, engine=engine_of(fmt)))
    f = next(f for f in r.findings if f.code == "CONFIG_TYPE")
    assert f.severity == "error" and repr(bad) in f.message
    assert list(f.remedy.config_set.values()) == [fixed]
    again = fix_and_rerun(r, "CONFIG_TYPE", out, engine_of(fmt))
    assert again.exit_code == 0, again.findings


def test_engine_value_defaults():
    assert engine_value({"hidden_size": 64, "num_attention_heads": 4}, "head_dim") == 16
    assert engine_value({"num_attention_heads": 4}, "num_key_value_heads") == 4
    assert engine_value({}, "max_position_embeddings") == 2048


# --- the other formats `eaglewire import` reads, as SGLang serves them -------------------------------------

def _trainer_dir(path, kind, **cfg_edit):
    """SpecForge (export/to_sglang.py: midlayer.*, no embedding) or ModelOpt (hf_spec_export.py: layers.0.*,
    d2t only) layouts of the tiny draft, both LlamaForCausalLMEagle3 with nested ids."""
    from safetensors.torch import save_file
    from eaglewire.interop.common import hf_fields
    from interop_tiny import tiny_draft

    m = tiny_draft()
    nested = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    if kind == "modelopt":
        nested |= {"use_input_layernorm_in_first_layer": True, "use_last_layernorm": True}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **hf_fields(m.config), "draft_vocab_size": 64,
           "eagle_config": nested, "torch_dtype": "bfloat16", **cfg_edit}  # both exporters state the dtype
    cfg = {k: v for k, v in cfg.items() if v is not None}
    drop = ("embed_tokens.weight",) + (("t2d",) if kind == "modelopt" else ())
    name = (lambda k: k.replace("layers.0.", "midlayer.")) if kind == "specforge" else (lambda k: k)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({name(k): v.contiguous() for k, v in m.state_dict().items() if k not in drop},
              str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("kind", ["specforge", "modelopt"])
def test_trainer_formats_pass_clean_and_a_wrong_field_is_found(tmp_path, kind):
    clean = diagnose(DoctorRequest(_trainer_dir(tmp_path / "clean", kind), engine="sglang", source=kind,
                                   target=_facts()))
    assert not [c for c in clean.codes() if c.startswith("CONFIG_")], clean.findings
    bad = _trainer_dir(tmp_path / "bad", kind, intermediate_size=96)  # SGLang llama_eagle3.py:69-75
    r = diagnose(DoctorRequest(bad, engine="sglang", source=kind, target=_facts()))
    f = next(f for f in r.findings if f.code == "CONFIG_SHAPE")
    assert "intermediate_size is 96" in f.message and "gate_proj" in f.message
    fix_and_rerun(r, "CONFIG_SHAPE", bad, "sglang")


def test_a_draft_stating_no_dtype_is_built_in_float16_by_sglang(tmp_path):
    """SGLang 0.5.17 builds the draft in the dtype its own config states (configs/model_config.py:494, 531-561):
    none reads as float32, which --dtype auto, the default, turns into float16 (:1663-1684). vLLM builds it in the
    target's dtype. eaglewire's SGLang export states bfloat16."""
    for said in (None, "float32"):
        d = _trainer_dir(tmp_path / f"d-{said}", "specforge", torch_dtype=said)
        r = diagnose(DoctorRequest(d, engine="sglang", source="specforge", target=_facts()))
        f = next(f for f in r.findings if f.code == "CONFIG_DRIFT")
        assert f.severity == "warning" and "float16" in f.message and "--dtype bfloat16" in f.fix
    r = diagnose(DoctorRequest(_trainer_dir(tmp_path / "bf16", "specforge"), engine="sglang", source="specforge",
                               target=_facts()))
    assert "CONFIG_DRIFT" not in r.codes()
    r = diagnose(DoctorRequest(_trainer_dir(tmp_path / "vllm", "specforge", torch_dtype=None), engine="vllm",
                               source="specforge", target=_facts()))
    assert not any("float16" in f.message for f in r.findings)
