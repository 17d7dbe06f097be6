"""EAGLE-2 draft trees: expansion, pruning, masks and positions (checked on a tiny real target)."""

import pytest
import torch
from tiny import tiny_model

from eaglewire.decode import tree as tree_mod
from eaglewire.decode.tree import (ROOT, DraftTree, expand, frontier_attention, prune, retrieve_paths, root_frontier,
                                   tree_attention)
from eaglewire.targets import cache_kwarg

V = 16


def sample_tree() -> DraftTree:
    # root -> 0 -> {2, 3}, 2 -> 5; root -> 1 -> 4
    return DraftTree(tokens=torch.tensor([5, 6, 7, 8, 9, 10]), parents=torch.tensor([-1, -1, 0, 0, 1, 2]),
                     depth=torch.tensor([1, 1, 2, 2, 2, 3]),
                     scores=torch.tensor([-0.1, -0.5, -0.3, -0.9, -0.6, -0.4])).validate()


def naive_ancestors(parents: list[int], i: int) -> list[int]:
    out = [i]
    while parents[out[-1]] != ROOT:
        out.append(parents[out[-1]])
    return out


def markov_draft(seed: int = 0):
    """A fake draft: next-token log-probs depend on the current token only (row V = the root)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V + 1, V, generator=g).mul(2).log_softmax(-1)  # (V+1, V)


def build(table: torch.Tensor, topk: int, steps: int) -> DraftTree:
    """The EAGLE-2 loop of the module docstring, driven by the fake draft."""
    tree, frontier = DraftTree.empty(), root_frontier()
    for _ in range(steps):
        rows = torch.where(frontier == ROOT, V, tree.tokens[frontier.clamp(min=0)] if tree.num_nodes else V)
        lp, tok = table[rows].topk(topk, dim=-1)  # (F, topk)
        tree, frontier = expand(tree, frontier, tok, lp, topk)
    return tree.validate()


def naive_eagle2(table: torch.Tensor, topk: int, steps: int):
    """SafeAILab/EAGLE cnets.py topK_genrate, written as plain loops: (token, parent, depth, score) per node."""
    nodes, frontier = [], [(ROOT, V, 0.0, 0)]
    for _ in range(steps):
        cands = []
        for idx, tok, score, depth in frontier:
            order = sorted(range(V), key=lambda t: -table[tok, t].item())[:topk]
            for t in order:
                nodes.append((t, idx, depth + 1, score + table[tok, t].item()))
                cands.append(len(nodes) - 1)
        best = sorted(cands, key=lambda i: (-nodes[i][3], i))[:topk]
        frontier = [(i, nodes[i][0], nodes[i][3], nodes[i][2]) for i in best]
    return nodes


@pytest.mark.parametrize("topk, steps", [(1, 5), (3, 4), (4, 3)])
def test_expand_matches_eagle2_reference(topk, steps):
    table = markov_draft(topk)
    tree = build(table, topk, steps)
    ref = naive_eagle2(table, topk, steps)
    assert tree.num_nodes == topk + (steps - 1) * topk * topk
    assert tree.tokens.tolist() == [r[0] for r in ref]
    assert tree.parents.tolist() == [r[1] for r in ref]
    assert tree.depth.tolist() == [r[2] for r in ref]
    torch.testing.assert_close(tree.scores, torch.tensor([r[3] for r in ref]))


def test_expand_returns_best_new_nodes_as_frontier():
    table = markov_draft(1)
    tree, frontier = expand(DraftTree.empty(), root_frontier(), *reversed(table[V:].topk(3)), topk=3)
    lp, tok = table[tree.tokens[frontier]].topk(3, dim=-1)
    grown, nxt = expand(tree, frontier, tok, lp, topk=2)
    new_scores = grown.scores[3:]
    assert nxt.tolist() == (3 + new_scores.argsort(descending=True)[:2]).tolist()
    assert (grown.parents[nxt] >= 0).all() and (grown.depth[nxt] == 2).all()


def test_prune_keeps_top_budget_ancestor_closed_in_depth_order():
    tree = build(markov_draft(2), topk=4, steps=4)
    for budget in (0, 1, 5, 16, 30, tree.num_nodes, tree.num_nodes + 10):
        small = prune(tree, budget).validate()
        assert small.num_nodes == min(budget, tree.num_nodes)
        # the kept set is the top-`budget` by score (scores are distinct here)
        want = sorted(tree.scores.tolist(), reverse=True)[:budget]
        assert sorted(small.scores.tolist(), reverse=True) == want
        assert small.depth.tolist() == sorted(small.depth.tolist())
        # each kept node still spells the same token path as in the full tree
        full_paths = {tuple(tree.tokens[naive_ancestors(tree.parents.tolist(), i)].tolist())
                      for i in range(tree.num_nodes)}
        for i in range(small.num_nodes):
            assert tuple(small.tokens[naive_ancestors(small.parents.tolist(), i)].tolist()) in full_paths


def test_prune_stays_closed_with_ties_and_non_monotone_scores():
    # node 1 has its parent's score (log-prob 0); node 2 claims a score above its parent's
    tree = DraftTree(tokens=torch.tensor([1, 2, 3, 4]), parents=torch.tensor([-1, 0, -1, 2]),
                     depth=torch.tensor([1, 2, 1, 2]), scores=torch.tensor([-1.0, -1.0, -3.0, -0.5])).validate()
    assert prune(tree, 1).tokens.tolist() == [1]  # the parent wins the tie
    # node 3 ranks by its path minimum (-3), so it never outranks its parent node 2
    assert prune(tree, 2).tokens.tolist() == [1, 2]
    assert prune(tree, 3).tokens.tolist() == [1, 3, 2]  # depth order: node 0, node 2, node 1


def test_tree_attention_matches_naive_ancestor_loop():
    tree, p = sample_tree(), 4
    mask, pos = tree_attention(tree, p)
    n = tree.num_nodes
    assert mask.shape == (1, 1, n + 1, p + n + 1) and mask.dtype == torch.bool
    want = torch.zeros(n + 1, p + n + 1, dtype=torch.bool)
    want[:, : p + 1] = True
    for i in range(n):
        for a in naive_ancestors(tree.parents.tolist(), i):
            want[1 + i, p + 1 + a] = True
    assert torch.equal(mask[0, 0], want)
    assert pos.tolist() == [4, 5, 5, 6, 6, 6, 7]
    # a depth bound given by the caller (no device sync) changes nothing, even a loose one
    for bound in (3, 5):
        assert torch.equal(tree_attention(tree, p, max_depth=bound)[0], mask)
        assert torch.equal(prune(tree, 4, max_depth=bound).tokens, prune(tree, 4).tokens)


def test_chain_is_a_tree_with_a_causal_mask():
    chain = DraftTree.chain(torch.tensor([9, 8, 7])).validate()
    mask, pos = tree_attention(chain, 2)
    assert torch.equal(mask[0, 0], torch.ones(4, 6, dtype=torch.bool).tril(diagonal=2))
    assert pos.tolist() == [2, 3, 4, 5]
    assert retrieve_paths(chain).tolist() == [[0, 1, 2]]
    assert prune(chain, 2).tokens.tolist() == [9, 8]


def test_chains_of_one_length_share_their_topology():
    """A decoding round builds a chain each time: its parents, depths and zero scores are made once
    per length (no kernels a round on CUDA), and stay right for every chain of that length."""
    a, b = DraftTree.chain(torch.tensor([9, 8, 7])), DraftTree.chain(torch.tensor([1, 2, 3]))
    assert a.parents is b.parents and a.depth is b.depth and a.scores is b.scores
    assert b.parents.tolist() == [-1, 0, 1] and b.depth.tolist() == [1, 2, 3] and b.scores.tolist() == [0, 0, 0]
    scored = DraftTree.chain(torch.tensor([1, 2, 3]), torch.tensor([-0.5, -1.0, -2.0]))
    assert scored.scores.tolist() == [-0.5, -1.0, -2.0] and a.scores.tolist() == [0, 0, 0]
    assert DraftTree.chain(torch.tensor([4, 5])).parents.tolist() == [-1, 0]


def test_retrieve_paths_lists_every_root_to_leaf_path():
    tree = sample_tree()
    paths = retrieve_paths(tree)
    assert paths.tolist() == [[0, 3, -1], [1, 4, -1], [0, 2, 5]]  # leaves 3, 4, 5
    big = build(markov_draft(3), topk=3, steps=3)
    parents = big.parents.tolist()
    leaves = [i for i in range(big.num_nodes) if i not in parents]
    want = [list(reversed(naive_ancestors(parents, leaf))) for leaf in leaves]
    assert [[x for x in row if x >= 0] for row in retrieve_paths(big).tolist()] == want


def test_frontier_attention_matches_naive_rule():
    tree = sample_tree()
    nodes, cached = torch.tensor([2, 3, 4]), torch.tensor([0, 1])
    mask, pos = frontier_attention(tree, nodes, cached, prefix_len=3, root_pos=10)
    assert mask.shape == (1, 1, 3, 3 + 2 + 3)
    want = torch.zeros(3, 8, dtype=torch.bool)
    want[:, :3] = True
    cols = cached.tolist() + nodes.tolist()
    for r, i in enumerate(nodes.tolist()):
        for c, j in enumerate(cols):
            want[r, 3 + c] = j in naive_ancestors(tree.parents.tolist(), i)
    assert torch.equal(mask[0, 0], want)
    assert pos.tolist() == [12, 12, 12]


def test_validate_rejects_broken_trees():
    with pytest.raises(ValueError, match="nodes \\[1\\]"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 1]), torch.tensor([1, 2]), torch.zeros(2)).validate()
    with pytest.raises(ValueError, match="nodes \\[1\\]"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.tensor([1, 3]), torch.zeros(2)).validate()
    with pytest.raises(ValueError, match="shape"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1]), torch.tensor([1, 2]), torch.zeros(2))


def _cached_forward(model, ids, cache, **kw):
    return model(input_ids=ids[None], use_cache=True, **{cache_kwarg(model): cache}, **kw).logits[0]


def test_tree_forward_on_a_real_target_equals_decoding_each_path():
    """One tree forward with tree_attention gives, at every node, the logits of a plain causal forward
    over prefix + root + the node's path (tiny Llama, KV cache, 4D bool mask)."""
    from transformers import DynamicCache

    model = tiny_model("llama")
    tree = build(markov_draft(4), topk=3, steps=3)
    tree = prune(tree, 10)
    prefix, root = torch.randint(0, 128, (6,), generator=torch.Generator().manual_seed(0)), torch.tensor([42])
    mask, pos = tree_attention(tree, prefix.shape[0])
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        _cached_forward(model, prefix, cache)
        out = _cached_forward(model, torch.cat([root, tree.tokens]), cache, attention_mask=mask,
                              position_ids=pos[None])  # (n+1, vocab)
        parents = tree.parents.tolist()
        for i in range(tree.num_nodes):
            path = list(reversed(naive_ancestors(parents, i)))
            ref = model(input_ids=torch.cat([prefix, root, tree.tokens[path]])[None]).logits[0, -1]
            torch.testing.assert_close(out[1 + i], ref, atol=1e-4, rtol=1e-4)
        ref_root = model(input_ids=torch.cat([prefix, root])[None]).logits[0, -1]
        torch.testing.assert_close(out[0], ref_root, atol=1e-4, rtol=1e-4)


def test_frontier_forwards_on_a_real_model_equal_decoding_each_path():
    """Depth-by-depth draft-style forwards with frontier_attention (cache grows by the frontier)
    equal plain causal forwards; here the tiny Llama stands in for the draft, root_pos = prefix end."""
    from transformers import DynamicCache

    model = tiny_model("llama", seed=1)
    tree = build(markov_draft(5), topk=2, steps=3)  # depth 1: nodes 0-1, depth 2: 2-5, depth 3: 6-9
    prefix = torch.randint(0, 128, (5,), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    parents = tree.parents.tolist()
    with torch.no_grad():
        _cached_forward(model, prefix, cache)  # the root is the last prefix token here
        cached = torch.zeros(0, dtype=torch.long)
        for depth in (1, 2):
            nodes = (tree.depth == depth).nonzero().flatten()
            mask, pos = frontier_attention(tree, nodes, cached, prefix_len=5, root_pos=4)
            out = _cached_forward(model, tree.tokens[nodes], cache, attention_mask=mask, position_ids=pos[None])
            for r, i in enumerate(nodes.tolist()):
                path = list(reversed(naive_ancestors(parents, i)))
                ref = model(input_ids=torch.cat([prefix, tree.tokens[path]])[None]).logits[0, -1]
                torch.testing.assert_close(out[r], ref, atol=1e-4, rtol=1e-4)
            cached = torch.cat([cached, nodes])


def grow_by_ancestors(root_logits, root_hidden, depth, topk, to_target, forward):
    """grow as it was before each level took its block from the last frontier's rows: each level's block from
    frontier_attention over the whole tree, each node's input hidden state looked up by its parent's index."""
    tree, frontier = DraftTree.empty(), root_frontier()
    node_hidden = root_hidden.new_zeros(tree_mod.grown_nodes(depth, topk), root_hidden.shape[-1])
    cached = torch.zeros(0, dtype=torch.long)
    logp = root_logits.float().log_softmax(-1)[None]
    for level in range(depth):
        top, idx = logp.topk(topk, dim=-1)
        tree, frontier = expand(tree, frontier, to_target(idx), top, topk)
        if level == depth - 1:
            break
        parents = tree.parents[frontier]
        h_in = torch.where((parents < 0)[:, None], root_hidden, node_hidden[parents.clamp(min=0)])
        block, rel = frontier_attention(tree, frontier, cached, 0, 0)
        logits, h = forward(tree.tokens[frontier], h_in, block[0, 0], rel)
        node_hidden[frontier] = h
        cached = torch.cat([cached, frontier])
        logp = logits.float().log_softmax(-1)
    return tree


@pytest.mark.parametrize("depth,topk", [(1, 3), (2, 4), (5, 3), (6, 8)])
def test_grow_feeds_each_level_what_the_ancestor_rule_gives(depth, topk):
    """tree.grow builds each frontier's block from the last one's rows and takes each node's input from its
    parent's output: every forward gets the tokens, hidden states, block and depths that frontier_attention and
    a lookup by parent give, and the grown tree is the same."""
    g = torch.Generator().manual_seed(depth * 10 + topk)
    vocab, hidden = 40, 6
    emb, w = torch.randn(vocab + 100, hidden, generator=g), torch.randn(hidden, vocab, generator=g)

    def recording(calls):
        def forward(tokens, h_in, block, rel):  # logits that depend on all four, so a wrong one changes the tree
            calls.append((tokens, h_in, block, rel))
            seen = block.float().sum(1, keepdim=True)
            h = torch.tanh(h_in + emb[tokens] + 0.1 * rel[:, None] + 0.05 * seen)
            return h @ w, h
        return forward

    root_logits, root_hidden = torch.randn(vocab, generator=g), torch.randn(hidden, generator=g)
    got, want = [], []
    a = tree_mod.grow(root_logits, root_hidden, depth, topk, lambda i: i + 100, recording(got))
    b = grow_by_ancestors(root_logits, root_hidden, depth, topk, lambda i: i + 100, recording(want))
    assert len(got) == len(want) == depth - 1
    for level, (x, y) in enumerate(zip(got, want)):
        for name, u, v in zip(("tokens", "hidden", "block", "depth"), x, y):
            assert u.shape == v.shape and torch.equal(u, v), (level, name)
    for name in ("tokens", "parents", "depth", "scores"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.num_nodes == tree_mod.grown_nodes(depth, topk)


@pytest.mark.parametrize("n", [0, 1, 7, 64, 392])
def test_stable_order_by_ranking_equals_a_stable_sort(n):
    """The ranking order (a round's sorts on the GPU, tree.stable_order) is aten's stable sort: ties to the lower
    index, -inf and +inf included, and integer keys (prune's depth order)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-4, 4, (n,), generator=g).float()  # many ties
    x[torch.rand(n, generator=g) < 0.1] = float("-inf")
    x[torch.rand(n, generator=g) < 0.05] = float("inf")
    want = torch.sort(x, stable=True).indices
    assert torch.equal(tree_mod.stable_order(x), want)
    assert torch.equal(tree_mod.stable_order(x.long().clamp(-9, 9) * n + torch.arange(n)),
                       torch.sort(x.long().clamp(-9, 9) * n + torch.arange(n), stable=True).indices)


def test_stable_order_ranks_each_row_of_a_batch():
    """Rows order apart (top_k_by_groups ranks the groups and the candidates of every frontier row at once)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-3, 3, (4, 50), generator=g).float()
    want = torch.sort(x, stable=True).indices
    assert torch.equal(tree_mod.stable_order(x), want)
    assert torch.equal(tree_mod.stable_order(x), torch.stack([tree_mod.stable_order(r) for r in x]))


@pytest.mark.parametrize("vocab,k,g", [(32000, 8, 64), (49152, 10, 64), (1003, 3, 16), (200, 8, 16)])
def test_top_k_by_groups_equals_aten(vocab, k, g):
    """tree.top_k_by_groups (the draft's candidates on CUDA: the top k of the k groups with the highest maxima)
    gives torch.topk's values and, without ties, its indices; with ties (integer logits) the same values at
    distinct indices that hold them; a vocabulary that is no whole number of groups is padded, never indexed past."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(8, vocab, generator=gen).log_softmax(-1)
    values, idx = tree_mod.top_k_by_groups(x, k, g)
    want_values, want_idx = x.topk(k, dim=-1)
    assert torch.equal(values, want_values) and torch.equal(idx, want_idx)
    ties = torch.randint(-3, 3, (8, vocab), generator=gen).float()
    values, idx = tree_mod.top_k_by_groups(ties, k, g)
    assert torch.equal(values, ties.topk(k, dim=-1).values) and torch.equal(ties.gather(1, idx), values)
    assert all(len(set(row.tolist())) == k for row in idx)
    x[:, 1:] = float("-inf")  # fewer than k candidates above -inf: indices stay in the vocabulary
    values, idx = tree_mod.top_k_by_groups(x, k, g)
    assert int(idx.max()) < vocab and torch.equal(values[:, 0], x[:, 0])
    assert torch.equal(idx[:, 0], torch.zeros(8, dtype=torch.long))


def test_top_k_takes_groups_on_cuda_only(monkeypatch):
    """On a CPU top_k is aten's (one cheap pass there); the groups are for CUDA (tree.TOPK_GROUP_DEVICES)."""
    called = []
    monkeypatch.setattr(tree_mod, "top_k_by_groups", lambda *a: called.append(a) or None)
    x = torch.randn(2, 5000)
    assert torch.equal(tree_mod.top_k(x, 4)[1], x.topk(4, dim=-1).indices) and not called
    monkeypatch.setattr(tree_mod, "TOPK_GROUP_DEVICES", ("cuda", "cpu"))
    assert tree_mod.top_k(x, 4) is None and called == [(x, 4, tree_mod.TOPK_GROUP)]
