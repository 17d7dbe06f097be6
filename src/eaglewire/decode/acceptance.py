"""Verification math for speculative decoding, chain and tree, greedy and lossless sampling.

No model calls, batch size 1. Index convention shared by every function (it is the order of the
one target forward over [root] + draft tokens):

    target row 0       = the target's output at the ROOT (the last committed token). It is the
                         distribution of the first draft token / of the children of the root.
    target row 1 + i   = the target's output at draft token / tree node i. It is the distribution
                         of the token that follows it (for the last chain token: the bonus token).

Each rule is written once, on the device, as a function with no read-back and no control flow that
depends on the data (`chain_verdict`, `chain_sampling_verdict`, `tree_verdict`, `tree_sampling_verdict`):
rounds.py calls them in every round (inside its CUDA graphs on a GPU). The verify_* functions are the same
rules read back to the host in one copy, for a round taken step by step (the tests' reference round,
tests/decoding.py). Their verdict is what was accepted (a count, or a tree's node path) and the tokens the round
commits. Those are the accepted draft tokens and ONE more token (the correction or the bonus), so a round always
commits n_accepted + 1 tokens.

Two proposal kinds need two different rules to be lossless (the emitted tokens have exactly the
target's sampling distribution):

- SAMPLED draft tokens (token i drawn from the draft distribution q_i): accept with probability
  min(1, p(x)/q(x)); on rejection sample from norm(max(p - q, 0)) (Leviathan et al. 2023; the
  step in gpt-fast generate.py `speculative_decode`). Only for chains: `verify_chain_sampling`
  with `draft_probs`.
- DETERMINISTIC candidates (argmax or top-k of the draft, as EAGLE-2 trees and greedy chains
  choose them): a point-mass proposal. The rule above then becomes "try the candidates in order,
  accept c with the residual target probability r(c), else set r(c) = 0, renormalise, try the
  next; if none is accepted sample from the residual". That sequence picks candidate c with
  probability exactly p(c) and any other token x with probability p(x), i.e. it equals: draw
  x ~ p at the node; if x is one of its candidates descend into it, else emit x. The code uses
  that form (one multinomial over all rows, then a walk), which is lossless by construction and
  accepts as often as any lossless rule can (a candidate can never be accepted with probability
  above p(c)). Using the draft's q(c) in the ratio instead (SafeAILab/EAGLE
  eagle/model/utils.py `evaluate_posterior` with top-k candidates) is NOT lossless: see the
  negative controls in tests/test_acceptance.py.

How a token is drawn (`SamplingParams`, `logits_to_probs`, `sample_with`) is runtime/sampling.py's: the data
stage samples too, and must not depend on the decoder. Only the rules that decide what a round accepts are here.
"""

from __future__ import annotations

import torch

from ..runtime.sampling import sample_with
from .tree import DraftTree


def verify_chain_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, list[int]]:
    """Greedy chain verification.

    draft_tokens (K,) int64; target_logits (K+1, V), row convention in the module docstring.
    Returns (n_accepted, tokens): the longest prefix of draft_tokens equal to the target's argmax,
    then the target's argmax after it (the correction, or the bonus if all K match).
    """
    k = draft_tokens.shape[0]
    _check_rows(target_logits, k + 1, "target_logits")
    return _chain_read_back(*chain_verdict(draft_tokens, target_logits.argmax(-1)))


def verify_chain_sampling(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                          generator: torch.Generator | None = None) -> tuple[int, list[int]]:
    """Lossless chain verification.

    draft_tokens (K,) int64; target_probs (K+1, V) from `logits_to_probs`, rows as in the module
    docstring. draft_probs (K, V): the distribution token i was SAMPLED from (target vocabulary);
    None when the draft tokens were chosen deterministically (e.g. the draft's argmax).
    Returns (n_accepted, tokens) as verify_chain_greedy; the emitted tokens are distributed exactly
    as the target's.
    """
    k = draft_tokens.shape[0]
    _check_rows(target_probs, k + 1, "target_probs")
    if draft_probs is None:  # point-mass proposals: sample the target at every row, accept while equal
        return _chain_read_back(*chain_verdict(draft_tokens, _sample_rows(target_probs, generator)))
    _check_rows(draft_probs, k, "draft_probs")
    u = torch.rand(k + 1, generator=generator, device=target_probs.device)
    return _chain_read_back(*chain_sampling_verdict(draft_tokens.to(target_probs.device), draft_probs, target_probs, u))


def verify_tree_greedy(tree: DraftTree, target_logits: torch.Tensor, max_depth: int | None = None
                       ) -> tuple[list[int], list[int]]:
    """Greedy tree verification.

    target_logits (n+1, V): row 0 at the root, row 1 + i at node i (tree_attention's order).
    Returns (path, tokens). `path` = accepted node indices from depth 1 down: the longest
    root-to-node path whose tokens all equal the target's argmax. `tokens` = theirs, then the
    target's argmax after the last accepted node (after the root if path is empty). max_depth: a
    bound on the tree's depth the caller knows (fewer passes of `tree_verdict`); None: its node
    count.
    """
    _check_rows(target_logits, tree.num_nodes + 1, "target_logits")
    return _tree_read_back(*tree_verdict(tree.tokens, tree.parents, tree.depth, target_logits.argmax(-1),
                                         max_depth or tree.num_nodes))


def verify_tree_sampling(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None = None,
                         max_depth: int | None = None) -> tuple[list[int], list[int]]:
    """Lossless tree verification for DETERMINISTIC candidates (EAGLE-2 top-k trees, see above).

    target_probs (n+1, V) from `logits_to_probs`, rows as in verify_tree_greedy. At each node on
    the way down, draw x from its target row; descend into the child whose token is x, else stop
    and emit x. Returns (path, tokens) like verify_tree_greedy.
    """
    _check_rows(target_probs, tree.num_nodes + 1, "target_probs")
    u = torch.rand(target_probs.shape[0], generator=generator, device=target_probs.device)
    return _tree_read_back(*tree_sampling_verdict(tree.tokens, tree.parents, tree.depth, target_probs, u,
                                                  max_depth or tree.num_nodes))


# --- the rules on the device ------------------------------------------------------------------------
# One function per rule, no read-back and no control flow that depends on the data: the rounds (rounds.py,
# inside their CUDA graphs on a GPU) and the verify_* functions above (read back) call the same ones.

def chain_verdict(draft_tokens: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy chain rule: accept while draft_tokens[i] == chosen[i]. draft_tokens (K,); chosen (K+1,) the
    target's token at each row: its argmax (greedy), or a draw from its distribution (the lossless rule for
    point-mass proposals). Returns (n (1,), row (K+1,) = chosen): row[:n] the accepted tokens, row[n] the
    correction or the bonus."""
    k = draft_tokens.shape[0]
    n = (draft_tokens.to(chosen.device) == chosen[:k]).long().cumprod(0).sum().view(1)
    return n, chosen


def chain_sampling_verdict(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                           u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled chain rule (speculative sampling), with its K + 1 uniform draws given. Accept token i while
    u[i] * q_i(x_i) < p_i(x_i) (probability min(1, p/q); never a token the target cannot emit). Then draw the
    correction from norm(max(p_n - q_n, 0)), or the bonus from p_K, with u[K] (`sample_with`).
    Returns (n (1,), row (K + 1,)): row[:n] the accepted draft tokens, row[n] the drawn one."""
    k = draft_tokens.shape[0]
    idx = draft_tokens.long()[:, None]
    p = target_probs[:k].gather(1, idx).squeeze(1)  # (K,)
    q = draft_probs.gather(1, idx).squeeze(1)  # (K,)
    n = (u[:k] * q < p).long().cumprod(0).sum().view(1)
    p_n = target_probs.index_select(0, n)[0]
    q_n = torch.cat([draft_probs, draft_probs[:1] * 0]).index_select(0, n)[0]  # no q after the last: the bonus
    residual = (p_n - q_n).clamp(min=0)
    residual = torch.where(residual.sum() > 0, residual, p_n)  # p == q up to rounding: a rejection has probability 0
    drawn = sample_with(residual, u[k:k + 1])
    return n, torch.cat([draft_tokens.long(), drawn]).index_copy(0, n, drawn)


def tree_verdict(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, chosen: torch.Tensor,
                 max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The greedy tree rule (DraftTree's fields, nodes (N,)): a node is accepted when its token is chosen[row of
    its parent] and its parent is accepted. The target's token at each row is `chosen` (N+1,) (row 0 the root,
    row 1 + i node i). It is the row's argmax (greedy), or a draw from its distribution (the lossless rule for
    EAGLE-2's deterministic candidates, `tree_sampling_verdict`). Siblings hold distinct tokens, so the accepted
    nodes form one path. max_depth bounds the tree's depth (L = min(max_depth, N) levels).
    Returns (n (1,), rows (L+1,), committed (L+1,)). rows[:n+1] are the root's row and the path's, level by
    level (a level past the path: its own index, L+1 entries whatever n). Then `committed` =
    chosen[rows], whose first n + 1 are the path's tokens and the token after them. Padding nodes of
    depth 0 are never accepted."""
    n_nodes = parents.shape[0]
    parent_row = parents + 1
    ok = tokens.to(chosen.device) == chosen.index_select(0, parent_row)
    accepted = ok
    for _ in range(max_depth - 1):  # an ancestor's rejection reaches its descendants, a level each pass
        accepted = ok & torch.cat([ok.new_ones(1), accepted]).index_select(0, parent_row)
    most = min(max_depth, n_nodes)  # levels a path can reach
    levels = torch.arange(1, most + 1, device=chosen.device)
    at_level = accepted[None, :] & (depth[None, :] == levels[:, None])  # (levels, nodes)
    kept = at_level.any(1)
    n = kept.long().sum().view(1)
    rows = torch.cat([levels.new_zeros(1), torch.where(kept, at_level.long().argmax(1) + 1, levels)])
    return n, rows, chosen.index_select(0, rows)


def tree_sampling_verdict(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                          target_probs: torch.Tensor, u: torch.Tensor, max_depth: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled tree rule: draw x at every row (N+1 rows of target_probs, one uniform draw u each, in row
    order: `sample_with`), then `tree_verdict`'s walk: descend into the child that holds x, else emit x."""
    return tree_verdict(tokens, parents, depth, sample_with(target_probs, u), max_depth)


def _check_rows(t: torch.Tensor, rows: int, name: str) -> None:
    if t.dim() != 2 or t.shape[0] != rows:
        raise ValueError(f"{name} must be ({rows}, V) (one row per input position), got {tuple(t.shape)}")


def _sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(R, V) probabilities -> (R,) one independent sample per row: R uniform draws in row order, as the rounds
    that never wait draw them (rounds.SampledTreeRounds), so that a seed gives the same tokens either way."""
    return sample_with(probs, torch.rand(probs.shape[0], generator=generator, device=probs.device))


def _read_back(*tensors: torch.Tensor) -> list[list[int]]:
    """1-d integer tensors as lists, in ONE device-to-host copy (each copy waits for the device)."""
    flat = torch.cat([t.reshape(-1).long() for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at:at + t.numel()])
        at += t.numel()
    return out


def _chain_read_back(n: torch.Tensor, row: torch.Tensor) -> tuple[int, list[int]]:
    """A chain verdict on the host: (n, the n + 1 committed tokens)."""
    (n,), row = _read_back(n, row)
    return n, row[:n + 1]


def _tree_read_back(n: torch.Tensor, rows: torch.Tensor, committed: torch.Tensor) -> tuple[list[int], list[int]]:
    """A tree verdict on the host: (the accepted node indices, the n + 1 committed tokens)."""
    (n,), rows, committed = _read_back(n, rows, committed)
    return [r - 1 for r in rows[1:n + 1]], committed[:n + 1]
