"""Verification math: greedy equals the naive rules; sampling is lossless (statistical tests with
negative controls that a wrong rule provably fails)."""

import math

import pytest
import torch

from eaglewire.decode.acceptance import (verify_chain_greedy, verify_chain_sampling, verify_tree_greedy,
                                         verify_tree_sampling)
from eaglewire.decode.tree import DraftTree, expand, prune, retrieve_paths, root_frontier
from eaglewire.errors import UsageError
from eaglewire.runtime.sampling import SCAN_BLOCK, SamplingParams, cumsum_in_blocks, logits_to_probs, sample_with

V = 8
TRIALS = 20_000


# --- sampling parameters ---------------------------------------------------------------------

@pytest.mark.parametrize("kw, msg", [(dict(temperature=-1.0), "temperature"), (dict(temperature=math.nan), "temperature"),
                                     (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                                     (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k")])
def test_sampling_params_reject_bad_values(kw, msg):
    with pytest.raises(UsageError, match=msg):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=1.3, top_k=5),
                                dict(temperature=0.9, top_p=0.8), dict(temperature=1.0, top_k=20, top_p=0.6)])
def test_logits_to_probs_matches_transformers_warpers(kw):
    """Same filtering as transformers generation/logits_process.py, in generate's order
    (temperature, top-k, top-p)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    p = SamplingParams(**kw)
    ref = TemperatureLogitsWarper(p.temperature)(None, logits.clone())
    if p.top_k:
        ref = TopKLogitsWarper(p.top_k)(None, ref)
    if p.top_p < 1:
        ref = TopPLogitsWarper(p.top_p)(None, ref)
    torch.testing.assert_close(logits_to_probs(logits, p), ref.softmax(-1))


def test_greedy_params_give_one_hot_argmax():
    logits = torch.randn(4, 10)
    probs = logits_to_probs(logits, SamplingParams())
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(4))
    assert set(probs.unique().tolist()) == {0.0, 1.0}


# --- greedy ----------------------------------------------------------------------------------

def naive_chain_greedy(draft, logits):
    n = 0
    while n < len(draft) and draft[n] == logits[n].argmax().item():
        n += 1
    return n, draft[:n] + [logits[n].argmax().item()]


def random_tree(g: torch.Generator, topk=3, steps=3, budget=10) -> DraftTree:
    tree, frontier = DraftTree.empty(), root_frontier()
    for _ in range(steps):
        lp, tok = torch.randn(frontier.shape[0], V, generator=g).log_softmax(-1).topk(topk, dim=-1)
        tree, frontier = expand(tree, frontier, tok, lp, topk)
    return prune(tree, budget).validate()


def test_chain_greedy_equals_naive_reference():
    g = torch.Generator().manual_seed(0)
    for k in (0, 1, 4):
        for _ in range(200):
            logits = torch.randn(k + 1, 4, generator=g)  # 4 tokens: long accepted runs happen
            draft = torch.where(torch.rand(k, generator=g) < 0.7, logits[:k].argmax(-1), torch.randint(0, 4, (k,), generator=g))
            assert verify_chain_greedy(draft, logits) == naive_chain_greedy(draft.tolist(), logits)


def test_tree_greedy_equals_best_retrieved_path():
    """The EAGLE reference: compare every root-to-leaf path with the target argmax, keep the
    longest accepted prefix (SafeAILab/EAGLE eagle/model/utils.py evaluate_posterior, greedy branch)."""
    g = torch.Generator().manual_seed(1)
    lengths = set()
    for _ in range(300):
        tree = random_tree(g)
        logits = torch.randn(tree.num_nodes + 1, V, generator=g)
        # plant the target's argmax on a random path so deep acceptances occur
        paths = retrieve_paths(tree)
        for i in paths[torch.randint(0, paths.shape[0], (1,), generator=g).item()]:
            if i >= 0 and torch.rand(1, generator=g).item() < 0.8:
                row = tree.parents[i].item() + 1
                logits[row, tree.tokens[i]] = 10.0
        best_len, best_path = 0, []
        for row in paths.tolist():
            path = [i for i in row if i >= 0]
            ok = 0
            while ok < len(path) and tree.tokens[path[ok]] == logits[0 if ok == 0 else path[ok - 1] + 1].argmax():
                ok += 1
            if ok > best_len:
                best_len, best_path = ok, path[:ok]
        path, tokens = verify_tree_greedy(tree, logits)
        assert path == best_path
        assert tokens == tree.tokens[path].tolist() + [logits[path[-1] + 1 if path else 0].argmax().item()]
        lengths.add(len(path))
    assert lengths >= {0, 1, 2, 3}


def test_chain_tree_equals_chain_verification():
    g = torch.Generator().manual_seed(2)
    for _ in range(200):
        draft = torch.randint(0, 3, (4,), generator=g)
        logits = torch.randn(5, 3, generator=g)
        n, tokens = verify_chain_greedy(draft, logits)
        assert verify_tree_greedy(DraftTree.chain(draft), logits) == (list(range(n)), tokens)
        probs = torch.softmax(logits, -1)
        seed = int(torch.randint(0, 2**31, (1,), generator=g))
        chain = verify_chain_sampling(draft, None, probs, torch.Generator().manual_seed(seed))
        tree = verify_tree_sampling(DraftTree.chain(draft), probs, torch.Generator().manual_seed(seed))
        assert tree == (list(range(chain[0])), chain[1])


def test_sampling_verifiers_with_greedy_params_are_greedy():
    g = torch.Generator().manual_seed(3)
    for _ in range(100):
        tree = random_tree(g)
        logits = torch.randn(tree.num_nodes + 1, V, generator=g)
        assert verify_tree_sampling(tree, logits_to_probs(logits, SamplingParams()), g) == verify_tree_greedy(tree, logits)
        draft = logits[:3].argmax(-1)
        q = torch.softmax(torch.randn(3, V, generator=g), -1)
        assert verify_chain_sampling(draft, q, logits_to_probs(logits[:4], SamplingParams()), g) == \
            (3, draft.tolist() + [logits[3].argmax().item()])


def test_zero_probability_candidates_are_never_accepted():
    tree = random_tree(torch.Generator().manual_seed(4))
    probs = torch.full((tree.num_nodes + 1, V), 1.0)
    probs[0, tree.tokens[tree.parents < 0]] = 0.0  # the target can never emit a root child
    probs = probs / probs.sum(-1, keepdim=True)
    g = torch.Generator().manual_seed(0)
    assert all(verify_tree_sampling(tree, probs, g)[0] == [] for _ in range(500))


# --- lossless sampling: statistics -----------------------------------------------------------
# A first-order Markov target over V tokens: P0 after the root, P1[x] after token x. A lossless
# verifier emits a first token ~ P0 and a first pair ~ P0[x] * P1[x, y]. When a round emits only
# one token, the pair is completed by a fresh target sample (what the next round does).

def dist(seed, shape, sharp=1.5):
    return torch.softmax(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * sharp, -1)


P0, P1 = dist(10, (V,)), dist(11, (V, V))  # target
Q0, Q1 = dist(20, (V,)), dist(21, (V, V))  # draft


def chi2_stat(first, pairs):
    """Pearson statistics of the first tokens vs P0 and of the pairs vs P0 x P1, with their df."""
    def stat(obs, probs):
        obs, exp = obs.double().flatten(), probs.double().flatten() * obs.sum()
        if (obs[exp == 0] > 0).any():
            return math.inf
        e = exp > 0
        return float(((obs[e] - exp[e]) ** 2 / exp[e]).sum()), int(e.sum()) - 1
    f = torch.bincount(torch.tensor(first), minlength=V)
    p = torch.bincount(torch.tensor(pairs), minlength=V * V)
    return stat(f, P0), stat(p, P0[:, None] * P1)


def critical(df, z=4.5):
    """Wilson-Hilferty chi-square quantile at a normal z (z = 4.5: a 3e-6 false-alarm rate)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def passes(first, pairs) -> bool:
    (s1, d1), (s2, d2) = chi2_stat(first, pairs)
    return s1 < critical(d1) and s2 < critical(d2)


def fails_badly(first) -> bool:
    (s1, d1), _ = chi2_stat(first, [0])
    return s1 > 10 * critical(d1)


def first_pair(emitted: list[int], g: torch.Generator) -> tuple[int, int]:
    if len(emitted) == 1:
        emitted = emitted + [int(torch.multinomial(P1[emitted[0]], 1, generator=g))]
    return emitted[0], emitted[0] * V + emitted[1]


def run_trials(verify, seed=0):
    """verify(g) -> emitted tokens of one round; returns first tokens and first pairs over TRIALS."""
    g, firsts, pairs = torch.Generator().manual_seed(seed), [], []
    for _ in range(TRIALS):
        f, p = first_pair(verify(g), g)
        firsts.append(f)
        pairs.append(p)
    return firsts, pairs


def test_chain_sampling_with_sampled_drafts_is_lossless():
    """gpt-fast generate.py speculative_decode's rule: draft tokens drawn from q, accepted with min(1, p/q)."""
    def verify(g):
        d0 = torch.multinomial(Q0, 1, generator=g)[0]
        d1 = torch.multinomial(Q1[d0], 1, generator=g)[0]
        draft = torch.stack([d0, d1])
        n, tokens = verify_chain_sampling(draft, torch.stack([Q0, Q1[d0]]), torch.stack([P0, P1[d0], P1[d1]]), g)
        assert tokens[:n] == draft[:n].tolist() and len(tokens) == n + 1
        return tokens

    assert passes(*run_trials(verify))

    def always_accept(g):  # negative control: the draft's distribution, not the target's
        d0 = int(torch.multinomial(Q0, 1, generator=g)[0])
        return [d0, int(torch.multinomial(Q1[d0], 1, generator=g)[0])]
    firsts, pairs = run_trials(always_accept)
    assert not passes(firsts, pairs) and fails_badly(firsts)

    def resample_from_p(g):  # negative control: correct acceptance, but a rejection resamples p, not max(p - q, 0)
        d0 = torch.multinomial(Q0, 1, generator=g)[0]
        if torch.rand(1, generator=g).item() * Q0[d0] < P0[d0]:
            return [int(d0)]
        return [int(torch.multinomial(P0, 1, generator=g))]
    firsts, pairs = run_trials(resample_from_p)
    assert fails_badly(firsts)


def test_chain_sampling_with_deterministic_drafts_is_lossless():
    """Argmax drafts are point-mass proposals: draft_probs=None. Passing the draft's q for them
    (the min(1, p/q) rule on a token that was not sampled from q) is the negative control."""
    d0 = Q0.argmax()
    draft = torch.stack([d0, Q1[d0].argmax()])
    target = torch.stack([P0, P1[draft[0]], P1[draft[1]]])

    def verify(g, q=None):
        n, tokens = verify_chain_sampling(draft, q, target, g)
        assert tokens[:n] == draft[:n].tolist() and len(tokens) == n + 1
        return tokens

    assert passes(*run_trials(verify))
    firsts, pairs = run_trials(lambda g: verify(g, torch.stack([Q0, Q1[d0]])))
    assert not passes(firsts, pairs) and fails_badly(firsts)


def eagle2_tree() -> DraftTree:
    """An EAGLE-2 tree from the Markov draft: top-3 per node, 3 steps, pruned to 10 nodes."""
    tree, frontier = DraftTree.empty(), root_frontier()
    for _ in range(3):
        q = torch.stack([Q0 if f < 0 else Q1[tree.tokens[f]] for f in frontier.tolist()])
        lp, tok = q.log().topk(3, dim=-1)
        tree, frontier = expand(tree, frontier, tok, lp, topk=3)
    return prune(tree, 10).validate()


def test_tree_sampling_with_top_k_candidates_is_lossless():
    tree = eagle2_tree()
    target = torch.stack([P0] + [P1[t] for t in tree.tokens.tolist()])  # row 1 + i: after node i

    def verify(g):
        path, tokens = verify_tree_sampling(tree, target, g)
        assert tokens[:-1] == tree.tokens[path].tolist()
        return tokens

    firsts, pairs = run_trials(verify)
    assert passes(firsts, pairs)
    # the tree was used: some rounds accept two draft tokens, and the first token is accepted as often as any
    # lossless rule can (the target's mass on the root's candidates; a depth-1 tree on SmolLM2 at T=1 did so)
    g = torch.Generator().manual_seed(1)
    paths = [verify_tree_sampling(tree, target, g)[0] for _ in range(4000)]
    assert max(map(len, paths)) >= 2
    mass = P0[tree.tokens[tree.parents < 0]].sum().item()
    assert abs(sum(len(p) >= 1 for p in paths) / len(paths) - mass) < 4 * math.sqrt(mass * (1 - mass) / len(paths))


def eagle1_rule_first_token(tree: DraftTree, g: torch.Generator) -> list[int]:
    """Negative control: SafeAILab/EAGLE eagle/model/utils.py evaluate_posterior's rule on top-k
    candidates at the root: accept c with min(1, r(c)/q(c)), on rejection r <- norm(max(r - q', 0))
    with q' = q without the siblings tried so far. Lossless for sampled candidates, not for top-k."""
    r, q = P0.clone(), Q0.clone()
    for c in tree.tokens[tree.parents < 0].tolist():
        if torch.rand(1, generator=g).item() < min(1.0, (r[c] / q[c]).item()):
            return [c]
        q[c] = 0
        r = (r - q / q.sum()).clamp(min=0)
        r = r / r.sum()
    return [int(torch.multinomial(r, 1, generator=g))]


def test_tree_sampling_negative_controls_fail():
    tree = eagle2_tree()
    firsts, pairs = run_trials(lambda g: [tree.tokens[0].item()])  # always accept the best child
    assert fails_badly(firsts)
    firsts, pairs = run_trials(lambda g: eagle1_rule_first_token(tree, g))
    assert fails_badly(firsts)


def test_cumsum_in_blocks_equals_cumsum_and_never_scans_past_a_block():
    # One long scan over a vocabulary is what inductor turned into a split-scan kernel that failed to compile on
    # CUDA (sampled rounds, torch 2.11): the traced graph must scan SCAN_BLOCK entries at most.
    from torch.fx.experimental.proxy_tensor import make_fx
    x = torch.rand(3, 5000, dtype=torch.float64)  # not a multiple of the block
    torch.testing.assert_close(cumsum_in_blocks(x), x.cumsum(-1))
    torch.testing.assert_close(cumsum_in_blocks(x[:, :100]), x[:, :100].cumsum(-1))
    graph = make_fx(lambda p, u: sample_with(p, u))(torch.rand(8, 5000).softmax(-1), torch.rand(8)).graph
    scans = [n for n in graph.nodes if n.target == torch.ops.aten.cumsum.default]
    assert scans and all(n.args[0].meta["val"].shape[-1] <= SCAN_BLOCK for n in scans)


def test_sample_with_draws_by_inverse_cdf_and_never_a_token_without_mass():
    probs = torch.zeros(4000)
    probs[[0, 1500, 3999]] = torch.tensor([0.25, 0.5, 0.25])
    draws = torch.tensor([0.0, 0.2499, 0.25, 0.7499, 0.75, 0.9999])
    assert sample_with(probs.expand(6, -1), draws).tolist() == [0, 0, 1500, 1500, 3999, 3999]
    probs[3999] = 0  # a draw at the very top of the mass goes to the last token with mass
    assert sample_with(probs, torch.tensor([0.9999999]).expand(1)).tolist() == [1500]
    gen = torch.Generator().manual_seed(0)
    p = torch.zeros(1500)
    p[torch.randperm(1500, generator=gen)[:30]] = torch.rand(30, generator=gen)  # mass in every block
    p /= p.sum()
    picks = sample_with(p.expand(TRIALS, -1), torch.rand(TRIALS, generator=gen))
    counts = torch.bincount(picks, minlength=1500).double() / TRIALS
    assert counts[p == 0].sum() == 0
    assert (counts - p.double()).abs().sum() < 0.05  # total variation: one draw each from the given distribution
