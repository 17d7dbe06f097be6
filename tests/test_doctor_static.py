"""Static doctor checks: each fault is built on a tiny draft, found with its code, and its fix is
APPLIED and the doctor run again to see the finding gone. Engine rules cited per test: SGLang
llama_eagle3.py / model_runner.py / server_args.py, vLLM llama_eagle3.py / eagle3_utils.py /
speculators algos.py (see src/eaglewire/interop/*.py for the file-level citations)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglewire import interop
from eaglewire.checkpoint import save_draft
from eaglewire.cli import main as cli_main
from eaglewire.doctor import DoctorRequest, diagnose
from eaglewire.doctor.subject import TargetFacts
from eaglewire.draft import DraftConfig, Eagle3Draft
from eaglewire.targets import Target, fingerprint
from eaglewire.taps import TapContract

from interop_tiny import DEEPSEEK, LLAMA, save_tiny, tiny_draft
from tiny import tiny_model

IDS = "eagle_aux_hidden_state_layer_ids"


def export(tmp_path, fmt, taps=(2, 4, 5), target=LLAMA, version=None, name=None, **flags):
    ck = tmp_path / f"ck-{name or fmt}"
    if not ck.exists():
        save_tiny(ck, taps=taps, target=target, **flags)
    out = tmp_path / (name or fmt)
    interop.export_draft(ck, fmt, out, engine_version=version)
    return out


def edit(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_weights(path, fn):
    state = load_file(str(path / "model.safetensors"))
    fn(state)
    save_file(state, str(path / "model.safetensors"))


def fix_and_rerun(report, code, path, **kw):
    """Apply the finding's remedy exactly as its fix text says, and run the doctor again."""
    f = report.get(code)
    assert f is not None, report.codes()
    assert f.remedy is not None and f.fix, f
    if f.remedy.edits_files:
        f.remedy.apply(path)
    if f.remedy.engine_args is not None:
        kw["engine_args"] = f.remedy.engine_args
    again = diagnose(DoctorRequest(path, **kw))
    assert code not in again.codes(), (code, again.findings)
    return again


def tiny_target(seed=0):
    m = tiny_model("llama", seed)
    return Target(spec="tiny-llama", model=m, tokenizer=None, fingerprint=fingerprint(m))


# --- no false alarms ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
@pytest.mark.parametrize("target,taps", [(LLAMA, (2, 4, 5)), (DEEPSEEK, (3, 31, 59)), (DEEPSEEK, (2, 30, 58))])
def test_every_eaglewire_export_passes_clean_on_its_engine(tmp_path, fmt, target, taps):
    out = export(tmp_path, fmt, taps=taps, target=target)
    r = diagnose(DoctorRequest(out, engine="vllm" if fmt == "speculators" else fmt))
    assert not r.codes("error") and not r.codes("warning"), r.findings
    assert r.exit_code == 0


def test_native_checkpoint_without_engine_passes_clean(tmp_path):
    save_tiny(tmp_path / "ck")
    assert diagnose(DoctorRequest(tmp_path / "ck")).findings == []


# --- format ------------------------------------------------------------------------------------

def test_native_checkpoint_for_an_engine_needs_export_and_the_command_works(tmp_path):
    save_tiny(tmp_path / "ck")
    r = diagnose(DoctorRequest(tmp_path / "ck", engine="sglang"))
    f = r.get("NOT_ENGINE_FORMAT")
    assert f.severity == "error" and "eaglewire export" in f.fix
    for argv in f.remedy.commands:
        assert cli_main(list(argv[1:])) == 0
    again = diagnose(DoctorRequest(f.remedy.then_doctor, engine="sglang"))
    assert again.exit_code == 0 and not again.codes("warning")


# --- taps --------------------------------------------------------------------------------------

def test_taps_missing_sglang_falls_back_to_default_taps(tmp_path):
    out = export(tmp_path, "sglang", taps=(2, 4, 6))  # SGLang's default for 8 layers is [2, 4, 5]
    edit(out, lambda c: c["eagle_config"].pop(IDS))
    edit(out, lambda c: c.pop("eaglewire"))  # a foreign directory: nothing recorded
    r = diagnose(DoctorRequest(out, engine="sglang", source="sglang"))  # nothing known of the target: still found
    assert "TAPS_MISSING" in r.codes() and "pass --target" in r.get("DRAFT_UNREADABLE").message
    r = diagnose(DoctorRequest(out, source="sglang", target=tiny_target()))
    assert r.get("TAPS_MISSING").severity == "warning" and "TAPS_UNVERIFIED" in r.codes()
    # With the record kept, the fallback is an error and the fix writes the nested key.
    out2 = export(tmp_path, "sglang", taps=(2, 4, 6), name="rec")
    edit(out2, lambda c: c["eagle_config"].pop(IDS))
    r = diagnose(DoctorRequest(out2))
    f = r.get("TAPS_MISSING")
    assert f.severity == "error" and "bare `except:`" in f.message and "[2, 4, 5]" in f.message
    fix_and_rerun(r, "TAPS_MISSING", out2)
    # Trained on the default taps, the fallback reads them: a warning. Served in SGLang 0.5.17 (H200, 2026-12-05,
    # run 42), a misspelled key cost +0.00 of 2.70 with eaglewire's default taps, SGLang's own.
    out3 = export(tmp_path, "sglang", taps=(2, 4, 5), name="default")
    edit(out3, lambda c: c["eagle_config"].pop(IDS))
    f = diagnose(DoctorRequest(out3)).get("TAPS_MISSING")
    assert f.severity == "warning" and "the trained taps, reached only through its default" in f.message


def test_taps_in_the_wrong_place_for_each_engine(tmp_path):
    sg = export(tmp_path, "sglang", taps=(2, 4, 6))
    edit(sg, lambda c: c.__setitem__(IDS, c["eagle_config"].pop(IDS)))  # top level: SGLang never reads it
    r = diagnose(DoctorRequest(sg))
    assert r.get("TAPS_WRONG_PLACE").severity == "error"
    fix_and_rerun(r, "TAPS_WRONG_PLACE", sg)
    vl = export(tmp_path, "vllm", taps=(2, 4, 6))
    edit(vl, lambda c: c.setdefault("eagle_config", {}).__setitem__(IDS, c.pop(IDS)))  # nested: V2 never reads it
    r = diagnose(DoctorRequest(vl))
    f = r.get("TAPS_WRONG_PLACE")
    # vLLM 0.26.0 v1/worker/gpu_model_runner.py:5445-5476 (V1: MoE and hybrid targets) falls back to the nested
    # key as its own ids; v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:35-58 (V2: dense targets) does not
    assert f.severity == "error" and "V1 runner (MoE and hybrid targets) reads them as taps [2, 4, 6], the trained" \
        in f.message
    fix_and_rerun(r, "TAPS_WRONG_PLACE", vl)


def test_taps_shifted_by_a_forgotten_plus_one(tmp_path):
    """SGLang llama.py adds +1 to explicit ids: canonical taps written as ids capture one layer later."""
    out = export(tmp_path, "sglang", taps=(2, 4, 5))
    edit(out, lambda c: c["eagle_config"].__setitem__(IDS, [2, 4, 5]))
    r = diagnose(DoctorRequest(out))
    f = r.get("TAPS_SHIFTED")
    assert "[3, 5, 6]" in f.message and "[1, 3, 4]" in f.fix
    assert fix_and_rerun(r, "TAPS_SHIFTED", out).exit_code == 0


def test_seed_incident_kimi_ids_under_the_deepseek_first_id_heuristic(tmp_path):
    """Kimi-K2.5 (61 layers), trained on taps [3, 31, 59]: ids [2, 30, 58] were right for SGLang before
    0.5.13 (unconditional +1); deepseek_v2.py since PR #25454 reads them as taps [2, 30, 58]."""
    out = export(tmp_path, "sglang", taps=(3, 31, 59), target=DEEPSEEK, version="0.5.12")
    assert json.loads((out / "config.json").read_text())["eagle_config"][IDS] == [2, 30, 58]
    assert diagnose(DoctorRequest(out)).exit_code == 0  # the version it was exported for
    r = diagnose(DoctorRequest(out, engine_version="0.5.13"))
    f = r.get("TAPS_SHIFTED")
    assert "[2, 30, 58]" in f.message and "[3, 31, 59]" in f.message and "[3, 31, 59]" in f.fix
    fix_and_rerun(r, "TAPS_SHIFTED", out, engine_version="0.5.13")


def test_foreign_deepseek_directory_needs_the_sglang_version(tmp_path):
    """Without a record, SGLang's two readings of [3, 31, 59] (before/after PR #25454) differ: the doctor
    says so and asks for the version; given it, the taps are read (and flagged as inferred)."""
    out = export(tmp_path, "sglang", taps=(3, 31, 59), target=DEEPSEEK)
    edit(out, lambda c: c.pop("eaglewire"))
    facts = TargetFacts(fingerprint=dict(DEEPSEEK))
    r = diagnose(DoctorRequest(out, target=facts, source="sglang"))
    assert "--engine-version" in r.get("DRAFT_UNREADABLE").message
    r = diagnose(DoctorRequest(out, target=facts, source="sglang", engine_version="0.5.13"))
    assert r.codes() == ["TAPS_UNVERIFIED"] and r.context["taps"] == [3, 31, 59]
    r = diagnose(DoctorRequest(out, target=facts, source="sglang", engine_version="0.5.12"))
    assert r.context["taps"] == [4, 32, 60]  # what old SGLang would capture: the inference follows the engine


def test_taps_unsupported_by_sglang_then_served_by_vllm(tmp_path):
    save_tiny(tmp_path / "ck", taps=(2, 4, 8))  # tap 8 = the last layer's output: SGLang never captures it
    sg = export(tmp_path, "sglang", taps=(2, 4, 5), name="sg")
    edit(sg, lambda c: c["eaglewire"].__setitem__("taps", TapContract(8, (2, 4, 8)).to_dict()))
    r = diagnose(DoctorRequest(sg))
    f = r.get("TAPS_UNSUPPORTED")
    assert f.severity == "error" and "vllm" in f.fix.lower()
    vl = tmp_path / "vl"
    interop.export_draft(tmp_path / "ck", "vllm", vl)
    assert diagnose(DoctorRequest(vl)).exit_code == 0


def test_tap_count_unsupported_before_sglang_0_5_12(tmp_path):
    out = export(tmp_path, "sglang", taps=(1, 3, 5, 6))
    r = diagnose(DoctorRequest(out, engine_version="0.5.11"))
    assert "TAPS_UNSUPPORTED" in r.codes() and "0.5.12" in r.get("TAPS_UNSUPPORTED").fix
    assert "FC_SHAPE" not in r.codes()  # one root cause, one finding
    assert "TAPS_UNSUPPORTED" not in diagnose(DoctorRequest(out, engine_version="0.5.12")).codes()


def test_embedding_id_crashes_sglang_and_out_of_range_ids(tmp_path):
    out = export(tmp_path, "sglang", taps=(2, 4, 5))
    edit(out, lambda c: c["eagle_config"].__setitem__(IDS, [-1, 3, 4]))  # tap 0: residual is None in llama.py
    r = diagnose(DoctorRequest(out))
    assert "TAPS_UNSUPPORTED" in r.codes()
    fix_and_rerun(r, "TAPS_UNSUPPORTED", out)
    edit(out, lambda c: c["eagle_config"].__setitem__(IDS, [1, 3, 20]))
    r = diagnose(DoctorRequest(out))
    assert "TAPS_OUT_OF_RANGE" in r.codes()
    fix_and_rerun(r, "TAPS_OUT_OF_RANGE", out)


def test_malformed_ids_are_an_error_not_a_crash(tmp_path):
    out = export(tmp_path, "sglang")
    edit(out, lambda c: c["eagle_config"].__setitem__(IDS, "1,3,4"))
    r = diagnose(DoctorRequest(out))
    assert r.get("TAPS_MISSING").severity == "error"


# --- fc ----------------------------------------------------------------------------------------

def test_fc_shape_against_a_target_of_another_width(tmp_path):
    import transformers as tf

    out = export(tmp_path, "sglang")
    m = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=8,
                                           num_attention_heads=4, num_key_value_heads=2))
    wide = Target(spec="wide", model=m, tokenizer=None, fingerprint=fingerprint(m))
    r = diagnose(DoctorRequest(out, target=wide))
    # the draft's own files agree (fc is 3 x 32 wide): the pairing is wrong, and the message names both widths
    f = next(f for f in r.findings if f.code == "TARGET_MISMATCH" and "fc.weight" in f.message)
    assert f.severity == "error" and "32 wide" in f.message and "hidden size 64" in f.message
    assert "FC_SHAPE" not in r.codes()
    edit(out, lambda c: c.pop("eaglewire"))  # the same without a record: the draft's width is all there is to go by
    r = diagnose(DoctorRequest(out, target=wide))
    assert "TARGET_MISMATCH" in r.codes() and "FC_SHAPE" not in r.codes() and "DRAFT_UNREADABLE" not in r.codes()
    # the fix: the right target
    assert "TARGET_MISMATCH" not in diagnose(DoctorRequest(out, target=tiny_target())).codes()


def test_fc_shape_when_target_hidden_size_is_missing(tmp_path):
    torch.manual_seed(0)
    d = Eagle3Draft(DraftConfig(hidden_size=32, target_hidden_size=64, intermediate_size=64, num_attention_heads=4,
                                vocab_size=128, draft_vocab_size=128))
    target = dict(LLAMA, hidden_size=64)
    save_draft(d, tmp_path / "ck", contract=TapContract(8, (2, 4, 5)), target_fingerprint=target)
    interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "sg")
    edit(tmp_path / "sg", lambda c: c.pop("target_hidden_size"))
    r = diagnose(DoctorRequest(tmp_path / "sg"))
    assert "FC_SHAPE" in r.codes()
    fix_and_rerun(r, "FC_SHAPE", tmp_path / "sg")


def test_fc_bypass_by_engine_algorithm_and_by_config(tmp_path):
    out = export(tmp_path, "sglang")
    args = "--speculative-algorithm EAGLE --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
    r = diagnose(DoctorRequest(out, engine_args=args))
    assert "acceptance length ~1.0" in r.get("FC_BYPASS").message
    fix_and_rerun(r, "FC_BYPASS", out, engine_args=args)
    edit(out, lambda c: c["eagle_config"].__setitem__("use_aux_hidden_state", False))
    r = diagnose(DoctorRequest(out))
    fix_and_rerun(r, "FC_BYPASS", out)
    vl = export(tmp_path, "vllm")
    vargs = f"vllm serve T --speculative-config '{json.dumps({'method': 'eagle', 'model': str(vl), 'num_speculative_tokens': 3})}'"
    r = diagnose(DoctorRequest(vl, engine_args=vargs))
    fix_and_rerun(r, "FC_BYPASS", vl, engine_args=vargs)


# --- weights, vocabulary, lm_head, embedding ---------------------------------------------------

def test_layers0_names_silently_dropped_by_sglang_before_0_5_12(tmp_path):
    """The seed incident: `layers.0.*` saved where SGLang (before 0.5.12) expects `midlayer.*`."""
    out = export(tmp_path, "sglang")
    edit_weights(out, lambda s: s.update({k.replace("midlayer.", "layers.0."): s.pop(k) for k in list(s)
                                          if k.startswith("midlayer.")}))
    r = diagnose(DoctorRequest(out, engine_version="0.5.11"))
    f = r.get("WEIGHTS_DROPPED")
    assert "silently drops" in f.message and "layers.0." in f.message
    fix_and_rerun(r, "WEIGHTS_DROPPED", out, engine_version="0.5.11")
    edit_weights(out, lambda s: s.pop("norm.weight"))
    r = diagnose(DoctorRequest(out))
    assert "norm.weight" in r.get("WEIGHTS_DROPPED").message and "export" in r.get("WEIGHTS_DROPPED").fix


def test_d2t_absolute_ids_and_t2d_disagreement(tmp_path):
    out = export(tmp_path, "sglang")
    edit_weights(out, lambda s: s.__setitem__("d2t", s["d2t"] + torch.arange(s["d2t"].numel())))
    r = diagnose(DoctorRequest(out))
    assert "absolute" in r.get("D2T_INVALID").message
    fix_and_rerun(r, "D2T_INVALID", out)

    def scramble(s):
        t2d = s["t2d"].clone()
        on, off = t2d.nonzero()[0, 0].item(), (~t2d).nonzero()[0, 0].item()
        t2d[on], t2d[off] = False, True
        s["t2d"] = t2d
    edit_weights(out, scramble)
    r = diagnose(DoctorRequest(out))
    assert "t2d" in r.get("D2T_INVALID").message
    fix_and_rerun(r, "D2T_INVALID", out)


def test_lm_head_replaced_by_sglang(tmp_path):
    out = export(tmp_path, "sglang")
    edit(out, lambda c: c.__setitem__("draft_vocab_size", None))  # llama_eagle3.py:295-297: load_lm_head_from_target
    r = diagnose(DoctorRequest(out))
    assert "null: SGLang loads the TARGET's lm_head" in r.get("LM_HEAD_REPLACED").message
    fix_and_rerun(r, "LM_HEAD_REPLACED", out)
    edit(out, lambda c: c.pop("draft_vocab_size"))  # llama_eagle3.py:295, :307 read it: an AttributeError
    r = diagnose(DoctorRequest(out))
    assert "absent: SGLang fails to build the draft" in r.get("LM_HEAD_REPLACED").message
    fix_and_rerun(r, "LM_HEAD_REPLACED", out)
    edit(out, lambda c: c.__setitem__("tie_word_embeddings", True))
    r = diagnose(DoctorRequest(out))
    fix_and_rerun(r, "LM_HEAD_REPLACED", out)
    edit(out, lambda c: c.__setitem__("draft_vocab_size", 100))
    r = diagnose(DoctorRequest(out))
    fix_and_rerun(r, "LM_HEAD_REPLACED", out)


def test_embedding_mismatch_swapped_by_sglang_kept_by_vllm(tmp_path):
    t = tiny_target()
    d = tiny_draft()
    d.load_target_embedding(t.model.model.embed_tokens.weight)
    with torch.no_grad():
        d.embed_tokens.weight.add_(0.5)  # trained with its own embedding
    save_draft(d, tmp_path / "ck", contract=TapContract(8, (2, 4, 5)), target_fingerprint=t.fingerprint)
    interop.export_draft(tmp_path / "ck", "sglang", tmp_path / "sg")
    r = diagnose(DoctorRequest(tmp_path / "sg", target=t))
    assert r.get("EMBED_MISMATCH").severity == "error" and "vLLM" in r.get("EMBED_MISMATCH").fix
    interop.export_draft(tmp_path / "ck", "vllm", tmp_path / "vl")  # the fix: serve with vLLM
    assert "EMBED_MISMATCH" not in diagnose(DoctorRequest(tmp_path / "vl", target=t)).codes()


def test_norm_flags_implicit_mismatched_and_unsupported(tmp_path):
    vl = export(tmp_path, "vllm")
    edit(vl, lambda c: c.pop("norm_before_residual"))  # vLLM update_eagle3: absent -> True
    r = diagnose(DoctorRequest(vl))
    assert r.get("NORM_FLAGS_IMPLICIT").severity == "error"
    fix_and_rerun(r, "NORM_FLAGS_IMPLICIT", vl)
    edit(vl, lambda c: c.__setitem__("norm_output", True))
    r = diagnose(DoctorRequest(vl))
    fix_and_rerun(r, "NORM_FLAG_MISMATCH", vl)
    edit(vl, lambda c: (c.pop("norm_before_residual"), c.pop("eaglewire")))
    r = diagnose(DoctorRequest(vl, source="vllm"))  # foreign: no record, the absence itself is the risk
    assert r.get("NORM_FLAGS_IMPLICIT").severity == "warning"
    fix_and_rerun(r, "NORM_FLAGS_IMPLICIT", vl, source="vllm")
    sg = export(tmp_path, "sglang", name="fcnorm", fc_norm=True)
    r = diagnose(DoctorRequest(sg, engine_version="0.5.11"))
    assert "NORM_UNSUPPORTED" in r.codes()
    assert "NORM_UNSUPPORTED" not in diagnose(DoctorRequest(sg)).codes()


# --- engine arguments, target, unreadable -------------------------------------------------------

def test_engine_args_seed_incident_16_draft_tokens_become_2(tmp_path):
    out = export(tmp_path, "sglang")
    args = "--speculative-algorithm EAGLE3 --speculative-num-steps 1 --speculative-eagle-topk 1 --speculative-num-draft-tokens 16"
    r = diagnose(DoctorRequest(out, engine_args=args))
    f = r.get("ENGINE_ARGS_OVERRIDE")
    assert f.severity == "warning" and "asked 16" in f.message and "use 2" in f.message
    fix_and_rerun(r, "ENGINE_ARGS_OVERRIDE", out, engine_args=args)
    for refused in ("--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-eagle-topk 4 "
                    "--speculative-num-draft-tokens 8 --page-size 16 --attention-backend torch_native",
                    "--speculative-algorithm EAGLE3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4",
                    "--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-eagle-topk 4 "
                    "--speculative-num-draft-tokens 8 --attention-backend trtllm_mha"):
        r = diagnose(DoctorRequest(out, engine_args=refused))
        assert "ENGINE_ARGS_REFUSED" in r.codes(), refused
        fixed = fix_and_rerun(r, "ENGINE_ARGS_REFUSED", out, engine_args=refused)
        assert not fixed.codes("warning") and not fixed.codes("error"), fixed.findings
    args = f"--speculative-config '{json.dumps({'method': 'eagle3', 'model': 'd'})}'"
    vl = export(tmp_path, "vllm")  # a speculators config names its own speculative_tokens: vLLM takes those
    assert diagnose(DoctorRequest(vl, engine_args=args)).get("ENGINE_ARGS_OVERRIDE").severity == "info"
    # A plain config has none: vLLM refuses to start without num_speculative_tokens.
    fix_and_rerun(diagnose(DoctorRequest(out, engine="vllm", engine_args=args)), "ENGINE_ARGS_REFUSED", out,
                  engine="vllm", engine_args=args)


def test_engine_args_auto_defaults_are_reported_per_target(tmp_path):
    out = export(tmp_path, "sglang", taps=(3, 31, 59), target=DEEPSEEK)
    r = diagnose(DoctorRequest(out, engine_args="--speculative-algorithm EAGLE3"))
    f = r.get("ENGINE_ARGS_OVERRIDE")
    assert f.severity == "info" and "(3, 1, 4)" in f.message
    fix_and_rerun(r, "ENGINE_ARGS_OVERRIDE", out, engine_args="--speculative-algorithm EAGLE3")


def test_target_mismatch(tmp_path):
    import transformers as tf

    out = export(tmp_path, "vllm")
    m = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                           num_attention_heads=4, num_key_value_heads=2))
    r = diagnose(DoctorRequest(out, target=Target(spec="other", model=m, tokenizer=None, fingerprint=fingerprint(m))))
    assert any("vocab_size" in f.message for f in r.findings if f.code == "TARGET_MISMATCH")
    assert "TARGET_MISMATCH" not in diagnose(DoctorRequest(out, target=tiny_target())).codes()


def test_unreadable_foreign_directory(tmp_path):
    d = tmp_path / "junk"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Nope"]}))
    save_file({"x": torch.zeros(1)}, str(d / "model.safetensors"))
    r = diagnose(DoctorRequest(d))
    assert r.get("DRAFT_UNREADABLE").severity == "error" and r.exit_code == 1


@pytest.mark.parametrize("architecture,says", [
    ("Gemma2ForCausalLM", "no EAGLE-3 capture for Gemma2ForCausalLM"),  # no setter: attention_backend_setup.py:54
    ("Gemma3ForCausalLM", "captures `hidden_states` alone"),  # gemma3_causal.py:641-661
    ("Qwen3_5ForConditionalGeneration", "nothing is captured"),  # qwen3_vl.py:1542-1553 vs qwen3_5.py:1441-1445
])
def test_sglang_target_classes_that_cannot_feed_the_draft_are_named(tmp_path, architecture, says):
    """SGLang 0.5.17 srt/models/: the setter it calls on every EAGLE-3 target exists for some classes only
    (benchmarks/eagle3_targets.py lists them), and some of those capture something else than the stream."""
    target = {**LLAMA, "architecture": architecture}
    ck = tmp_path / "ck"
    save_tiny(ck, target=target)
    out = tmp_path / "sg"
    notes = interop.export_draft(ck, "sglang", out, engine_version="0.5.17").notes
    assert any(says in n for n in notes)
    f = next(f for f in diagnose(DoctorRequest(out, engine="sglang")).findings if f.code == "TAPS_UNSUPPORTED")
    assert f.severity == "warning" and says in f.message and "0.5.17" in f.message
    plain = export(tmp_path, "sglang")  # LlamaForCausalLM: llama.py has the setter and captures the stream
    assert "TAPS_UNSUPPORTED" not in diagnose(DoctorRequest(plain, engine="sglang")).codes()


@pytest.mark.parametrize("architecture,refused", [("MixtralForCausalLM", True), ("Qwen2MoeForCausalLM", True),
                                                  ("Qwen3MoeForCausalLM", False), ("SmolLM3ForCausalLM", False)])
def test_vllm_target_classes_without_eagle3_are_named(tmp_path, architecture, refused):
    """vLLM 0.26.0 refuses an EAGLE-3 draft on a registered class that is not SupportsEagle3
    (v1/worker/gpu_model_runner.py:5428-5432): mixtral.py:376, qwen2_moe.py:420. qwen3_moe.py's is; SmolLM3 runs on
    the Transformers backend (registry.py:661), which is too."""
    save_tiny(tmp_path / "ck", target={**LLAMA, "architecture": architecture})
    notes = interop.export_draft(tmp_path / "ck", "vllm", tmp_path / "vl").notes
    assert any("without EAGLE-3" in n for n in notes) == refused
    found = [f for f in diagnose(DoctorRequest(tmp_path / "vl", engine="vllm")).findings
             if f.code == "TAPS_UNSUPPORTED" and "without EAGLE-3" in f.message]
    assert bool(found) == refused and all(f.severity == "warning" for f in found)


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_nonfinite_weights_are_an_error(tmp_path, fmt):
    out = export(tmp_path, fmt)
    t = load_file(str(out / "model.safetensors"))
    assert "WEIGHTS_NONFINITE" not in diagnose(DoctorRequest(out)).codes()
    t["fc.weight"][0, 0] = float("nan")
    t["norm.weight"][1] = float("inf")
    save_file(t, str(out / "model.safetensors"))
    r = diagnose(DoctorRequest(out))
    f = r.get("WEIGHTS_NONFINITE")
    assert f.severity == "error" and "2 weight tensor(s)" in f.message and "fc.weight" in f.message
    assert r.exit_code == 1
