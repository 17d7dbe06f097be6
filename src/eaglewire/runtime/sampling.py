"""Sampling: how a token is drawn from a model's logits (`SamplingParams`, `logits_to_probs`, `sample_with`).

Pure tensor functions, no model calls and no speculation: the decoder's rounds, its acceptance rules
(decode/acceptance.py) and the data stage's generation (data/datagen.py) all sample through them, so they sit
below all three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import UsageError


@torch.library.custom_op("eaglewire::argsort_stable", mutates_args=())
def argsort_stable(x: torch.Tensor) -> torch.Tensor:
    """Indices that sort x ascending along its last dimension, ties to the lower index. An op of its own so that
    torch.compile calls aten's sort instead of generating its own (a Triton sort fused with what feeds it).
    Compiled that way on CUDA, the one-replay depth-7, top-8 tree indexed past the end of its 392 scores (a
    device-side assert). Yet inductor's sort alone matched aten's."""
    return torch.sort(x, stable=True).indices


@argsort_stable.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.long, device=x.device)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How the target's next token is chosen: temperature 0 = greedy; top_k 0 = off; top_p 1 = off.

    Applied in the order of transformers' `generate`: temperature, then top-k, then top-p.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UsageError(f"sampling: temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"sampling: top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UsageError(f"sampling: top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p.

    Greedy params give the one-hot of the argmax, so the sampling verifiers reduce to greedy ones.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1:  # aten's sort, also where compiled (argsort_stable: inductor's own went wrong there)
        order = argsort_stable(-logits)
        sorted_logits = logits.gather(-1, order)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = cumsum_in_blocks(sorted_probs) - sorted_probs  # mass of the tokens ranked above
        drop = mass_before >= params.top_p  # keeps the smallest prefix reaching top_p, at least one token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return logits.softmax(-1)


SCAN_BLOCK = 1024


def cumsum_in_blocks(x: torch.Tensor) -> torch.Tensor:
    """cumsum over the last dim as scans of SCAN_BLOCK entries plus a short scan of the block totals. One long
    scan over few rows (a vocabulary, 8-64 rows) makes inductor emit a split-scan kernel whose CUDA codegen fails
    (torch 2.11 on CUDA: "list indices must be integers or slices, not NoneType"); these short scans never split."""
    v = x.shape[-1]
    if v <= SCAN_BLOCK:
        return x.cumsum(-1)
    blocks = torch.nn.functional.pad(x, (0, -v % SCAN_BLOCK)).unflatten(-1, (-1, SCAN_BLOCK)).cumsum(-1)
    before = torch.nn.functional.pad(blocks[..., :-1, -1].cumsum(-1), (1, 0))  # mass of the blocks before each
    return (blocks + before.unsqueeze(-1)).flatten(-2)[..., :v]


def sample_with(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(V,) probabilities and a uniform draw u (1,) in [0, 1) -> (1,) the token whose slice of the cumulative
    distribution holds u. It is drawn from `probs` with the randomness given rather than drawn inside. So a
    static function (a CUDA graph) can sample, and an eager path given the same draws picks the same tokens.
    Rows (R, V) with draws (R,) give (R,): a token a row. Never a zero-probability token: the first token with mass
    whose cumulative mass exceeds u * total, or the last token with mass if rounding leaves none. A parallel scan
    may round a zero-mass token's sum above its neighbour's, so "first index past u" alone is not enough."""
    probs = probs.float()
    cdf = cumsum_in_blocks(probs)
    has_mass = probs > 0
    past = (cdf > (u * cdf[..., -1]).unsqueeze(-1)) & has_mass
    last_with_mass = probs.shape[-1] - 1 - has_mass.flip(-1).int().argmax(-1)
    return torch.where(past.any(-1), past.int().argmax(-1), last_with_mass)
