"""Target specs, fingerprints, and the embedded default target (real SmolLM2-135M-Instruct)."""

import json

import pytest
import torch

from eaglewire import targets
from eaglewire.capture import capture
from eaglewire.cli import main
from eaglewire.errors import UsageError
from eaglewire.taps import TapContract

from tiny import tiny_model


def test_resolve_rejects_what_is_not_a_target(tmp_path):
    with pytest.raises(UsageError, match="not a registry name"):
        targets.resolve(str(tmp_path / "nothing"))
    with pytest.raises(UsageError, match="no config.json"):
        targets.resolve(str(tmp_path))
    with pytest.raises(UsageError, match="no such GGUF file"):
        targets.resolve(str(tmp_path / "x.gguf"))
    with pytest.raises(UsageError, match="unknown target"):
        targets.prepare("gpt-17")


def test_fingerprint_is_dtype_independent_and_sensitive_to_weights():
    model = tiny_model("llama")
    fp32 = targets.fingerprint(model)
    bf16 = targets.fingerprint(tiny_model("llama").to(torch.bfloat16))
    assert fp32 == bf16
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.mul_(1.5)
    changed = targets.fingerprint(model)
    assert changed["weights_hash"] != fp32["weights_hash"]
    diffs = targets.compare_fingerprints(fp32, changed, "data")
    assert diffs == [f"data: weights_hash is {changed['weights_hash']!r}, expected {fp32['weights_hash']!r}"]


def test_local_directory_target_loads(tmp_path):
    model = tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    t = targets.load_target(str(tmp_path), device="cpu")
    assert t.num_layers == 8 and t.fingerprint["model_type"] == "qwen3"
    assert t.fingerprint["weights_hash"] == targets.fingerprint(model)["weights_hash"]


@pytest.fixture(scope="session")
def smollm2():
    return targets.load_target("smollm2-135m", device="cpu")


@pytest.mark.slow
def test_embedded_default_installs_and_answers(smollm2):
    t = smollm2
    assert (t.num_layers, t.config.hidden_size, t.config.vocab_size) == (30, 576, 49152)
    assert sum(p.numel() for p in t.model.parameters()) == 134_515_008
    tok = t.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = t.model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
    # capture on the real target: default taps, pre-norm tap 30 on request
    got = capture(t.model, ids, TapContract.default(30), final_norm=True)
    assert got.taps.shape == (1, ids.shape[1], 3 * 576)


@pytest.mark.slow
def test_taps_command_on_embedded_default(capsys):
    assert main(["taps", "--target", "smollm2-135m", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_layers"] == 30 and out["default_taps"] == [2, 15, 27]
    by = {r["convention"]: r for r in out["engines"]}
    assert by["sglang"]["ids"] == [1, 14, 26] and by["vllm"]["ids"] == [2, 15, 27]


def test_taps_command_usage_error_is_one_line(capsys):
    assert main(["taps", "--target", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a registry name" in err[0]
