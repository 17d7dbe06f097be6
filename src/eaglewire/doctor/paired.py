"""Paired comparison of wirings measured on the same prompts and positions.

Every wiring is measured on the same continuations, so two wirings' figures share the prompts'
difficulty: a hard prompt lowers both. Comparing them through their own standard errors ignores
that and calls real differences noise; a paired comparison takes each prompt's difference and asks
how much it varies. Here that is a bootstrap over prompts: positions within one prompt are not
independent, so prompts, not positions, are resampled. Each resample draws the prompts with
replacement, the SAME draw for every wiring. It recomputes each wiring's acceptance length (tokens /
rounds of the decoder's walk, chain.walk), step-1 accuracy and, where measured, the step-1
log-probability of the target's token (chain.py: it tells wirings apart where acceptance ties).

Intervals are simultaneous over the alternatives compared (Bonferroni): with 15 alternatives at a
5% family-wise level each interval is a 99.67% one, so among that many wirings chance alone names a
better one less than one time in twenty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..stats import RESAMPLES, SEED, prompt_weights

LEVEL = 0.95  # family-wise confidence of all intervals together
COSTLY = 0.03  # a wiring costing at least this share of acceptance length is an error, less a warning


@dataclass(frozen=True)
class PerPrompt:
    """One wiring's tallies per prompt, (P,) each: the decoder walk's tokens and rounds, step-1 hits
    and starts; the summed step-1 log-probability of the target's token and its count (None where the
    source has no logits, as an engine's counters)."""

    tokens: torch.Tensor
    rounds: torch.Tensor
    hits1: torch.Tensor
    starts: torch.Tensor
    loglik: torch.Tensor | None = None
    loglik_n: torch.Tensor | None = None

    @classmethod
    def of(cls, tallies) -> "PerPrompt":
        f = lambda name: torch.tensor([getattr(t, name) for t in tallies], dtype=torch.float64)  # noqa: E731
        return cls(f("walk_tokens"), f("walk_rounds"), f("hits1"), f("starts"), f("loglik"), f("loglik_n"))


@dataclass(frozen=True)
class Difference:
    """An alternative against the engine's wiring: point estimates and simultaneous intervals of
    (alternative - engine) for acceptance length and step-1 accuracy."""

    length: float
    length_ci: tuple[float, float]
    acc1: float
    acc1_ci: tuple[float, float]
    base_length: float  # the engine wiring's acceptance length
    loglik: float | None = None  # mean step-1 log-probability of the target's token, alternative - engine
    loglik_ci: tuple[float, float] | None = None

    @property
    def better(self) -> bool:
        """Significantly longer acceptance than the engine's wiring."""
        return self.length_ci[0] > 0

    @property
    def worse(self) -> bool:
        return self.length_ci[1] < 0

    @property
    def likelier(self) -> bool:
        """The draft gives the target's tokens a significantly higher log-probability under the alternative."""
        return self.loglik_ci is not None and self.loglik_ci[0] > 0

    @property
    def less_likely(self) -> bool:
        return self.loglik_ci is not None and self.loglik_ci[1] < 0

    @property
    def cost(self) -> float:
        """The share of this wiring's acceptance length that the engine's wiring gives up (<= 0: none)."""
        return self.length / (self.base_length + self.length) if self.base_length + self.length > 0 else 0.0

    def to_dict(self) -> dict:
        r = lambda x: round(float(x), 4)  # noqa: E731
        return {"acceptance_length": r(self.length), "acceptance_length_ci": [r(v) for v in self.length_ci],
                "acc1": r(self.acc1), "acc1_ci": [r(v) for v in self.acc1_ci], "cost": r(self.cost),
                "better": self.better, "worse": self.worse,
                **({"loglik1": r(self.loglik), "loglik1_ci": [r(v) for v in self.loglik_ci]}
                   if self.loglik_ci is not None else {})}


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / den.clamp(min=1e-12), torch.zeros_like(num))


def compare(base: PerPrompt, others: list[PerPrompt], *, level: float = LEVEL, resamples: int = RESAMPLES,
            seed: int = SEED) -> list[Difference]:
    """Each of `others` against `base`, paired by prompt (the bootstrap above)."""
    if not others:
        return []
    P = base.tokens.numel()
    weights = prompt_weights(P, resamples, seed)  # (B, P): how often each prompt was drawn
    tail = (1 - level) / (2 * len(others))

    def stats(x: PerPrompt) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        length = _ratio(weights @ x.tokens, weights @ x.rounds)
        acc = _ratio(weights @ x.hits1, weights @ x.starts)
        return length, acc, _point(x.tokens, x.rounds), _point(x.hits1, x.starts)

    def interval(d: torch.Tensor) -> tuple[float, float]:
        q = torch.quantile(d, torch.tensor([tail, 1 - tail], dtype=torch.float64))
        return float(q[0]), float(q[1])

    def loglik(x: PerPrompt) -> tuple[torch.Tensor, float] | None:
        if x.loglik is None or float(x.loglik_n.sum()) == 0:
            return None
        return _ratio(weights @ x.loglik, weights @ x.loglik_n), _point(x.loglik, x.loglik_n)

    bl, ba, bl0, ba0 = stats(base)
    bll = loglik(base)
    out = []
    for o in others:
        ol, oa, ol0, oa0 = stats(o)
        oll = loglik(o) if bll is not None else None
        out.append(Difference(length=ol0 - bl0, length_ci=interval(ol - bl), acc1=oa0 - ba0,
                              acc1_ci=interval(oa - ba), base_length=bl0,
                              loglik=oll[1] - bll[1] if oll else None,
                              loglik_ci=interval(oll[0] - bll[0]) if oll else None))
    return out


def _point(num: torch.Tensor, den: torch.Tensor) -> float:
    d = float(den.sum())
    return float(num.sum()) / d if d > 0 else 0.0
