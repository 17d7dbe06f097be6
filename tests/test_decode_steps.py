"""benchmarks/decode_steps.py's accounting of a round's graph replays (its GPU timing needs CUDA)."""

import sys
from pathlib import Path

import eaglewire.decode as decode
from eaglewire.runners import SlotRunner
from decoding import CHAIN, TREE, fake_capture, prompts, reference_greedy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from decode_steps import replays_per_round  # noqa: E402


def test_replays_are_counted_per_round_without_the_prefill(llama, seqs, drafts, monkeypatch):
    """A greedy chain round replays the draft's extend-and-chain and the verify (and after the first
    round, ChainRounds' verdict); a tree round the draft's extend, its one-replay tree, the verify and, when a branch is
    kept, the move. The target's prefill chunks are not a round's work. A broken count (e.g. the
    prefill counted, or a graph left out) would make the benchmark's host time wrong."""
    monkeypatch.setattr(SlotRunner, "_capture", fake_capture)
    p = prompts(seqs)[0]
    for shape in (CHAIN, TREE):
        dec = decode.SpecDecoder(llama, *drafts["trained"], static_shapes=True, **shape)
        for r in (dec.verifier, dec.drafter):
            r.cuda_graphs = True
        dec.generate(p, 16)  # every size met is captured
        per_round, res = replays_per_round([dec.drafter, dec.verifier], lambda: dec.generate(p, 16))
        assert res.tokens == reference_greedy(llama.model, p, 16)
        verify = {k: v for k, v in per_round.items() if k.startswith("TargetRunner(")}
        assert verify == {f"TargetRunner{(dec.verifier.sizes[0], ('ids',))}": 1.0}, per_round
        draft = [k for k in per_round if k.startswith("DraftRunner")]
        if shape is CHAIN:  # the first round's extend-and-chain (the prompt's), then ChainRounds: its
            # extend-and-chain and its verdict, a replay each a round
            rows = dec.spec.K + 1
            rounds, verdict = f"DraftRunner{('rounds', rows, dec.spec.K - 1)}", f"DraftRunner{('verdict', rows)}"
            assert sum(per_round[k] for k in draft if k != verdict) == 1.0, per_round
            assert per_round[rounds] == per_round[verdict] > 0.5, per_round
        else:
            extends = sum(per_round[k] for k in draft if "'ids'" in k)
            tree = f"DraftRunner{('tree', TREE['depth'], TREE['topk'], TREE['budget'])}"
            assert extends == 1.0 and per_round[tree] == 1.0, per_round
        assert "prefill" not in dec.verifier.__dict__  # the wrapper is gone
    assert 0 < per_round["TargetRunnermove"] <= 1  # the tree kept a branch in some rounds, at most once a round
