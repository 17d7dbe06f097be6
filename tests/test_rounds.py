"""rounds.py: greedy chain and tree rounds that never wait for the host, against rounds that read each
verdict back (decode.py's synced path)."""

import pytest
import torch

import eaglewire.decode as decode
import eaglewire.runners as runners
from decoding import CHAIN, TREE, launch_counter, prompts, reference_greedy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("ahead", [1, 4])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_rounds_that_never_wait_commit_what_synced_rounds_do(llama, seqs, drafts, monkeypatch, shape, ahead):
    """Greedy decoding on static shapes runs rounds.py after its first round: the verdict stays on the
    device. A chain round is three replays (the draft's extend and chain, the verify, the verdict), a
    tree round four (and the accepted branch's K/V move); outside them only the target's argmax and
    the taps' copy or gather; `ahead` rounds go by between read-backs. The same tokens and the same
    acceptance, round by round, as rounds that read each verdict back (fp32), with EOS and the token
    limit cutting rounds computed past them."""
    replays, Ops = launch_counter(monkeypatch)
    monkeypatch.setattr(runners, "CACHE_ROUNDING", 64)  # so that a longer generation grows the caches
    monkeypatch.setattr(runners.TargetRunner, "prefill_chunk", 32)
    fast = decode.SpecDecoder(llama, *drafts["trained"], static_shapes=True, **shape)
    synced = decode.SpecDecoder(llama, *drafts["trained"], static_shapes=True, **shape)
    synced.rounds = None
    fast.rounds_ahead = ahead
    reads, run = [], fast.rounds.run

    def counted(count):
        replays.clear()
        with Ops() as ops:
            out = run(count)
        reads.append((count, len(replays), ops.names))
        return out

    monkeypatch.setattr(fast.rounds, "run", counted)

    def wasted(generate):  # rounds computed past the end of a generation
        before = sum(count for count, _, _ in reads)
        res = generate()
        return res, sum(count for count, _, _ in reads) - before - (len(res.accepted_per_step) - 1)

    kept = 0
    for p in prompts(seqs)[:4]:
        ref = synced.generate(p, 30)
        kept += sum(ref.accepted_per_step)
        assert ref.tokens == reference_greedy(llama.model, p, 30), p
        got, waste = wasted(lambda: fast.generate(p, 30))
        assert got.tokens == ref.tokens and got.accepted_per_step == ref.accepted_per_step, p
        assert got.stop == "length" and waste == 0  # never more rounds queued than the limit could need
        eos = ref.tokens[len(ref.tokens) // 2]
        cut = synced.generate(p, 30, eos_ids=[eos])
        got, waste = wasted(lambda: fast.generate(p, 30, eos_ids=[eos]))
        assert got.tokens == cut.tokens and got.stop == "eos" and got.accepted_per_step == cut.accepted_per_step
        assert 0 <= waste < ahead
    assert kept > 0  # the draft proposes tokens the target keeps
    long = fast.generate(p, 220)  # a larger cache: every runner's static functions made anew (new graphs on CUDA)
    assert long.tokens == synced.generate(p, 220).tokens == reference_greedy(llama.model, p, 220)
    rounds = fast.rounds
    assert rounds.statics == rounds._current() and rounds.verdict["tokens"].shape[0] > 64
    tree = shape is TREE
    assert len(reads) > 8 and max(count for count, _, _ in reads) == ahead
    for count, replayed, names in reads[1:]:  # (the first made the rounds' static functions)
        assert replayed == (4 if tree else 3) * count, names
        launched = [n for n in names if n not in ("select", "slice")]  # views: no kernel
        assert sorted(launched) == sorted(["argmax", "index_select" if tree else "copy_"] * count), names
    if tree:  # some rounds kept a branch that is not the first nodes: the move did move
        assert any(r for r in synced_moves(synced, prompts(seqs)[:4]))
    # each is a CUDA graph on a GPU: no host read-back inside (make_fx refuses _local_scalar_dense)
    from torch.fx.experimental.proxy_tensor import make_fx
    args = (fast.spec.depth,) if tree else (fast.spec.K - 1,)
    for fn, buffers, extra in ((rounds._draft_round, rounds.extend, () if tree else args),
                               (rounds._verdict, rounds.verdict, args if tree else ())):
        keys = sorted(buffers)
        with torch.no_grad():
            make_fx(lambda *v: fn(dict(zip(keys, v)), *extra))(*[buffers[k].clone() for k in keys])


def synced_moves(dec, ps) -> list[bool]:
    """Whether each synced round of `dec` over prompts `ps` kept a branch other than the first nodes."""
    moved, commit = [], dec.verifier.commit

    def watched(keep):
        if not isinstance(keep, int):
            moved.append(list(keep) != list(range(len(keep))))
        return commit(keep)

    dec.verifier.commit = watched
    try:
        for p in ps:
            dec.generate(p, 30)
    finally:
        del dec.verifier.commit
    return moved
