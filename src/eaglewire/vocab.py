"""The draft vocabulary: which target tokens the draft's lm_head can predict.

Two tables, the same in every engine (docs/CONVENTIONS.md section 4):
- d2t (LongTensor[draft_vocab]): OFFSETS, target_id = draft_id + d2t[draft_id]
  (SGLang llama_eagle3.py `hot_token_id = d2t + arange`, vLLM `draft_id_to_target_id`);
- t2d (BoolTensor[target_vocab]): True where the target token is in the draft vocabulary.

EAGLE, SpecForge (specforge/data/preprocessing.py) and speculators
(src/speculators/train/vocab_mapping.py) keep the most frequent tokens and store them SORTED by
target id. NVIDIA Model-Optimizer (examples/speculative_decoding calibrate_draft_vocab.py) keeps
frequency order and saves only d2t: `t2d_from_d2t` rebuilds t2d, `sort_d2t` puts it in id order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from .errors import EaglewireError, UsageError


def _counts(token_counts, vocab_size: int | None) -> torch.Tensor:
    if isinstance(token_counts, Mapping):
        if vocab_size is None:
            raise UsageError("token counts given as a dict need vocab_size (the target's vocabulary size)")
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for tid, c in token_counts.items():
            tid = int(tid)  # JSON object keys arrive as strings
            if not 0 <= tid < vocab_size:
                raise UsageError(f"token counts: token id {tid} outside the target vocabulary 0..{vocab_size - 1}")
            counts[tid] = int(c)
    else:
        counts = torch.as_tensor(token_counts)
        if counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype == torch.bool:
            raise UsageError(f"token counts must be a 1-D integer tensor over the target vocabulary, got "
                             f"{counts.dtype} {tuple(counts.shape)}")
        counts = counts.long().cpu()
        if vocab_size is not None and counts.numel() != vocab_size:
            raise UsageError(f"token counts cover {counts.numel()} tokens, the target vocabulary has {vocab_size}")
    if counts.numel() and int(counts.min()) < 0:
        raise UsageError(f"token counts must be >= 0, found {int(counts.min())}")
    return counts


def select_draft_vocab(token_counts, size: int, always: Iterable[int] = (),
                       vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The `size` most frequent tokens (ties: lower id first) plus every id in `always` -> (d2t, t2d).

    token_counts: LongTensor[vocab] or {token_id: count} (then vocab_size is required). Tokens that
    never occur rank by id, so a short count list is padded with the lowest ids (as speculators
    does). The selection is stored sorted by target id. size >= vocab: the identity (d2t all zero,
    t2d all True).
    """
    counts = _counts(token_counts, vocab_size)
    V = counts.numel()
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise UsageError(f"draft vocabulary size must be a positive integer, got {size!r}")
    if size >= V:
        return torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
    forced = sorted({int(a) for a in always})
    if any(not 0 <= a < V for a in forced):
        raise UsageError(f"always-included ids {[a for a in forced if not 0 <= a < V]} outside 0..{V - 1}")
    if len(forced) > size:
        raise UsageError(f"{len(forced)} always-included ids do not fit a draft vocabulary of {size}")
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: equal counts keep id order
    chosen = torch.zeros(V, dtype=torch.bool)
    chosen[forced] = True
    chosen[order[~chosen[order]][: size - len(forced)]] = True
    ids = chosen.nonzero().flatten()  # ascending target ids
    return d2t_from_ids(ids), chosen


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The draft-to-target table: LongTensor[draft_vocab], the target id of each draft id
    (draft_id + d2t[draft_id]), on d2t's device. The one place it is computed."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def d2t_from_ids(target_ids: torch.Tensor) -> torch.Tensor:
    """d2t (offsets) from the target ids of draft ids 0..n-1: the inverse of draft_ids."""
    return target_ids - torch.arange(target_ids.numel(), device=target_ids.device)


def _looks_absolute(d: torch.Tensor, t2d: torch.Tensor | None, V: int) -> bool:
    """d2t that reads as a valid table of absolute target ids (the classic offset/absolute mix-up)."""
    if d.numel() < 2 or int(d.min()) < 0 or int(d.max()) >= V or d.unique().numel() != d.numel():
        return False
    return t2d is None or (bool(t2d[d].all()) and int(t2d.sum()) == d.numel())


def _few(t: torch.Tensor, k: int = 5) -> str:
    vals = t.flatten().tolist()
    return str(vals[:k])[:-1] + (", ...]" if len(vals) > k else "]")


def validate_vocab(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int,
                   where: str = "draft vocabulary") -> None:
    """Raise EaglewireError unless d2t (offsets) and t2d (None: skipped) describe one vocabulary.

    Checks: absolute ids stored instead of offsets, mapped ids outside the target vocabulary,
    two draft ids mapping to one target id, and t2d disagreeing with d2t. Any order is valid
    (engines index d2t by draft id); eaglewire writes sorted tables.
    """
    if not torch.is_tensor(d2t) or d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise EaglewireError(f"{where}: d2t must be a 1-D integer tensor, got "
                             f"{getattr(d2t, 'dtype', type(d2t).__name__)} {tuple(getattr(d2t, 'shape', ()))}")
    n, V = d2t.numel(), vocab_size
    if not 0 < n <= V:
        raise EaglewireError(f"{where}: d2t has {n} entries; a draft vocabulary needs 1..{V} (the target's size)")
    if t2d is not None and (not torch.is_tensor(t2d) or t2d.dtype != torch.bool or tuple(t2d.shape) != (V,)):
        raise EaglewireError(f"{where}: t2d must be a bool tensor of shape ({V},) (the target vocabulary), got "
                             f"{getattr(t2d, 'dtype', type(t2d).__name__)} {tuple(getattr(t2d, 'shape', ()))}")
    d = d2t.detach().long().cpu()
    t2d = t2d.detach().cpu() if t2d is not None else None
    ids = draft_ids(d)
    out = (ids < 0) | (ids >= V)
    disagrees = t2d is not None and not bool(t2d[ids.clamp(0, V - 1)].all())
    if (out.any() or disagrees) and _looks_absolute(d, t2d, V):
        raise EaglewireError(f"{where}: d2t holds absolute target ids, not offsets (every engine reads "
                             "target_id = draft_id + d2t[draft_id]); store d2t - arange(len(d2t))")
    if out.any():
        bad = out.nonzero().flatten()
        raise EaglewireError(f"{where}: d2t maps draft ids {_few(bad)} to target ids {_few(ids[bad])} outside "
                             f"0..{V - 1}")
    uniq, counts = ids.unique(return_counts=True)
    if uniq.numel() != n:
        raise EaglewireError(f"{where}: d2t maps several draft ids to the same target ids {_few(uniq[counts > 1])}")
    if t2d is not None:
        if int(t2d.sum()) != n:
            raise EaglewireError(f"{where}: t2d marks {int(t2d.sum())} target tokens but d2t has {n} draft tokens")
        if disagrees:
            raise EaglewireError(f"{where}: t2d is False for target ids {_few(ids[~t2d[ids]])} that d2t maps to")


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Rebuild t2d from d2t alone (ModelOpt saves only d2t)."""
    validate_vocab(d2t, None, vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids(d2t.long().cpu())] = True
    return t2d


def sort_d2t(d2t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A frequency-ordered d2t in target-id order -> (sorted d2t, order).

    New draft id j is old draft id order[j]: permute the lm_head rows with `weight[order]`.
    """
    ids = draft_ids(d2t.long().cpu())
    order = torch.argsort(ids)
    return d2t_from_ids(ids[order]), order


def target_to_draft_ids(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """LongTensor[vocab_size]: the draft id of each target token, -1 outside the draft vocabulary."""
    ids = draft_ids(d2t.long().cpu())
    out = torch.full((vocab_size,), -1, dtype=torch.long)
    out[ids] = torch.arange(ids.numel())
    return out.to(d2t.device)
