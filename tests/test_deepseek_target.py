"""benchmarks/deepseek_target.py: the DeepSeek-V3-style target (MLA + MoE after dense layers) that issue 44 serves
in SGLang, built small here and taken through eaglewire as a user would: taps, capture, training, the SGLang
export with deepseek_v2's id rule, and the doctor on that export and on a +1 copy of it."""

import json
import sys
from pathlib import Path

import pytest
import torch
from chat_target import conversations_file, make_target
from safetensors.torch import load_file

from eaglewire import cli, interop, targets
from eaglewire.doctor import DoctorRequest, diagnose

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import deepseek_target as ds  # noqa: E402

MICRO = dict(layers=8, dense=2, hidden=64, heads=4, experts=8, groups=4, topk_group=2, per_token=2,
             kv_lora_rank=32, q_lora_rank=48, rope_dim=8, nope_dim=8, v_dim=8, moe_width=16, max_positions=512)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds")
    make_target(d / "tok")  # only its tokenizer is taken
    ds.build(d / "target", d / "tok", seed=1, dtype="float32", **MICRO)
    conversations_file(d / "convs.jsonl", 24)
    return d


def test_the_built_target_is_deepseek_v3_with_v3s_gate_keys(world):
    cfg = json.loads((world / "target" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    # SGLang's deepseek_v2 gate and MoE read these (DeepSeek-V3's config.json has them; transformers does not)
    assert {k: cfg[k] for k in ds.V3_EXTRA} == ds.V3_EXTRA
    assert (cfg["first_k_dense_replace"], cfg["n_routed_experts"], cfg["kv_lora_rank"]) == (2, 8, 32)
    t = targets.load_target(str(world / "target"), device="cpu", dtype=torch.float32)
    assert t.num_layers == 8 and t.fingerprint["model_type"] == "deepseek_v3"
    again = world / "again"
    ds.build(again, world / "tok", seed=1, dtype="float32", **MICRO)
    x, y = load_file(world / "target" / "model.safetensors"), load_file(again / "model.safetensors")
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)  # the seed decides the weights
    with pytest.raises(SystemExit, match="exists"):
        ds.build(again, world / "tok", **MICRO)


def test_trained_exported_for_sglang_and_the_incidents_plus_one_read_by_each_sglang_rule(world, tmp_path):
    tgt = str(world / "target")
    assert cli.main(["datagen", "--target", tgt, "--prompts", str(world / "convs.jsonl"), "--out",
                     str(tmp_path / "data")]) == 0
    assert cli.main(["train", "--target", tgt, "--data", str(tmp_path / "data"), "--out", str(tmp_path / "ck"),
                     "--steps", "4", "--batch-tokens", "512", "--max-len", "256", "--draft-vocab-size", "64",
                     "--no-progress"]) == 0
    assert cli.main(["export", "--draft", str(tmp_path / "ck"), "--format", "sglang", "--out",
                     str(tmp_path / "sg")]) == 0
    # taps [2, 4, 5] as ids [1, 3, 4]: they start at 1, so deepseek_v2's first-id heuristic (0.5.13+, PR #25454)
    # and the older always-+1 rule read them alike (docs/CONVENTIONS.md)
    cfg = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    for version in ("0.5.12", "0.5.17"):
        view = interop.read_engine_view(tmp_path / "sg", "sglang", version, model_type="deepseek_v3", num_layers=8)
        assert list(view.captured_taps) == [2, 4, 5]
    r = diagnose(DoctorRequest(tmp_path / "sg", target=tgt, engine="sglang"))
    assert r.exit_code == 0, [f.code for f in r.findings]
    # Every id +1, the seed incident's edit: [2, 4, 5] no longer starts at 1, so SGLang 0.5.13+ stops adding 1
    # and reads the trained taps after all; before 0.5.13 it still adds 1 and reads [3, 5, 6].
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
    (tmp_path / "sg" / "config.json").write_text(json.dumps(cfg))
    r = diagnose(DoctorRequest(tmp_path / "sg", target=tgt, engine="sglang", engine_version="0.5.17"))
    assert r.exit_code == 0 and r.context["engine_taps"] == [2, 4, 5]
    r = diagnose(DoctorRequest(tmp_path / "sg", target=tgt, engine="sglang", engine_version="0.5.12"))
    assert r.exit_code == 1 and "TAPS_SHIFTED" in [f.code for f in r.findings]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i + 2 for i in ids]  # taps one layer late
    (tmp_path / "sg" / "config.json").write_text(json.dumps(cfg))
    r = diagnose(DoctorRequest(tmp_path / "sg", target=tgt, engine="sglang", engine_version="0.5.17"))
    assert r.exit_code == 1 and r.context["engine_taps"] == [3, 5, 6]


def test_the_lens_reads_each_tap_through_the_targets_own_norm_and_head(world, tmp_path):
    """`--lens`: tap j's share is how often lm_head(norm(hidden_states[j])) picks the model's own greedy token. With
    the last layer's writes zeroed, tap N-1 is the last layer's output, so its share is exactly 1; the embedding's
    is not (the layers before decide)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(world / "target", dtype=torch.float32)
    last = model.model.layers[-1]
    with torch.no_grad():
        for name, w in last.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):  # what it adds
                w.zero_()
        model.model.norm.weight.uniform_(0.2, 2.0)  # so that a lens that skipped the norm would pick otherwise
    model.save_pretrained(tmp_path / "t")
    AutoTokenizer.from_pretrained(world / "target").save_pretrained(tmp_path / "t")
    shares = ds.lens(tmp_path / "t", new_tokens=12)
    assert len(shares) == MICRO["layers"] + 1 and all(0 <= s <= 1 for s in shares)
    assert shares[-2] == 1.0 and shares[-1] == 1.0 and shares[0] < 1.0
