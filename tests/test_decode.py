"""SpecDecoder on tiny random models (fp32, CPU); its slot runners alone: test_runners.py.

Greedy speculative output must equal target-only greedy output token for token (a full forward
per token, no cache: the reference shares no code with the decoder); sampling must be lossless
(chi-square against the target's exact marginals, with negative controls that a broken verifier
fails). Drafts: random (acceptance ~0), trained a few steps on the target's own continuations
(acceptance between 0 and 100%), and that one perturbed.
"""

import warnings

import pytest
import torch
from decoding import (CHAIN, CONTRACT, TREE, as_target, decoder, fake_capture, fit, host_rounds, launch_counter,
                      new_draft, prompts, reference_greedy, same_samples, save_load)
from tiny import tiny_model

import eaglewire.decode.decoder as decode
import eaglewire.decode.rounds as rounds_mod
import eaglewire.decode.tree as tree_mod
from eaglewire.runtime.compiled import CompileError
from eaglewire.runtime.runners import SlotRunner
from eaglewire.runtime.sampling import SamplingParams, logits_to_probs, sample_with
from eaglewire.errors import UsageError
from eaglewire.taps import TapContract

pytestmark = pytest.mark.usefixtures("one_thread")

# --- greedy: token for token ----------------------------------------------------------------------

@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("static", [False, True], ids=["exact", "static"])
def test_greedy_equals_target_greedy(llama, seqs, drafts, shape, static):
    """Trained and perturbed drafts: every prompt's output equals target-only greedy, and the
    acceptance is neither 0 nor 100%, so accepted, rejected and bonus paths all ran."""
    accepted = []
    for name in ("trained", "perturbed"):
        dec = decoder(llama, *drafts[name], static_shapes=static, **shape)
        for p in prompts(seqs):
            res = dec.generate(p, 32)
            assert res.tokens == reference_greedy(llama.model, p, 32), (name, p)
            accepted += res.accepted_per_step
    levels = shape.get("K") or shape["depth"]
    assert 0 in accepted and max(accepted) == levels  # full rejections and fully accepted rounds
    assert 1.3 < (sum(accepted) + len(accepted)) / len(accepted) < levels + 1


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_with_a_deeper_draft_equals_target_greedy(llama, seqs, drafts, shape, tmp_path):
    """A draft of two layers (the trained one deepened, its new layer moved off the identity): every draft
    step's two KV caches, in the exact and the static decoder, still leave target greedy's tokens."""
    deep = drafts["trained"][0].deepened(2)
    with torch.no_grad():
        for p in deep.layers[1].parameters():
            p.add_(0.05 * torch.randn_like(p))
    deep = save_load(deep, CONTRACT, llama, tmp_path / "deep")
    assert deep[0].config.num_layers == 2
    for static in (False, True):
        dec = decoder(llama, *deep, static_shapes=static, **shape)
        accepted = []
        for p in prompts(seqs):
            res = dec.generate(p, 24)
            assert res.tokens == reference_greedy(llama.model, p, 24), (static, p)
            accepted += res.accepted_per_step
        assert max(accepted) > 0  # the deeper draft's proposals were accepted too


@pytest.mark.parametrize("shape, keys", [(CHAIN, {"rounds", "sampled_rounds"}),
                                         (TREE, {"tree_rounds", "sampled_tree_rounds"})], ids=["chain", "tree"])
def test_one_replay_drafting_drafts_what_step_by_step_drafting_does(llama, seqs, drafts, shape, keys):
    """Static runners draft in rounds.py's rounds, from the first round on: the round's extend and a greedy
    chain (DraftRunner.extend_chain), a sampled one (given the round's uniform draws), or the extend and a
    tree expanded, pruned and masked (DraftRunner.extend_tree), as one function; the reference round
    (decoding.HostRound, on exact runners) goes step by step. Greedy output equality cannot see a wrong draft token (the verifier only
    rejects it), the acceptance of every round can; sampled rounds must match token for token too (a
    tree's candidates are deterministic)."""
    accepted = []
    for name in ("trained", "perturbed"):
        exact = host_rounds(decoder(llama, *drafts[name], static_shapes=False, **shape))
        one = decoder(llama, *drafts[name], static_shapes=True, **shape)
        for p in prompts(seqs):
            a, b = exact.generate(p, 32), one.generate(p, 32)
            assert a.tokens == b.tokens and a.accepted_per_step == b.accepted_per_step, (name, p)
            accepted += b.accepted_per_step
        hot = SamplingParams(temperature=0.8, top_p=0.9)
        a, b = exact.generate(prompts(seqs)[0], 24, hot, seed=3), one.generate(prompts(seqs)[0], 24, hot, seed=3)
        assert a.tokens == b.tokens and a.accepted_per_step == b.accepted_per_step, name
        assert keys <= {k[0] for k in one.drafter._static}
    assert 0 in accepted and max(accepted) == (shape.get("K") or shape["depth"])  # rejections and full rounds


def test_a_tree_drafted_with_the_top_k_by_groups_drafts_what_atens_top_k_does(llama, seqs, drafts, monkeypatch):
    """The draft's top-k by groups (tree.top_k_by_groups, CUDA's way), forced onto this CPU with groups of 16 of the
    128-token vocabulary: the reference round on exact runners (decoding.HostRound) and rounds.py's tree rounds on
    static ones accept, round for round, what they accept with aten's top-k, greedy and sampled (fp32 logits do not tie, so the candidates are the same tokens)."""
    hot = SamplingParams(temperature=0.8, top_p=0.9)
    runs = {}
    for way in ("aten", "groups"):
        if way == "groups":
            monkeypatch.setattr(tree_mod, "TOPK_GROUP_DEVICES", ("cpu",))
            monkeypatch.setattr(tree_mod, "TOPK_GROUP", 16)  # 8 groups, 3 chosen
        for static in (False, True):
            dec = decoder(llama, *drafts["trained"], static_shapes=static, **TREE)
            if not static:
                host_rounds(dec)
            runs[way, static] = [(r.tokens, r.accepted_per_step) for r in
                                 [dec.generate(p, 24) for p in prompts(seqs)[:4]] +
                                 [dec.generate(prompts(seqs)[0], 24, hot, seed=3)]]
    for static in (False, True):
        assert runs["groups", static] == runs["aten", static], static
    assert sum(sum(acc) for _, acc in runs["groups", True]) > 10  # the trees' candidates were accepted


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.5), SamplingParams(temperature=1.0, top_k=8,
                                                                                          top_p=0.95)])
def test_a_sampled_chain_in_one_replay_draws_what_the_steps_draw(llama, seqs, drafts, sampling):
    """SampledChainRounds: the K-1 feedback steps of a sampled chain inside one static function, each token
    drawn with the round's uniform draw for its step (sampling.sample_with), the same tokens and the
    same acceptance as drafting step by step with the same draws, over prompts and seeds."""
    exact = host_rounds(decoder(llama, *drafts["perturbed"], static_shapes=False, **CHAIN))
    one = decoder(llama, *drafts["perturbed"], static_shapes=True, **CHAIN)
    assert same_samples(exact, one, sampling, prompts(seqs)[:4], seeds=3, new=20) > 20
    assert any(k[0] == "sampled_rounds" for k in one.drafter._static)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_after_a_prefill_in_chunks(llama, seqs, drafts, shape):
    """Prompts of 1 to 9 tokens prefilled 3 rows at a time (overlapping last chunks included), then
    decoded: target-only greedy, with the draft and without."""
    dec = decoder(llama, *drafts["trained"], static_shapes=True, **shape)
    dec.verifier.prefill_chunk = dec.plain.prefill_chunk = 3
    for p in prompts(seqs):
        ref = reference_greedy(llama.model, p, 16)
        assert dec.generate(p, 16).tokens == ref, p
        assert dec.generate_plain(p, 16).tokens == ref, p


@pytest.mark.parametrize("shape", [dict(mode="chain", K=1), dict(mode="chain", K=9),
                                   dict(mode="tree", depth=1, topk=4, budget=4),
                                   dict(mode="tree", depth=5, topk=2, budget=3),
                                   dict(mode="tree", depth=3, topk=5, budget=40)],
                         ids=["K1", "K9", "depth1", "budget3", "budget40"])
def test_greedy_edge_shapes(llama, seqs, drafts, shape):
    dec = decoder(llama, *drafts["trained"], static_shapes=True, **shape)
    for p in prompts(seqs)[:4]:
        assert dec.generate(p, 24).tokens == reference_greedy(llama.model, p, 24)


def test_random_draft_and_plain_decoding(llama, seqs, drafts):
    dec = decoder(llama, *drafts["random"], **TREE)
    for p in prompts(seqs)[3:]:
        ref = reference_greedy(llama.model, p, 24)
        assert dec.generate(p, 24).tokens == ref
        plain = dec.generate_plain(p, 24)
        assert plain.tokens == ref and plain.num_steps == 23 and plain.accepted_per_step == []
    no_draft = decoder(llama, static_shapes=True)
    assert no_draft.generate(p, 24).tokens == ref  # generate without a draft = plain decoding


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_greedy_other_families(family, tmp_path):
    """qwen3 (q/k norms, head_dim override) and gpt2 (learned positions: generating up to the end of
    its 32-position table, the last verify runs past it, clamped; those rows are never used)."""
    import transformers as tf

    torch.manual_seed(3)
    m = tiny_model("qwen3", seed=3) if family == "qwen3" else tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=128, n_embd=32, n_layer=8, n_head=4, n_positions=32)).eval()
    t = as_target(m)
    d, meta = save_load(new_draft(m), CONTRACT, t, tmp_path / "d")
    p = [3, 1, 4, 1, 5]
    ref = reference_greedy(m, p, 27)
    for shape in (CHAIN, TREE):
        dec = decoder(t, d, meta, static_shapes=True, **shape)
        assert dec.generate(p, 27).tokens == ref


def test_fake_cuda_graphs_replay_static_buffers(llama, seqs, drafts, monkeypatch):
    """The graph path's plumbing on a CPU: capture runs once, replay re-runs into the SAME output
    tensors (as a CUDA graph does), so a missing input copy or a stale output would show."""
    captured = []
    monkeypatch.setattr(SlotRunner, "_capture", lambda self, fn: fake_capture(self, fn, captured))
    for shape in (CHAIN, TREE):
        dec = decoder(llama, *drafts["trained"], static_shapes=True, **shape)
        for r in (dec.verifier, dec.drafter, dec.plain):
            r.cuda_graphs = True
        for p in prompts(seqs)[2:5]:  # 4, 1 and 5 (= K+1: a prefill the size of a graph) tokens
            ref = reference_greedy(llama.model, p, 24)
            assert dec.generate(p, 24).tokens == ref
            assert dec.generate_plain(p, 24).tokens == ref
    # per decoder: one verify graph, one plain graph and a prefill-chunk graph for each of those two
    # runners; the draft's round and verdict (rounds.py; the draft's prefill is exact, no graph); the tree
    # decoder also moves accepted branches down in one graph, rounds.py's (replayed: the tokens above hold)
    assert any(k[0] == "tree_move" for k in dec.verifier._static) and captured.count("DraftRunner") >= 4
    assert captured.count("TargetRunner") == 9


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_the_drafts_steps_fused_and_grouped_propose_the_same_tokens(llama, seqs, drafts, shape):
    """The decoder runs the draft's steps on a copy with q/k/v and gate/up fused and K/V heads read in
    place (as its target on CUDA): the same proposals, so the same acceptance, step by step (fp32);
    the caller's draft keeps its own modules."""
    from eaglewire.runtime.attention import GroupedDraftAttention
    from eaglewire.runtime.projections import FusedFirst
    from eaglewire.draft import DraftAttention

    draft, meta = drafts["trained"]
    runs = {}
    for fast in (False, True):
        dec = decoder(llama, draft, meta, static_shapes=True, fuse_projections=fast,
                      grouped_attention=fast, prepack=False, **shape)
        engine = dec.drafter.draft
        attn = [m for m in engine.modules() if isinstance(m, DraftAttention)]
        grouped = [m.inner for m in engine.modules() if isinstance(m, GroupedDraftAttention)]
        assert attn and grouped == (attn if fast else [])  # every attention module wrapped, or none
        assert any(isinstance(m, FusedFirst) for m in engine.modules()) is fast
        runs[fast] = [dec.generate(p, 24) for p in prompts(seqs)[:4]]
    for slow, fast in zip(runs[False], runs[True]):
        assert fast.tokens == slow.tokens and fast.accepted_per_step == slow.accepted_per_step
    assert sum(sum(r.accepted_per_step) for r in runs[True]) > 0  # the draft proposes tokens that are kept
    assert not any(isinstance(m, GroupedDraftAttention) for m in draft.modules())
    assert not any(isinstance(m, FusedFirst) for m in draft.modules())


def test_compiled_greedy_equals_target_greedy(llama, seqs, drafts):
    """compile=True (static shapes, no graphs on a CPU): the same tokens; one compiled graph per padded
    size and input kind the runners met, and none more when the prompts run again (dynamo's counters)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    ps = prompts(seqs)[1:4]  # 4, 4 and 1 prompt tokens (an extend of one row: a size of its own)
    seen = set()
    for shape in (CHAIN, TREE):
        before = counters["stats"]["unique_graphs"]
        dec = decoder(llama, *drafts["trained"], compile=True, **shape)
        assert dec.verifier.static and dec.drafter.static
        for p in ps:
            ref = reference_greedy(llama.model, p, 20)
            assert dec.generate(p, 20).tokens == ref, (shape, p)
            if shape is CHAIN:
                assert dec.generate_plain(p, 20).tokens == ref
        compiled = counters["stats"]["unique_graphs"] - before
        # the same kind of runner at the same shapes reuses the graph (the chain decoder's prefill chunks)
        kinds = {(type(r), getattr(r, "contract", 0) is None, r.max_pending, k)  # the tree rounds' move: eager
                 for r in (dec.verifier, dec.drafter, dec.plain) for k in r._static if k[0] != "tree_move"}
        assert compiled == len(kinds - seen) > 0, shape
        seen |= kinds
        for p in ps:
            dec.generate(p, 20)
        assert counters["stats"]["unique_graphs"] - before == compiled, shape  # no recompilation
    torch._dynamo.reset()


def test_compile_failure_is_one_clear_error(llama, drafts, monkeypatch):
    dec = decoder(llama, *drafts["trained"], compile=True, **CHAIN)

    def broken(*args):
        raise torch._dynamo.exc.TorchDynamoException("backend exploded\nlong traceback")

    monkeypatch.setattr(dec.verifier, "_compiled", broken)
    monkeypatch.setattr(dec.verifier, "_compiled_untuned", broken)  # a verify's size is not autotuned
    with pytest.raises(CompileError, match=r"TargetRunner forward failed \(backend exploded\); run with --no-compile"):
        dec.generate([1, 2, 3], 8)


# --- stopping, streaming, accounting --------------------------------------------------------------

def test_eos_max_tokens_and_stream(llama, seqs, drafts):
    dec = decoder(llama, *drafts["trained"], **CHAIN)
    p = seqs[0][:4].tolist()
    ref = reference_greedy(llama.model, p, 30)
    eos = ref[12]
    chunks = []
    res = dec.generate(p, 30, eos_ids=[eos], stream=chunks.append)
    assert res.tokens == ref[:ref.index(eos) + 1] and res.stop == "eos"
    assert [t for c in chunks for t in c] == res.tokens
    res = dec.generate(p, 7)
    assert res.tokens == ref[:7] and res.stop == "length"
    # accounting: the first token comes from the prefill, each step commits accepted + 1 (then truncated)
    res = dec.generate(p, 30)
    assert len(res.tokens) == min(30, 1 + sum(a + 1 for a in res.accepted_per_step))
    assert res.acceptance_length == pytest.approx(1 + sum(res.acceptance_by_position))
    assert len(res.acceptance_by_position) == 4 and res.num_steps == len(res.accepted_per_step)
    assert res.timings["decode_s"] > 0 and res.timings["step_ms"] > 0


def test_plain_decoding_reading_tokens_back_in_chunks(llama, seqs):
    """CUDA's plain loop reads tokens back every PLAIN_AHEAD steps (set here on a CPU): the same
    tokens, EOS still cuts the output, the stream still sees every token, max tokens still holds."""
    dec = decoder(llama, static_shapes=True)
    assert dec.plain_ahead == 1  # a CPU: no run-ahead by default
    dec.plain_ahead = decode.PLAIN_AHEAD
    p = seqs[1][:4].tolist()
    ref = reference_greedy(llama.model, p, 30)
    chunks = []
    res = dec.generate_plain(p, 30, eos_ids=[ref[12]], stream=chunks.append)
    assert res.tokens == ref[:ref.index(ref[12]) + 1] and res.stop == "eos"
    assert [t for c in chunks for t in c] == res.tokens  # the prefill's token, then a chunk per read-back
    assert len(chunks) == 1 + -(-(len(res.tokens) - 1) // decode.PLAIN_AHEAD)
    for n in (1, 8, 9, 30):  # the last chunk never runs past max_new_tokens (the cache holds no more)
        assert dec.generate_plain(p, n).tokens == ref[:n]


def test_greedy_plain_steps_feed_themselves(llama, seqs, monkeypatch):
    """Greedy plain decoding with static shapes (CUDA's graphs; counted on a CPU): each step's argmax is
    the next step's input inside its static function, which also moves its position on. A read-back of
    n tokens is n replays and, outside them, only the first token's copy and two fills: no argmax, copy
    or fill launched between two steps. The tokens are the target's own greedy ones."""
    from torch.fx.experimental.proxy_tensor import make_fx

    replays, Ops = launch_counter(monkeypatch)
    dec = decoder(llama, static_shapes=True)
    dec.plain_ahead = decode.PLAIN_AHEAD
    calls, greedy = [], dec.plain.greedy_steps

    def counted(tok, n):
        replays.clear()
        with Ops() as ops:
            new = greedy(tok, n)
        calls.append([n, len(replays), ops.names])
        return new

    monkeypatch.setattr(dec.plain, "greedy_steps", counted)
    for i, p in enumerate(prompts(seqs)[1:3]):
        calls.clear()
        assert dec.generate_plain(p, 19).tokens == reference_greedy(llama.model, p, 19), p
        assert [(n, replays) for n, replays, _ in calls] == [(8, 8), (8, 8), (2, 2)]
        # (the very first call makes the static function's buffers)
        assert all(names == ["copy_", "fill_", "fill_", "slice"] for _, _, names in calls[1 - bool(i):]), calls
    # the step is a CUDA graph on a GPU: no host read-back inside (make_fx refuses _local_scalar_dense)
    st = dec.plain._static[(1, ("ids",), "greedy")]
    keys = sorted(st.inputs)
    with torch.no_grad():
        make_fx(lambda *v: dec.plain._greedy_step(dict(zip(keys, v)), dec.plain.book.max_len))(
            *[st.inputs[k].clone() for k in keys])


# --- sampling: lossless ---------------------------------------------------------------------------

V = 8  # a small vocabulary: enough samples per cell for a chi-square test in seconds


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 2-layer target over 8 tokens with peaked distributions, and a draft over 6 of them (two
    target tokens it can never propose) trained a little towards the target's argmax: its q overlaps
    p without equalling it, so accepts, rejections and residual draws all happen."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(20)
    t = as_target(m)
    contract = TapContract(2, (0, 1, 2))
    d = new_draft(m, contract, draft_vocab=6)
    d.set_vocab(torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.bool))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, V, (12,), generator=g) for _ in range(6)]
    fit(d, m, contract, seqs, steps=30)
    return t, *save_load(d, contract, t, tmp_path_factory.mktemp("small") / "d")


@torch.no_grad()
def exact_marginals(model, prompt, sampling, n):
    """P(token i = v) for i < n under the target's sampling distribution, by enumerating prefixes."""
    prefixes, weights, out = [list(prompt)], torch.ones(1), []
    for _ in range(n):
        logits = model(torch.tensor(prefixes)).logits[:, -1]
        probs = logits_to_probs(logits, sampling) * weights[:, None]  # (prefixes, V) joint
        out.append(probs.sum(0))
        prefixes = [p + [v] for p in prefixes for v in range(V)]
        weights = probs.reshape(-1)
    return out


def chi2_pvalue(counts, probs):
    n = counts.sum()
    keep = probs * n >= 5  # cells too small for the chi-square approximation are pooled
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([probs[keep], probs[~keep].sum()[None]]) * n
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2), stat / 2))


def sample_counts(dec, prompt, sampling, n_tokens, trials):
    """(n_tokens, V) counts of the first generated tokens over `trials` seeds, and the accepted counts."""
    counts, accepted = torch.zeros(n_tokens, V), []
    for seed in range(trials):
        res = dec.generate(prompt, n_tokens, sampling, seed=seed)
        accepted += res.accepted_per_step
        for i, tok in enumerate(res.tokens):
            counts[i, tok] += 1
    return counts, accepted


SAMPLINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("shape", [dict(mode="chain", K=2), dict(mode="chain", K=3, static_shapes=True),
                                   dict(mode="tree", depth=2, topk=2, budget=4)], ids=["chain", "chain-static", "tree"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.7-k5-p0.9"])
def test_sampling_is_lossless(small, shape, sampling):
    """Tokens 2 and 3 come out of verification steps; their marginals must be the target's (rounds.py's sampled
    rounds, on exact runners and on static ones)."""
    t, d, meta = small
    prompt = [1, 5, 2]
    exact = exact_marginals(t.model, prompt, sampling, 3)
    dec = decoder(t, d, meta, **shape)
    counts, accepted = sample_counts(dec, prompt, sampling, 3, trials=600)
    assert 0 < sum(accepted) / len(accepted) < 1.5  # drafts accepted and rejected
    for i in range(3):
        assert chi2_pvalue(counts[i], exact[i]) > 1e-3, (i, counts[i], exact[i] * counts[i].sum())


@pytest.mark.parametrize("broken", ["accept_all", "no_residual"])
def test_sampling_test_catches_a_broken_verifier(small, monkeypatch, broken):
    """Negative controls: accepting every draft token, or resampling a rejection from p instead of
    norm(max(p - q, 0)) (the classic bug), must fail the same test."""
    t, d, meta = small

    def accept_all(tokens, q, p, u):  # acceptance.chain_sampling_verdict's signature: every token kept
        k = tokens.shape[0]
        return torch.tensor([k]), torch.cat([tokens.long(), sample_with(p[k], u[k:k + 1])])

    def no_residual(tokens, q, p, u):
        k, idx = tokens.shape[0], tokens.long()[:, None]
        n = (u[:k] * q.gather(1, idx).squeeze(1) < p[:k].gather(1, idx).squeeze(1)).long().cumprod(0).sum().view(1)
        drawn = sample_with(p.index_select(0, n)[0], u[k:k + 1])  # from p, not from norm(max(p - q, 0))
        return n, torch.cat([tokens.long(), drawn]).index_copy(0, n, drawn)

    monkeypatch.setattr(rounds_mod, "chain_sampling_verdict", accept_all if broken == "accept_all" else no_residual)
    sampling = SAMPLINGS[0]
    exact = exact_marginals(t.model, [1, 5, 2], sampling, 2)
    counts, _ = sample_counts(decoder(t, d, meta, mode="chain", K=2), [1, 5, 2], sampling, 2, trials=1000)
    assert chi2_pvalue(counts[1], exact[1]) < 1e-4


# --- bad input ------------------------------------------------------------------------------------

def test_mismatched_draft_and_target(llama, drafts, tmp_path):
    d, meta = drafts["random"]
    import transformers as tf
    from tiny import COMMON
    for what, cfg in [("has 6 layers", {**COMMON, "num_hidden_layers": 6}),
                      ("target_hidden_size", {**COMMON, "hidden_size": 64}),
                      ("vocab_size", {**COMMON, "vocab_size": 96})]:
        other = as_target(tf.LlamaForCausalLM(tf.LlamaConfig(**cfg)).eval(), "other")
        with pytest.raises(UsageError, match=what):
            decoder(other, d, meta)
    # same shapes, other weights: a warning, an error with strict
    same_shape = as_target(tiny_model("llama", seed=5), "retrained")
    with pytest.warns(UserWarning, match="weights_hash"):
        dec = decoder(same_shape, d, meta)
    assert any("weights_hash" in w for w in dec.warnings)
    with pytest.raises(UsageError, match="weights_hash.*strict"):
        decoder(same_shape, d, meta, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the matching target: no warning at all
        decoder(llama, d, meta)


@pytest.mark.parametrize("call, msg", [
    (lambda dec: dec.generate([], 5), "prompt is empty"),
    (lambda dec: dec.generate([1, 2, 3], 254), "exceeds the target's context of 256"),
    (lambda dec: dec.generate_plain([1, 2, 3], 254), "use --max-new-tokens <= 253"),
    (lambda dec: dec.generate([1, 2, 3], 0), "max-new-tokens must be"),
    (lambda dec: dec.generate([1, 128], 5), "0..127"),
])
def test_bad_generate_input(llama, drafts, call, msg):
    dec = decoder(llama, *drafts["random"])
    with pytest.raises(UsageError, match=msg):
        call(dec)


def test_bad_decoder_settings(llama, drafts, small):
    d, meta = drafts["random"]
    for kw, msg in [(dict(mode="beam"), "mode"), (dict(K=0), "K must be"), (dict(mode="tree", budget=0), "budget"),
                    (dict(cuda_graphs=True), "CUDA device")]:
        with pytest.raises(UsageError, match=msg):
            decoder(llama, d, meta, **kw)
    with pytest.raises(UsageError, match="metadata"):
        decoder(llama, d, None)
    t, sd, smeta = small
    with pytest.raises(UsageError, match="topk 7 exceeds the draft vocabulary"):
        decoder(t, sd, smeta, mode="tree", topk=7)


def test_shape_left_out_is_the_devices(llama, drafts):
    """K, depth, topk, budget not given: decode.DEFAULT_SHAPES for the target's device (a CPU's here)."""
    d, meta = drafts["random"]
    assert decode.SpecDecoder(llama, d, meta).spec == decode.SpecConfig(mode="chain", K=2, depth=4, topk=3, budget=8)
    tree = decoder(llama, d, meta, mode="tree", budget=5).spec  # SpecConfig.for_device
    assert (tree.mode, tree.depth, tree.topk, tree.budget) == ("tree", 4, 3, 5)


def test_captured_functions_never_read_the_device(llama, seqs, drafts, monkeypatch):
    """What a CUDA graph captures must not read a value back to the host (`.item()`, a 0-d index, a
    data-dependent shape): capture fails on the GPU (seen on an H200 in the one-replay chain). Here
    on a CPU, every static function the decoder builds is traced by make_fx with its inputs as
    tracing tensors: a read-back is `aten._local_scalar_dense`, which make_fx refuses. Nor may one
    hold aten.sort, which inductor lowers to its own Triton sort: that gave indices past the end in
    the one-replay tree on an H200 (sampling.argsort_stable keeps aten's)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    traced, sorts = [], []
    make_static = SlotRunner._make_static

    def tracing(self, inputs, fn):
        keys = sorted(inputs)

        def run(*values):
            saved = dict(inputs)
            inputs.update(zip(keys, values))
            try:
                return fn()
            finally:
                inputs.update(saved)

        fn()  # the warm-up a capture does first (it allocates the cache; writes land in scratch slots)
        kv = [t.clone() for layer in self._layers() for t in (layer.keys, layer.values)]  # tracing writes into it
        graph = make_fx(run)(*[inputs[k] for k in keys]).graph
        sorts.extend(n for n in graph.nodes if n.target in (torch.ops.aten.sort.stable, torch.ops.aten.sort.default))
        for t, layer in zip(kv[::2], self._layers()):
            layer.keys.copy_(t)
        for t, layer in zip(kv[1::2], self._layers()):
            layer.values.copy_(t)
        traced.append(type(self).__name__)
        return make_static(self, inputs, fn)

    monkeypatch.setattr(SlotRunner, "_make_static", tracing)
    nucleus = SamplingParams(temperature=0.9, top_p=0.8, top_k=20)  # sampled rounds: top-p ranks the vocabulary
    for shape in (CHAIN, TREE):
        dec = decoder(llama, *drafts["trained"], static_shapes=True, **shape)
        for p in prompts(seqs)[:2]:
            assert dec.generate(p, 24).tokens == reference_greedy(llama.model, p, 24)
            dec.generate(p, 24, nucleus, seed=0)
    assert {"TargetRunner", "DraftRunner"} <= set(traced) and len(traced) >= 8
    assert not sorts


def test_a_windowed_draft_decodes_alike_on_the_host_and_compiled(llama, seqs, drafts):
    """A draft with a sliding window (speculators' default; draft.py `_windowed`) through the decoder: the host
    runner and the compiled static one propose the same tokens (the same acceptance at every step; compiled for the
    chain only, a tree's compile takes minutes on a CPU), the output is the target's greedy, and the window changes
    what the draft proposes."""
    import dataclasses

    from eaglewire.draft import Eagle3Draft

    trained, meta = drafts["trained"]
    windowed = Eagle3Draft(dataclasses.replace(trained.config, sliding_window=3)).eval()
    windowed.load_state_dict(trained.state_dict())
    ps = prompts(seqs)[:3]
    torch._dynamo.reset()
    for shape in (CHAIN, TREE):
        runs = {}
        for name, d, kw in (("host", windowed, {}), ("compiled", windowed, dict(compile=True)),
                            ("unwindowed", trained, {})):
            if name == "compiled" and shape is TREE:
                runs[name] = runs["host"]
                continue
            dec = decoder(llama, d, meta, **kw, **shape)
            if name == "host":
                host_rounds(dec)
            runs[name] = [dec.generate(p, 16) for p in ps]
        for p, host, comp in zip(ps, runs["host"], runs["compiled"]):
            assert host.tokens == comp.tokens == reference_greedy(llama.model, p, 16)
            assert host.accepted_per_step == comp.accepted_per_step, shape
        assert [r.accepted_per_step for r in runs["host"]] != [r.accepted_per_step for r in runs["unwindowed"]]
    torch._dynamo.reset()
