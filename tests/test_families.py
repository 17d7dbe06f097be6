"""Target families whose SGLang reads the ids by a rule of its own (eaglewire.taps.SGLANG_FAMILIES), taken through
eaglewire as a user would on tiny random targets built from transformers' own config classes: capture, training,
the SGLang and vLLM exports, and the doctor on each and on the seed incident's +1 copy."""

import json

import pytest
import torch
from chat_target import char_tokenizer, conversations_file

from eaglewire import cli, interop
from eaglewire.doctor import DoctorRequest, diagnose

COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _build(kind, path):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt_oss":  # yarn RoPE, sinks, sliding and full layers in turn, MoE
        model = tf.GptOssForCausalLM(tf.GptOssConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                                     sliding_window=64, **COMMON))
    else:
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                                         num_experts_per_tok=2, **COMMON))
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked distributions: a few steps learn something
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("kind,rule", [("gpt_oss", "sglang-gpt-oss"), ("qwen3_moe", "sglang-communicator")])
def test_a_family_with_its_own_sglang_rule_end_to_end(tmp_path, capsys, kind, rule):
    """sglang 0.5.17 models/gpt_oss.py:1328-1343 and qwen3_moe.py:1073-1087: taps [2, 4, 5] are ids [1, 3, 4] in
    both (+1; gpt_oss reads a list as it is only when it reaches N). vLLM's ids are the taps."""
    tgt = str(_build(kind, tmp_path / "target"))
    conversations_file(tmp_path / "convs.jsonl", 16)
    assert cli.main(["datagen", "--target", tgt, "--prompts", str(tmp_path / "convs.jsonl"), "--out",
                     str(tmp_path / "data")]) == 0
    assert cli.main(["train", "--target", tgt, "--data", str(tmp_path / "data"), "--out", str(tmp_path / "ck"),
                     "--steps", "2", "--batch-tokens", "512", "--max-len", "256", "--draft-vocab-size", "64",
                     "--no-progress"]) == 0
    if kind == "gpt_oss":  # yarn: the draft keeps plain RoPE, and says so
        assert "the draft uses plain RoPE: the target's yarn scaling" in capsys.readouterr().err
    for fmt in ("sglang", "vllm"):
        assert cli.main(["export", "--draft", str(tmp_path / "ck"), "--format", fmt, "--engine-version", "0.5.17",
                         "--out", str(tmp_path / fmt)] if fmt == "sglang" else
                        ["export", "--draft", str(tmp_path / "ck"), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
        assert diagnose(DoctorRequest(tmp_path / fmt, target=tgt)).exit_code == 0
    cfg = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["eaglewire"]["convention"] == rule and cfg.get("rope_scaling") is None
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]  # the seed incident's +1
    (tmp_path / "sglang" / "config.json").write_text(json.dumps(cfg))
    r = diagnose(DoctorRequest(tmp_path / "sglang", target=tgt))
    assert r.exit_code == 1 and r.context["engine_taps"] == [3, 5, 6]
    view = interop.read_engine_view(tmp_path / "sglang", "sglang", "0.5.17", model_type=kind, num_layers=8)
    assert list(view.captured_taps) == [3, 5, 6]
