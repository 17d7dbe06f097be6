"""Training-time test (TTT): K unrolled draft steps on one micro-batch -> weighted loss and metric counts.

Token alignment (docs/ARCHITECTURE.md): at draft position t, step k (0-based here, k+1 in reports)
reads the token x_{t+1+k}. As hidden state it reads fc(taps[t]) at step 0, or its own step k-1
output at position t. It predicts x_{t+2+k}, supervised by the target's distribution at position
t+1+k, i.e. softmax(lm_head(final_hidden[t+1+k])) restricted to the draft vocabulary. Step k runs at
RoPE positions t+k, as the draft does when decoding (SafeAILab/EAGLE eagle/traineagle3/cnets.py and
SpecForge specforge/modeling/draft/llama3_eagle.py apply `position_ids + lck`), and attends to the
step-0 keys <= t plus its own earlier steps' keys at t (`draft.ttt_mask`).

Losses (`loss` in TrainConfig):
- "soft-ce" (EAGLE-3 / SpecForge): -sum_v p(v) log q(v) over the draft vocabulary, on assistant
  positions whose target argmax lies in the draft vocabulary (SpecForge `_compute_target_p`).
- "kl" (speculators `kl_div_loss`): KL(p || q) over the draft vocabulary on every assistant position,
  the out-of-vocabulary ones included.
Step k's loss is weighted decay**k. Sums are divided by the micro-batch group's count of step-1
loss positions (`denom`, from the data alone), so splitting a batch over micro-batches or ranks
does not change the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..draft import Eagle3Draft, ttt_mask


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """-sum_v p(v) log softmax(logits)(v) per row, as lse(logits) * sum(p) - sum(p * logits).

    Same value and gradient as `-(p * logits.float().log_softmax(-1)).sum(-1)`, without an fp32
    log-softmax the size of the vocabulary per TTT step. On CUDA `torch.compile` fuses it into one
    pass over logits and p forward and one backward. Unfused, it can be over half of a training
    step's GPU time.
    """
    lf = logits.float()
    return torch.logsumexp(lf, dim=-1) * p.sum(-1) - (p * lf).sum(-1)


_fused_soft_ce = None


def _soft_ce(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    global _fused_soft_ce
    if not logits.is_cuda:
        return soft_cross_entropy(logits, p)
    if _fused_soft_ce is None:  # batch shapes vary: one dynamic-shape kernel pair for all of them
        _fused_soft_ce = torch.compile(soft_cross_entropy, dynamic=True)
    return _fused_soft_ce(logits, p)


@dataclass(frozen=True)
class TTTSpec:
    steps: int = 7
    decay: float = 0.8
    loss: str = "soft-ce"


@torch.no_grad()
def target_side(head: nn.Module, final_hidden: torch.Tensor, t2d: torch.Tensor, draft_ids: torch.Tensor,
                extra: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's view of a batch, padded by `extra` positions at the end (their values are masked).

    final_hidden (B, T, H) post-norm -> p (B, T+extra, Vd) fp32 softmax over the draft vocabulary,
    top (B, T+extra) the target's argmax over its whole vocabulary, in_vocab (B, T+extra) bool.
    """
    fh = F.pad(final_hidden, (0, 0, 0, extra))  # (B, T+extra, H)
    logits = head(fh.to(head.weight.dtype))  # (B, T+extra, V)
    top = logits.argmax(-1)
    p = torch.softmax(logits.index_select(-1, draft_ids).float(), dim=-1)  # (B, T+extra, Vd)
    return p, top, t2d[top]


class TTTModel(nn.Module):
    """The draft plus its TTT unroll in one forward, so DDP/FSDP see one forward per backward."""

    def __init__(self, draft: Eagle3Draft, spec: TTTSpec):
        super().__init__()
        self.draft, self.spec = draft, spec

    def forward(self, input_ids, loss_mask, taps, target_p, target_top, in_vocab, denom):
        """input_ids/loss_mask (B, T); taps (B, T, n*Ht); target_* padded to T + K + 1 (target_side).

        Returns (loss: scalar, counts: (K, len(metrics.FIELDS)) float64, detached).
        """
        K, decay, kl = self.spec.steps, self.spec.decay, self.spec.loss == "kl"
        B, T = input_ids.shape
        ids = F.pad(input_ids, (0, K + 1))  # (B, T+K+1): tokens past the end are never supervised
        lm = F.pad(loss_mask, (0, K + 2))  # (B, T+K+2)
        hidden = self.draft.fuse(taps)  # (B, T, H)
        cache = self.draft.new_cache(B, None, dtype=hidden.dtype, device=hidden.device)  # growing: autograd
        pos = torch.arange(T, device=ids.device).expand(B, T)
        prefix = torch.ones(B, T, dtype=torch.bool, device=ids.device)
        loss = hidden.new_zeros((), dtype=torch.float32)
        rows = []
        for k in range(K):
            mask = None if k == 0 else ttt_mask(T, k, ids.device)  # (1, 1, T, (k+1)T)
            logits, hidden = self.draft(ids[:, k + 1:k + 1 + T], hidden, pos + k, cache=cache, attn_mask=mask)
            p = target_p[:, k + 1:k + 1 + T]  # (B, T, Vd)
            top = target_top[:, k + 1:k + 1 + T]  # (B, T)
            m = lm[:, k + 2:k + 2 + T]  # the predicted token x_{t+2+k} is an assistant token
            where = m if kl else m & in_vocab[:, k + 1:k + 1 + T]
            per = _soft_ce(logits, p)  # (B, T)
            if kl:
                per = per + torch.xlogy(p, p).sum(-1)  # minus the target's entropy: KL(p || q)
            step_loss = torch.where(where, per, 0.0).sum()
            loss = loss + decay ** k * step_loss
            with torch.no_grad():
                correct = self.draft.draft_to_target(logits.argmax(-1)) == top
                den = m & prefix
                rows.append(torch.stack([step_loss.detach().double(), where.sum().double(), m.sum().double(),
                                         (m & correct).sum().double(), den.sum().double(),
                                         (den & correct).sum().double()]))
                prefix = den & correct
        return loss / denom, torch.stack(rows)  # (K, FIELDS)

