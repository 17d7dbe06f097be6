"""A draft trained with a sliding window, served by SGLang: SGLang 0.5.17 takes the draft's window from
--speculative-draft-window-size alone (models/llama_eagle3.py:276-288), so without that flag the draft attends
to the whole context. The doctor names the flag and its value before serving."""

from eaglewire import interop
from eaglewire.doctor import DoctorRequest, diagnose

from interop_tiny import LLAMA, save_tiny

ARGS = "--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"


def exported(tmp_path, fmt, window):
    ck = tmp_path / f"ck-{window}"
    if not ck.exists():
        save_tiny(ck, taps=(2, 4, 5), target=LLAMA, sliding_window=window)
    out = tmp_path / f"{fmt}-{window}"
    interop.export_draft(ck, fmt, out)
    return out


def doctor(path, engine_args):
    return diagnose(DoctorRequest(path, engine_args=engine_args))


def window_findings(report):
    return [f for f in report.findings if f.code == "ENGINE_ARGS_OVERRIDE" and "window" in f.message]


def test_a_windowed_draft_served_by_sglang_without_its_window_flag_is_named_with_the_fix(tmp_path):
    out = exported(tmp_path, "sglang", 16)
    [f] = window_findings(doctor(out, engine_args=ARGS))
    assert f.severity == "warning" and "asked unset" in f.message and "full attention" in f.message
    assert "--speculative-draft-window-size 16" in f.remedy.engine_args
    assert not window_findings(doctor(out, engine_args=f.remedy.engine_args))
    [f] = window_findings(doctor(out, engine_args=ARGS + " --speculative-draft-window-size 8"))
    assert "asked 8" in f.message and "a window of 8" in f.message


def test_no_window_finding_where_the_engine_reads_the_config_or_the_draft_has_none(tmp_path):
    assert not window_findings(doctor(exported(tmp_path, "sglang", None), engine_args=ARGS))
    vllm_args = "--speculative-config '{\"method\": \"eagle3\", \"model\": \"d\", \"num_speculative_tokens\": 3}'"
    assert not window_findings(doctor(exported(tmp_path, "vllm", 16), engine_args=vllm_args))
