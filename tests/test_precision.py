"""benchmarks/precision.py: bf16 against fp32 replayed on one fixed text (the fp32 target's greedy continuation),
on the doctor's tiny chat target and a draft fitted to read its taps. The bench's bf16 and fp32 runs write
different texts, so their acceptance differs by the text as much as by the precision (benchmarks/results run 21:
-6.9%, paired interval -0.48..+0.08 over 20 prompts); on one text the precision's own cost is measured, and it
must stay within 2% of fp32 in every part (runs 21-22: within 1% on SmolLM2)."""

import json
import sys
from pathlib import Path

import doctor_fixtures as fx
import pytest
import torch
from chat_target import char_tokenizer
from decoding import fit, new_draft

from eaglewire import checkpoint
from eaglewire.taps import TapContract

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import precision  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TAPS = (2, 4, 7)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("precision")
    model = fx.probe_target()
    model.save_pretrained(d / "target")
    char_tokenizer().save_pretrained(d / "target")
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 128, (48,), generator=g) for _ in range(16)]
    # fitted briefly, so that its rounds vary by prompt
    draft = fit(new_draft(model, TapContract(8, TAPS)), model, TapContract(8, TAPS), seqs, steps=40)
    checkpoint.save_draft(draft, d / "ck", contract=TapContract(8, TAPS),
                          target_fingerprint=fx.as_target(model).fingerprint)
    (d / "suite.txt").write_text("say hello\nname three colours\ncount to five\nspell water\nadd two and two\n")
    return d


@pytest.mark.parametrize("text", ["fp32", "bf16"])
def test_every_part_in_bf16_accepts_as_fp32_on_one_text(world, capsys, text):
    """On either target's own greedy text (--text bf16: the text a bf16 decoder writes)."""
    out = world / f"p_{text}.json"
    assert precision.main(["--draft", str(world / "ck"), "--target", str(world / "target"), "--suite",
                           str(world / "suite.txt"), "--max-prompts", "5", "--new-tokens", "40", "--chain", "4",
                           "--text", text, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["text"] == text
    for row in r["rows"]:  # the per-prompt tallies a paired comparison across two runs needs
        pp = row["per_prompt"]
        assert len(pp["tokens"]) == len(pp["rounds"]) == 5
        assert abs(sum(pp["tokens"]) / sum(pp["rounds"]) - row["acceptance_length"]) < 1e-9
    rows = {x["config"]: x for x in r["rows"]}
    assert list(rows) == ["fp32 reference", "draft weights bf16-rounded", "draft in bf16", "taps from bf16 target",
                          "bf16 target", "all bf16", "all bf16, the speed-ups"]
    ref = rows["fp32 reference"]["acceptance_length"]
    assert ref > 1.5  # the draft accepts: a comparison with something in it
    for name, row in rows.items():
        assert abs(row["acceptance_length"] - ref) <= 0.02 * ref, (name, row["acceptance_length"], ref)
    assert r["prompts"] == 5 and r["argmax_flips"]["positions"] == 5 * 39
    printed = capsys.readouterr().out
    assert "paired 95% interval" in printed and f"on the {text} target's greedy text" in printed


def test_rounding_is_what_a_bf16_copy_holds(world):
    d, _ = checkpoint.load_draft(world / "ck", dtype=torch.float32)
    r = precision.rounded(d)
    for a, b in zip(d.parameters(), r.parameters()):
        assert b.dtype == torch.float32 and torch.equal(b, a.to(torch.bfloat16).float())
    assert any(not torch.equal(a, b) for a, b in zip(d.parameters(), r.parameters()))


@pytest.mark.parametrize("decoder", ["bench", "rounds"])
def test_on_the_decoders_own_text_the_replay_counts_what_the_decoder_accepted(world, capsys, decoder):
    """--text decoder: the text our bf16 speculative decoder writes (what `bench --dtype bf16` scores), with the
    decoder's own count beside the replay's. The replay walks the decoder's rounds on the decoder's verdicts, so
    the two agree prompt by prompt wherever the replay reproduces the decoder; a gap here would be the decoder's.
    Both the host loop (bench's CPU path) and the device-side rounds (a GPU's, here on static shapes uncompiled)."""
    out = world / f"p_decoder_{decoder}.json"
    assert precision.main(["--draft", str(world / "ck"), "--target", str(world / "target"), "--suite",
                           str(world / "suite.txt"), "--max-prompts", "5", "--new-tokens", "40", "--chain", "4",
                           "--text", "decoder", "--decoder", decoder, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["decoder"] == decoder
    rows = {x["config"]: x for x in r["rows"]}
    assert list(rows)[-1] == "the decoder, as it ran" and rows["the decoder, as it ran"]["acc1"] is None
    ran, replay = rows["the decoder, as it ran"], rows["all bf16, the speed-ups"]
    assert ran["acceptance_length"] > 1.5
    assert len(set(ran["per_prompt"]["rounds"])) > 1  # prompts differ: agreeing on each one means something
    assert ran["per_prompt"] == replay["per_prompt"]
    assert ran["accepted_per_pos"] == pytest.approx(replay["accepted_per_pos"])
    assert "on our bf16 speculative decoder's text" in capsys.readouterr().out
