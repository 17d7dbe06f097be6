"""The second registry target, Qwen2.5-Coder-0.5B-Instruct (qwen2: attention biases, untied output layer, a
151,936-token vocabulary, rope 1e6, ChatML with tools): installed from its six registry parts, then the tap
contract, capture and lossless greedy decoding on it, on the CPU in fp32, a few short prompts only."""

import json

import pytest
import torch

from eaglewire import targets
from eaglewire.capture import capture
from eaglewire.checkpoint import load_draft, save_draft
from eaglewire.cli import main
from eaglewire.decode.decoder import SpecConfig, SpecDecoder
from eaglewire.draft import DraftConfig, Eagle3Draft
from eaglewire.taps import TapContract

pytestmark = pytest.mark.slow
NAME = "qwen2.5-coder-0.5b"
PROMPTS = ["Write a Python function that returns the sum of a list.", "What does `git rebase` do?"]


@pytest.fixture(scope="module")
def qwen():
    return targets.load_target(NAME, device="cpu")  # prepared on first use: six parts joined, dequantized once


def test_installs_from_its_parts_with_its_shape(qwen):
    c = qwen.config
    assert (c.model_type, qwen.num_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.vocab_size) == ("qwen2", 24, 896, 14, 2, 151936)
    assert qwen.model.model.layers[0].self_attn.q_proj.bias is not None  # qwen2's attention biases
    record = json.loads((targets.home() / "targets" / NAME / "eaglewire_target.json").read_text())
    assert record["gguf_md5"] == targets.REGISTRY[NAME].md5 and len(record["source"]) == 6
    assert targets.eos_ids(qwen) and "<|im_start|>" in qwen.tokenizer.chat_template


def test_taps_of_24_layers_in_each_engine(capsys):
    assert main(["taps", "--target", NAME, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_layers"] == 24 and out["default_taps"] == [2, 12, 21]
    by = {r["convention"]: r for r in out["engines"]}
    # vLLM: id j = tap j; SGLang's qwen2 adds +1 to what it reads (docs/CONVENTIONS.md)
    assert by["vllm"]["ids"] == [2, 12, 21] and by["sglang"]["ids"] == [1, 11, 20]


def _prompt(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"]


def test_capture_equals_hidden_states(qwen):
    ids = _prompt(qwen.tokenizer, PROMPTS[0])
    contract = TapContract.default(qwen.num_layers)
    got = capture(qwen.model, ids, contract)
    hs = qwen.model(ids, output_hidden_states=True).hidden_states
    H = qwen.config.hidden_size
    for k, tap in enumerate(contract.taps):
        torch.testing.assert_close(got.taps[0, :, k * H:(k + 1) * H], hs[tap][0])


def test_greedy_speculation_is_the_targets_greedy_output(qwen, tmp_path):
    """fp32, a chain of 3 with an untrained draft over a 2,048-token draft vocabulary: every verified token is the
    target's own greedy choice (fused q/k/v with biases, the reduced vocabulary's id table, ChatML's EOS)."""
    contract = TapContract.default(qwen.num_layers)
    save_draft(Eagle3Draft(DraftConfig.for_target(qwen.model.config, 3, 2048)), tmp_path / "d", contract=contract,
               target_fingerprint=qwen.fingerprint)
    draft, meta = load_draft(tmp_path / "d")
    dec = SpecDecoder(qwen, draft, meta, shape=SpecConfig.for_device(torch.device("cpu"), mode="chain", K=3))
    eos = targets.eos_ids(qwen)
    for text in PROMPTS:
        ids = _prompt(qwen.tokenizer, text)
        ref = qwen.model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
        assert dec.generate(ids[0], 12, eos_ids=eos).tokens[:len(ref)] == ref
        assert dec.generate_plain(ids[0], 12, eos_ids=eos).tokens[:len(ref)] == ref
