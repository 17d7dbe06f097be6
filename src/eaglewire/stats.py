"""The bootstrap over prompts behind every interval eaglewire prints.

Acceptance figures are ratios summed over prompts (tokens / rounds). Positions within one prompt are not
independent (a reply that loops is accepted at every position), so prompts, not positions, are resampled:
each resample draws the prompts with replacement and recomputes the ratio. A fixed seed makes the same
prompts give the same interval.
"""

from __future__ import annotations

import torch

RESAMPLES = 10000
SEED = 0


def prompt_weights(prompts: int, resamples: int = RESAMPLES, seed: int = SEED) -> torch.Tensor:
    """(resamples, prompts) float64: how often each prompt is drawn in each resample."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, prompts, (resamples, prompts), generator=g)
    return torch.zeros(resamples, prompts, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(resamples, prompts, dtype=torch.float64))


def ratio(weights: torch.Tensor, num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """Each resample's sum(num) / sum(den); nan where a resample drew no denominator."""
    n, d = weights @ num.double(), weights @ den.double()
    return torch.where(d > 0, n / d.clamp(min=1e-12), torch.full_like(n, float("nan")))


def ratio_interval(num, den, level: float = 0.95, resamples: int = RESAMPLES, seed: int = SEED) -> tuple | None:
    """The bootstrap interval of sum(num) / sum(den) over prompts; None with fewer than two prompts."""
    num, den = torch.as_tensor(num, dtype=torch.float64), torch.as_tensor(den, dtype=torch.float64)
    if num.numel() < 2 or float(den.sum()) <= 0:
        return None
    r = ratio(prompt_weights(num.numel(), resamples, seed), num, den)
    q = torch.nanquantile(r, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return float(q[0]), float(q[1])


def interval_words(ci) -> str:
    """How bench and the recipes print an interval from ratio_interval (a list once read back from JSON)."""
    return f"95% interval {ci[0]:.2f}-{ci[1]:.2f} over the prompts"
