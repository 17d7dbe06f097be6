"""rounds.py: chain and tree rounds, greedy and sampled, that never wait for the host, against the reference
round that reads each verdict back (decoding.HostRound: step by step, acceptance.py's host rules)."""

import pytest
import torch
from decoding import (CHAIN, TREE, counted_queues, decoder, host_rounds, launch_counter, prompts, reference_greedy,
                      same_samples)

import eaglewire.runtime.runners as runners
from eaglewire.runtime.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def synced(llama, seqs, drafts):
    """shape -> the reference round's results, made once per shape, since `ahead` and `overlap` do not change
    them: on the first 4 prompts, (30 tokens, an EOS mid-way, the generation cut there); on the last, 220 tokens;
    (tree) whether each round kept a branch other than the first nodes. Each checked against the target's own
    greedy tokens."""
    made = {}

    def results(shape):
        key = "tree" if shape is TREE else "chain"
        if key not in made:
            dec = host_rounds(decoder(llama, *drafts["trained"], static_shapes=True, **shape))
            short = []
            for p in prompts(seqs)[:4]:
                full = dec.generate(p, 30)
                assert full.tokens == reference_greedy(llama.model, p, 30), p
                eos = full.tokens[len(full.tokens) // 2]
                short.append((full, eos, dec.generate(p, 30, eos_ids=[eos])))
            long = dec.generate(p, 220).tokens
            assert long == reference_greedy(llama.model, p, 220)
            made[key] = {"short": short, "long": long,
                         "moved": synced_moves(dec, prompts(seqs)[:4]) if shape is TREE else None}
        return made[key]
    return results


@pytest.mark.parametrize("ahead,overlap", [(1, False), (4, False), (1, True), (2, True)])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_rounds_that_never_wait_commit_what_synced_rounds_do(llama, seqs, drafts, synced, monkeypatch, shape, ahead,
                                                             overlap):
    """Greedy decoding runs rounds.py's rounds from the first round on: the verdict stays on the device. A chain
    round is three replays (the draft's extend and chain, the verify, the verdict), a
    tree round four (and the accepted branch's K/V move); outside them only the target's argmax and
    the taps' copy or gather; `ahead` rounds go by between read-backs, and with `overlap` (CUDA) the
    next batch is queued before a read-back. The same tokens and the same acceptance, round by round,
    as the reference round that reads each verdict back (fp32), with EOS and the token limit cutting rounds computed
    past them."""
    replays, Ops = launch_counter(monkeypatch)
    monkeypatch.setattr(runners, "CACHE_ROUNDING", 64)  # so that a longer generation grows the caches
    monkeypatch.setattr(runners.TargetRunner, "prefill_chunk", 32)
    fast = decoder(llama, *drafts["trained"], static_shapes=True, **shape)
    ref = synced(shape)
    fast.rounds_ahead, fast.rounds_overlap = ahead, overlap
    reads = counted_queues(monkeypatch, fast.rounds, replays, Ops)

    def wasted(generate):  # rounds computed past the end of a generation
        before = sum(count for count, _, _ in reads)
        res = generate()
        return res, sum(count for count, _, _ in reads) - before - len(res.accepted_per_step)

    for p, (full, eos, cut) in zip(prompts(seqs)[:4], ref["short"]):
        got, waste = wasted(lambda: fast.generate(p, 30))
        assert got.tokens == full.tokens and got.accepted_per_step == full.accepted_per_step, p
        assert got.stop == "length" and waste == 0  # never more rounds queued than the limit could need
        got, waste = wasted(lambda: fast.generate(p, 30, eos_ids=[eos]))
        assert got.tokens == cut.tokens and got.stop == "eos" and got.accepted_per_step == cut.accepted_per_step
        assert 0 <= waste < (2 * ahead if overlap else ahead)
    assert sum(sum(full.accepted_per_step) for full, _, _ in ref["short"]) > 0  # the draft's tokens are kept
    long = fast.generate(p, 220)  # a larger cache: every runner's static functions made anew (new graphs on CUDA)
    assert long.tokens == ref["long"]
    rounds = fast.rounds
    assert rounds.statics == rounds._current() and rounds.verdict["committed"].shape[0] > 64
    tree = shape is TREE
    assert len(reads) > 8 and max(count for count, _, _ in reads) == ahead
    for count, replayed, names in reads[1:]:  # (the first made the rounds' static functions)
        assert replayed == (4 if tree else 3) * count, names
        launched = [n for n in names if n not in ("select", "slice")]  # views: no kernel
        assert sorted(launched) == sorted(["argmax", "index_select" if tree else "copy_"] * count), names
    if tree:  # some rounds kept a branch that is not the first nodes: the move did move
        assert any(ref["moved"])
    # each is a CUDA graph on a GPU: no host read-back inside (make_fx refuses _local_scalar_dense)
    from torch.fx.experimental.proxy_tensor import make_fx
    args = (fast.spec.depth,) if tree else (fast.spec.K - 1,)
    for fn, buffers, extra in ((rounds._draft_round, rounds.extend, () if tree else args),
                               (rounds._verdict, rounds.verdict, args if tree else ())):
        keys = sorted(buffers)
        with torch.no_grad():
            make_fx(lambda *v: fn(dict(zip(keys, v)), *extra))(*[buffers[k].clone() for k in keys])


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_sampled_rounds_commit_what_synced_sampled_rounds_do(llama, seqs, drafts, monkeypatch, shape, overlap):
    """Sampling on static shapes runs rounds too, its verdict on the device: speculative sampling's for a chain
    (SampledChainRounds), the tree walk with a draw at each row for a tree (SampledTreeRounds). With the
    round's uniform draws made in the reference round's order, the same seed gives the same tokens and
    acceptance, round by round (fp32), as the reference round. A chain round is three replays, two draws and two copies; a tree
    round four replays, one draw, the logits' copy and the taps' gather."""
    replays, Ops = launch_counter(monkeypatch)
    fast = decoder(llama, *drafts["perturbed"], static_shapes=True, **shape)
    synced = host_rounds(decoder(llama, *drafts["perturbed"], static_shapes=True, **shape))
    fast.rounds_overlap = overlap
    hot = SamplingParams(temperature=1.2, top_k=12)
    reads = counted_queues(monkeypatch, fast._rounds_for(hot, None), replays, Ops)
    assert same_samples(synced, fast, hot, prompts(seqs)[:4], seeds=2, new=24) > 16 and len(reads) > 8
    tree = shape is TREE
    for count, replayed, names in reads[1:]:  # (the first made the rounds' static functions)
        assert replayed == (4 if tree else 3) * count, names
        launched = [n for n in names if n not in ("select", "slice")]
        each = ["uniform_", "copy_", "index_select"] if tree else ["uniform_", "uniform_", "copy_", "copy_"]
        assert sorted(launched) == sorted(each * count), names
    from torch.fx.experimental.proxy_tensor import make_fx  # the verdict is a CUDA graph on a GPU: no read-back
    r = fast._rounds_for(hot, None)
    keys, extra = sorted(r.verdict), (fast.spec.depth,) if tree else ()
    with torch.no_grad():
        make_fx(lambda *v: r._verdict(dict(zip(keys, v)), *extra))(*[r.verdict[k].clone() for k in keys])


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_overlapped_read_backs_through_pinned_mirrors(llama, seqs, drafts, monkeypatch, shape):
    """On CUDA a batch's verdicts are copied to pinned host mirrors behind its last replay, and read
    there once its event has passed. Here the mirrors are CPU tensors and the event a stand-in: each
    batch copied once, each read after its copy, and the tokens those of the reference round."""
    import eaglewire.decode.rounds as rounds_mod
    events = []

    class Event:  # torch.cuda.Event's part that rounds.py uses
        def __init__(self):
            self.recorded = self.waited = False
            events.append(self)

        def record(self):
            self.recorded = True

        def synchronize(self):
            assert self.recorded
            self.waited = True

    monkeypatch.setattr(rounds_mod.torch.cuda, "Event", Event)
    fast = decoder(llama, *drafts["trained"], static_shapes=True, **shape)
    synced = host_rounds(decoder(llama, *drafts["trained"], static_shapes=True, **shape))
    fast.rounds_ahead, fast.rounds_overlap = 2, True
    p = prompts(seqs)[0]
    fast.generate(p, 40)  # makes the rounds' buffers; the mirrors then stand in for pinned ones
    r = fast.rounds
    r.host = tuple(torch.full_like(t, -1) for t in (r.verdict["accepted"], r.verdict["committed"]))
    events.clear()
    got = fast.generate(p, 40)
    assert r.statics == r._current()  # the same buffers: no remake dropped the mirrors
    assert got.tokens == synced.generate(p, 40).tokens and events and all(e.waited for e in events[:-1])
    k = len(got.accepted_per_step)  # every round, the first included
    assert (r.host[0][:k] >= 0).all() and torch.equal(r.host[1][:k], r.verdict["committed"][:k])


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_verifies_spelt_as_matmuls_keep_greedy_tokens(llama, seqs, drafts, monkeypatch, shape):
    """`decode_steps.py --attention matmul`: grouped attention with every verify's rows (a chain's causal block,
    a tree's mask) as matmuls gives target-only greedy tokens (fp32)."""
    import eaglewire.runtime.attention as attention

    monkeypatch.setattr(attention, "MATMUL_MAX_ROWS", 64)
    dec = decoder(llama, *drafts["trained"], static_shapes=True, grouped_attention=True, **shape)
    assert dec.applied.grouped_attention
    for p in prompts(seqs)[:2]:
        assert dec.generate(p, 24).tokens == reference_greedy(llama.model, p, 24), p


def synced_moves(dec, ps) -> list[bool]:
    """Whether each reference round of `dec` (host_rounds) over prompts `ps` kept a branch other than the first
    nodes."""
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
