"""EAGLE-2 dynamic draft trees: expansion, pruning, tree attention masks and positions.

Pure tensor code, no model calls. Vocabulary of one round of tree decoding:

- the ROOT is the last committed token (the token the target has not processed yet). It is not a
  node; node parent -1 means "child of the root".
- nodes 0..n-1 hold draft tokens (target-vocabulary ids). Every function here keeps nodes in
  topological order (parent index < child index); `prune` returns them in depth (BFS) order.
- depth(node) = 1 for children of the root; a node at depth d sits d positions after the root.
- score(node) = cumulative draft log-prob of the path root -> node (<= 0, non-increasing along a
  path), the EAGLE-2 ranking key.

The EAGLE-2 draft loop (SafeAILab/EAGLE eagle/model/cnets.py `topK_genrate`), with these helpers:

    tree, frontier = expand(DraftTree.empty(), root_frontier(), top-k at the root, topk)
    repeat depth - 1 times:  # draft one forward over tree.tokens[frontier], mask from frontier_attention
        tree, frontier = expand(tree, frontier, top-k of each frontier node, topk)
    tree = prune(tree, budget)  # then ONE target forward over [root] + tree.tokens, tree_attention()

`grow` is that loop, with the draft forward passed in.

A chain of K draft tokens is the tree `DraftTree.chain(tokens)` (each node the only child of the
previous one); every function here treats it as any other tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.sampling import argsort_stable  # its home is sampling: logits_to_probs sorts with it too

ROOT = -1  # parent id of the children of the root, and the frontier id of the root itself


# Orders of up to this many scores (a level's candidates, the grown tree before pruning) are found by ranking every
# pair: a few kernels that a compiled round fuses, where aten's stable sort is a cub radix sort of several launches
# (a d7 k8 tree round sorts 14 times; `python benchmarks/round_kernels.py --random-draft --modes tree` lists a
# round's kernels). 0 = aten's sort always.
RANK_SORT_MAX = 1024
# A draft's top-k over its vocabulary (k small) comes from the k groups of TOPK_GROUP logits with the highest maxima,
# which hold every value of the top k whatever the ties, each step ordered by ranking: a few kernels that a compiled
# round fuses. aten's top-k (of whole rows, or of groups of 1,024 and then of those, as before these groups) is a
# radix select and a bitonic sort of its result: two of each a level, a share of a tree round on a GPU that
# `python benchmarks/decode_steps.py --random-draft --modes tree --tree-select ours,aten` measures. 0 = aten's
# top-k as is. Only on
# TOPK_GROUP_DEVICES: on a CPU aten's top-k is one cheap pass, and an eager ranking costs what it compares (~30x
# aten's top-k of 8 rows of 32,000).
TOPK_GROUP = 64
TOPK_GROUP_DEVICES = ("cuda",)


def stable_order(x: torch.Tensor) -> torch.Tensor:
    """argsort_stable(x) along the last dimension (ascending, ties to the lower index), by ranking when rows are
    short."""
    n = x.shape[-1]
    if n > RANK_SORT_MAX:
        return argsort_stable(x)
    i = torch.arange(n, device=x.device)
    a, b = x[..., None, :], x[..., :, None]  # [.., r, c]: does c go before r?
    before = (a < b) | ((a == b) & (i < i[:, None]))
    return torch.empty(x.shape, dtype=torch.long, device=x.device).scatter_(-1, before.sum(-1), i.expand(x.shape))


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(k, dim=-1) of (F, V) rows: the same values, best first (where values tie, the indices may differ)."""
    if not TOPK_GROUP or x.device.type not in TOPK_GROUP_DEVICES or k * TOPK_GROUP >= x.shape[-1]:
        return x.topk(k, dim=-1)
    return top_k_by_groups(x, k, TOPK_GROUP)


def top_k_by_groups(x: torch.Tensor, k: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k from the k groups of g entries with the highest maxima (see TOPK_GROUP), both steps ranked."""
    f, v = x.shape
    groups = -(-v // g)
    blocks = torch.nn.functional.pad(x, (0, groups * g - v), value=float("-inf")).view(f, groups, g)
    chosen = stable_order(-blocks.amax(-1))[:, :k]  # (F, k): every value above the k-th best is in these groups
    cand = blocks.gather(1, chosen[..., None].expand(f, k, g)).reshape(f, k * g)
    best = stable_order(-cand)[:, :k]
    idx = (chosen[..., None] * g + torch.arange(g, device=x.device)).reshape(f, k * g).gather(1, best)
    return cand.gather(1, best), idx.clamp(max=v - 1)  # a padding slot only if a row has < k above -inf


_CHAINS: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


@dataclass(frozen=True)
class DraftTree:
    """A draft tree for one verification round (see the module docstring for the conventions)."""

    tokens: torch.Tensor  # (n,) int64, target-vocabulary ids
    parents: torch.Tensor  # (n,) int64, parent node index or ROOT
    depth: torch.Tensor  # (n,) int64, 1 for children of the root
    scores: torch.Tensor  # (n,) float32, cumulative draft log-prob root -> node

    def __post_init__(self):
        # shape and dtype only: free on any device; the topology check (a device sync) is validate()
        n = self.tokens.shape
        for name in ("tokens", "parents", "depth", "scores"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape != n:
                raise ValueError(f"DraftTree.{name} must have shape {tuple(n)} like tokens, got {tuple(t.shape)}")
            if (name == "scores") != t.is_floating_point():
                raise ValueError(f"DraftTree.{name} has dtype {t.dtype}")

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @classmethod
    def empty(cls, device: torch.device | str | None = None) -> "DraftTree":
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls(z, z, z, torch.zeros(0, dtype=torch.float32, device=device))

    @classmethod
    def chain(cls, tokens: torch.Tensor, scores: torch.Tensor | None = None) -> "DraftTree":
        """The chain tokens[0] -> tokens[1] -> ... (node i at depth i + 1). Its parents, depths and
        zero scores are made once per length and device and shared, read-only: a decoding round
        then launches no kernels for them (four a round on CUDA)."""
        k, dev = tokens.shape[0], tokens.device
        shared = _CHAINS.get((k, dev))
        if shared is None:
            idx = torch.arange(k, device=dev)
            shared = (idx - 1, idx + 1, torch.zeros(k, device=dev))
            if not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):  # not a graph's memory
                _CHAINS[(k, dev)] = shared
        parents, depth, zeros = shared
        return cls(tokens.long(), parents, depth, zeros if scores is None else scores.float())

    def validate(self) -> "DraftTree":
        """Check the invariants every function relies on (one device sync); returns self."""
        idx = torch.arange(self.num_nodes, device=self.device)
        par = self.parents.clamp(min=0)
        ok_parent = (self.parents >= ROOT) & (self.parents < idx)
        ok_depth = torch.where(self.parents == ROOT, self.depth == 1, self.depth == self.depth[par] + 1)
        bad = (~(ok_parent & ok_depth)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"DraftTree nodes {bad[:8]} break 'ROOT <= parent < index, depth = parent depth + 1' "
                             f"(parents {self.parents[bad[:8]].tolist()}, depth {self.depth[bad[:8]].tolist()})")
        return self


def root_frontier(device: torch.device | str | None = None) -> torch.Tensor:
    """The frontier of the first expansion: the root alone (filled on the device: a CUDA graph can capture it)."""
    return torch.full((1,), ROOT, dtype=torch.long, device=device)


def expand(tree: DraftTree, frontier: torch.Tensor, cand_tokens: torch.Tensor, cand_logprobs: torch.Tensor,
           topk: int) -> tuple[DraftTree, torch.Tensor]:
    """One EAGLE-2 expansion: append every candidate child, pick the next frontier.

    frontier (F,) int64: the nodes the draft just ran on (ROOT for the first step).
    cand_tokens (F, k) int64: the draft's top-k tokens after each frontier node (target ids).
    cand_logprobs (F, k) float: their draft log-probs (log_softmax, so <= 0).
    Returns the tree with all F*k candidates appended, and the next frontier (min(topk, F*k),). The
    candidates are row-major: frontier node f's are nodes n0 + f*k .. n0 + f*k + k - 1. The next
    frontier is the appended nodes with the highest cumulative score, best first, ties to the lower
    index.
    """
    if cand_tokens.shape != cand_logprobs.shape or cand_tokens.shape[:1] != frontier.shape:
        raise ValueError(f"expand: frontier {tuple(frontier.shape)}, cand_tokens {tuple(cand_tokens.shape)} and "
                         f"cand_logprobs {tuple(cand_logprobs.shape)} must be (F,), (F, k), (F, k)")
    is_root = frontier == ROOT
    at = frontier.clamp(min=0)
    zero = torch.zeros((), device=tree.device)
    parent_score = torch.where(is_root, zero, tree.scores[at] if tree.num_nodes else zero)  # (F,)
    parent_depth = torch.where(is_root, 0, tree.depth[at] if tree.num_nodes else 0)  # (F,)
    f, k = cand_tokens.shape
    scores = (parent_score[:, None] + cand_logprobs.float()).reshape(-1)  # (F*k,)
    grown = DraftTree(
        tokens=torch.cat([tree.tokens, cand_tokens.reshape(-1).long()]),
        parents=torch.cat([tree.parents, frontier.long().repeat_interleave(k)]),
        depth=torch.cat([tree.depth, (parent_depth + 1).long().repeat_interleave(k)]),
        scores=torch.cat([tree.scores, scores]),
    )
    best = stable_order(-scores)[:topk]  # stable: ties go to the lower index
    return grown, tree.num_nodes + best


def grown_nodes(depth: int, topk: int) -> int:
    """The nodes `grow` appends: top-k children of the root, then of each of the top-k frontier nodes per level."""
    return topk + (depth - 1) * topk * topk


def grow(root_logits: torch.Tensor, root_hidden: torch.Tensor, depth: int, topk: int, to_target, forward
         ) -> DraftTree:
    """The EAGLE-2 draft loop: top-k children of each frontier node, the best top-k (cumulative
    log-prob) form the next frontier, `depth` levels (not pruned).

    root_logits (Vd,) and root_hidden (H,) are the draft's output at the root. `to_target` maps draft
    ids to target ids. `forward(tokens (F,), hidden (F, H), block (F, C+F) bool, depth (F,))` runs the draft on a
    frontier and returns (logits (F, Vd), hidden (F, H)). Its `block` is what each row sees of this round's
    rows: the C earlier frontiers' nodes in order, then its own (frontier_attention's rule). Its `depth` is
    each row's distance from the root. Static shapes throughout, no host sync: it can run inside a graph.

    Every frontier node is a child of the last frontier. So its row of the block is its parent's row and its
    own column, and its input hidden state is its parent's output: nothing is looked up in the whole tree.
    """
    dev = root_logits.device
    tree, frontier = DraftTree.empty(dev), root_frontier(dev)
    parent_hidden = root_hidden[None]  # (F, H): the last forward's outputs, the root's before the first
    block = torch.zeros(1, 0, dtype=torch.bool, device=dev)  # the root sees none of this round's rows
    logp = root_logits.float().log_softmax(-1)[None]  # (F, Vd), F = 1: the root
    for level in range(depth):
        top, idx = top_k(logp, topk)  # (F, k)
        n0 = tree.num_nodes
        tree, frontier = expand(tree, frontier, to_target(idx), top, topk)
        if level == depth - 1:
            break
        parent = (frontier - n0) // topk  # (F',): the row of the last frontier that each node grew from
        f = frontier.shape[0]
        block = torch.cat([block[parent], torch.eye(f, dtype=torch.bool, device=dev)], dim=1)
        logits, parent_hidden = forward(tree.tokens[frontier], parent_hidden[parent], block,
                                        torch.full((f,), level + 1, dtype=torch.long, device=dev))
        logp = logits.float().log_softmax(-1)
    return tree


def ancestor_table(tree: DraftTree, max_depth: int | None = None) -> torch.Tensor:
    """(n, D) int64, D = max depth: row i = [i, parent(i), grandparent(i), ...], ROOT-padded.

    max_depth: a bound on the depth the caller knows (D = max_depth; extra columns are ROOT). Without
    it the depth is read from the tree: a device sync, which a decode loop cannot afford per level."""
    n = tree.num_nodes
    d = (max_depth if max_depth is not None else int(tree.depth.max())) if n else 0
    cols = [torch.arange(n, device=tree.device)]
    for _ in range(d - 1):  # one hop up per column
        up = cols[-1]
        cols.append(torch.where(up >= 0, tree.parents[up.clamp(min=0)], ROOT))
    return torch.stack(cols, dim=1) if cols and d else torch.zeros(n, 0, dtype=torch.long, device=tree.device)


def ancestor_mask(tree: DraftTree, max_depth: int | None = None) -> torch.Tensor:
    """(n, n) bool: mask[i, j] = node j is node i or one of its ancestors."""
    table = ancestor_table(tree, max_depth)  # (n, D)
    j = torch.arange(tree.num_nodes, device=tree.device)
    return (table[:, :, None] == j).any(dim=1)


def prune(tree: DraftTree, budget: int, max_depth: int | None = None) -> DraftTree:
    """Keep the `budget` nodes with the highest cumulative score, ancestor-closed, in depth order.

    Scores are non-increasing along a path (log-probs <= 0), so with ties broken toward the lower
    index (a parent precedes its children) the top-`budget` set contains every kept node's parent.
    Scores are first clamped to their path minimum so closure holds for any input.
    """
    if budget < 0:
        raise ValueError(f"prune: budget must be >= 0, got {budget}")
    n = tree.num_nodes
    table = ancestor_table(tree, max_depth)  # (n, D)
    inf = torch.full((), float("inf"), device=tree.device)
    path_min = torch.where(table >= 0, tree.scores[table.clamp(min=0)], inf).amin(dim=1) if n else tree.scores
    top = stable_order(-path_min)[:budget]  # (keep,)
    kept = top[stable_order(tree.depth[top] * n + top)]  # depth order, then original order
    remap = torch.full((n,), ROOT, dtype=torch.long, device=tree.device)
    remap[kept] = torch.arange(kept.shape[0], device=tree.device)
    par = tree.parents[kept]
    new_par = torch.where(par >= 0, remap[par.clamp(min=0)], ROOT)  # closed by construction (no sync)
    return DraftTree(tree.tokens[kept], new_par, tree.depth[kept], tree.scores[kept])


def tree_attention(tree: DraftTree, prefix_len: int, max_depth: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and positions for the ONE target forward over [root] + tree.tokens.

    prefix_len: tokens already in the target's KV cache (everything before the root).
    Returns mask (1, 1, n+1, prefix_len+n+1) bool, True = may attend: every row sees the prefix and
    the root, node rows also see their ancestors and themselves. Also returns position_ids (n+1,)
    int64: prefix_len for the root, prefix_len + depth for the nodes. Row/column 1 + i is node i.
    """
    n = tree.num_nodes
    mask = torch.zeros(n + 1, prefix_len + n + 1, dtype=torch.bool, device=tree.device)
    mask[:, : prefix_len + 1] = True
    mask[1:, prefix_len + 1:] = ancestor_mask(tree, max_depth)
    zero = torch.zeros(1, dtype=torch.long, device=tree.device)
    return mask[None, None], prefix_len + torch.cat([zero, tree.depth])


def frontier_attention(tree: DraftTree, nodes: torch.Tensor, cached: torch.Tensor, prefix_len: int,
                       root_pos: int, max_depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and positions for a DRAFT forward over tree.tokens[nodes] during expansion.

    The draft's KV cache holds `prefix_len` entries every node may see, then the tree nodes
    `cached` (C,) in that order; the new entries for `nodes` (F,) follow. Same rule as
    tree_attention: a node sees the prefix, its ancestors and itself.
    root_pos: the position the root has in the draft's numbering (the draft's own alignment).
    Returns mask (1, 1, F, prefix_len+C+F) bool and position_ids (F,) = root_pos + depth.
    """
    anc = ancestor_mask(tree, max_depth)[nodes]  # (F, n)
    seen = torch.ones(nodes.shape[0], prefix_len, dtype=torch.bool, device=tree.device)
    mask = torch.cat([seen, anc[:, cached], anc[:, nodes]], dim=1)
    return mask[None, None], root_pos + tree.depth[nodes]


def retrieve_paths(tree: DraftTree) -> torch.Tensor:
    """(P, D) int64: one row per leaf (increasing leaf index), its nodes from depth 1 down, ROOT-padded."""
    n = tree.num_nodes
    has_child = torch.zeros(n, dtype=torch.bool, device=tree.device)
    has_child[tree.parents[tree.parents >= 0]] = True
    leaves = (~has_child).nonzero().flatten()  # (P,)
    table = ancestor_table(tree)[leaves]  # (P, D): leaf first
    dep = tree.depth[leaves][:, None]  # (P, 1)
    k = torch.arange(table.shape[1], device=tree.device)  # (D,)
    flipped = table.gather(1, (dep - 1 - k).clamp(min=0))  # column k = ancestor at depth k + 1
    return torch.where(k < dep, flipped, ROOT)
