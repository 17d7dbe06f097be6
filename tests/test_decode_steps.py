"""benchmarks/decode_steps.py's accounting of a round's graph replays (its GPU timing needs CUDA)."""

import sys
from pathlib import Path

import pytest

import eaglewire.decode as decode
from eaglewire.runners import SlotRunner
from decoding import CHAIN, TREE, fake_capture, prompts, reference_greedy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from decode_steps import replays_per_round  # noqa: E402


def test_replays_are_counted_per_round_without_the_prefill(llama, seqs, drafts, monkeypatch):
    """A greedy round's replays: the first (synced) round's draft extend and drafting (a chain's in one
    replay, a tree's extend and tree), the verify, and a tree's move when it kept a branch; every later
    round rounds.py's: the draft's round, the verify, the verdict (and a tree's move, every round). The
    target's prefill chunks are not a round's work. A broken count (e.g. the prefill counted, or a graph
    left out) would make the benchmark's host time wrong."""
    monkeypatch.setattr(SlotRunner, "_capture", fake_capture)
    p = prompts(seqs)[0]
    for shape in (CHAIN, TREE):
        dec = decode.SpecDecoder(llama, *drafts["trained"], static_shapes=True, **shape)
        for r in (dec.verifier, dec.drafter):
            r.cuda_graphs = True
        dec.generate(p, 16)  # every size met is captured
        per_round, res = replays_per_round([dec.drafter, dec.verifier], lambda: dec.generate(p, 16))
        assert res.tokens == reference_greedy(llama.model, p, 16)
        first = 1 / res.num_steps  # the synced first round's share
        verify = f"TargetRunner{(dec.verifier.sizes[0], ('ids',))}"
        assert per_round[verify] == 1.0, per_round
        draft_round, _, verdict, *move = (f"{type(r).__name__}{k}" for r, k in dec.rounds.keys)
        assert per_round[draft_round] == per_round[verdict] == pytest.approx(1 - first), per_round
        synced = sum(per_round[k] for k in per_round if k.startswith("DraftRunner") and k not in (draft_round, verdict))
        if shape is CHAIN:  # the first round's extend-and-chain
            assert synced == pytest.approx(first), per_round
        else:  # the first round's extend and tree; the rounds' move every round, the synced one's at most once
            assert synced == pytest.approx(2 * first), per_round
            assert per_round[move[0]] == pytest.approx(1 - first), per_round
            assert per_round.get("TargetRunnermove", 0) <= first
        assert "prefill" not in dec.verifier.__dict__  # the wrapper is gone
