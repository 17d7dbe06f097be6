"""The decoder's greedy chain, replayed over captured sequences: how many of K drafted tokens the
target accepts when a round starts at each position, and what a decoder walking the sequence sees.

Token alignment (docs/ARCHITECTURE.md): a round that starts at position t has extended the draft
with the taps of positions <= t and the token x_{t+1}. Step k (0-based) reads x_{t+1+k} and its own
previous hidden state at RoPE position t+k. It attends to the extend's keys <= t and to its own
earlier steps, and must reproduce the target's argmax at t+1+k, i.e. the token x_{t+2+k}. That is the
decoder's chain round (rounds.py, DraftRunner.extend_chain; and TTT's unroll, which trains for it). On the
target's own greedy continuation the token fed at step k is the draft's own when every earlier step was
accepted, so the run of leading hits is exactly what verify_chain_greedy accepts there.

Only the chains that are still alive are computed: step k runs at the positions whose steps < k all
hit, so a probe costs about two draft passes per wiring instead of K.

Step 1 also gives, at every start, the log-probability the draft puts on the target's token. Acceptance
counts only argmax hits, so a draft that rarely hits (an early checkpoint) ties every wiring on it. The
log-probability still moves with the wiring at every start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..vocab import target_to_draft_ids


@dataclass(frozen=True)
class Tally:
    """One sequence under one wiring.

    `starts`: positions where a round can start (the token it predicts first is a continuation token).
    `hits1`: of those, where the first drafted token is the target's. `walk_tokens` / `walk_rounds`:
    what a decoder walking the continuation commits and how many rounds it takes (accepted + the bonus
    token a round). `walk_accepted`: (K,) rounds whose k-th draft token was accepted. `reached` /
    `kept`: (K,) chains, over every start, that reached step k and that hit there (conditional
    acceptance). `all_starts_tokens`: sum over every start of 1 + its run (the trainer's uniform
    estimate). `loglik` / `loglik_n`: the summed step-1 log-probability of the target's token over
    the starts whose token the draft vocabulary holds, and their count.
    """

    starts: int
    hits1: int
    walk_tokens: int
    walk_rounds: int
    walk_accepted: torch.Tensor
    reached: torch.Tensor
    kept: torch.Tensor
    all_starts_tokens: int
    loglik: float = 0.0
    loglik_n: int = 0


class Runs(NamedTuple):
    starts: torch.Tensor  # (T,) bool
    runs: torch.Tensor  # (T,) long, 0 where not a start
    reached: torch.Tensor  # (K,)
    kept: torch.Tensor  # (K,)
    loglik: float
    loglik_n: int


@torch.no_grad()
def run_lengths(draft, taps: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, top: torch.Tensor,
                K: int, reach: torch.Tensor | None = None) -> Runs:
    """Accepted run of a K-token greedy chain at every start: every position t whose token x_{t+1} and
    next x_{t+2} belong to the continuation (the turn's first token is the target's, from its prefill).

    `taps` (T, n*H) as the engine would feed them; `ids` (T,) the sequence; `mask` (T,) bool:
    continuation tokens. `top` (T,) is the target's argmax at each position (predicting the next
    token). `reach` (T,) bool, default `mask`: where a run may go on; past the continuation's end, the
    tokens the target writes next, which an engine's last round accepts before it trims the text. -> Runs.
    """
    dev = draft.fc.weight.device
    T = ids.numel()
    pad = K + 2
    ids_p = torch.cat([ids, ids.new_zeros(pad)]).to(dev)
    top_p = torch.cat([top, top.new_full((pad,), -1)]).to(dev)
    m_p = torch.cat([mask, mask.new_zeros(pad)]).to(dev)
    r_p = m_p if reach is None else torch.cat([reach, reach.new_zeros(pad)]).to(dev)
    pos = torch.arange(T, device=dev)
    starts = m_p[pos + 1] & m_p[pos + 2]  # x_{t+1} was committed in the continuation, x_{t+2} is drafted
    runs = torch.zeros(T, dtype=torch.long, device=dev)
    reached, kept = torch.zeros(K, dtype=torch.long), torch.zeros(K, dtype=torch.long)
    cache = draft.new_cache(1)
    hidden = draft.fuse(taps[None].to(dev, draft.fc.weight.dtype))
    logits, h = draft(ids_p[1:T + 1][None], hidden, pos[None], cache=cache)  # step 0 at every position: the extend
    live = pos[starts]
    hit = draft.draft_to_target(logits[0, live].argmax(-1)) == top_p[live + 1]
    reached[0], kept[0] = live.numel(), int(hit.sum())
    want = target_to_draft_ids(draft.d2t, draft.config.vocab_size)[top_p[live + 1].clamp(min=0)]
    held = want >= 0
    lp = torch.log_softmax(logits[0, live[held]].float(), -1).gather(-1, want[held, None])
    ll = (float(lp.double().sum()), int(held.sum()))
    blocks = []  # the positions of each later step's keys, in cache order
    h_live = h[0, live]
    for k in range(1, K):
        live, h_live = live[hit], h_live[hit]  # the chains whose steps < k all hit
        runs[live] += 1
        more = r_p[live + 2 + k]  # the token step k predicts is still one the run may reach
        live, h_live = live[more], h_live[more]
        if live.numel() == 0:
            return Runs(starts.cpu(), runs.cpu(), reached, kept, *ll)
        blocks.append(live)
        # step-0 keys up to t, and in each later block the key of the same chain (its own new one included)
        attn = torch.cat([pos[None, :] <= live[:, None]] + [b[None, :] == live[:, None] for b in blocks], dim=1)
        logits, h = draft(ids_p[live + 1 + k][None], h_live[None], (live + k)[None], cache=cache,
                          attn_mask=attn[None, None])
        hit = draft.draft_to_target(logits[0].argmax(-1)) == top_p[live + 1 + k]
        reached[k], kept[k] = live.numel(), int(hit.sum())
        h_live = h[0]
    runs[live[hit]] += 1
    return Runs(starts.cpu(), runs.cpu(), reached, kept, *ll)


def walk(starts: torch.Tensor, runs: torch.Tensor) -> list[int]:
    """A greedy decoder's rounds over the continuation: a round starting at t accepts runs[t] draft tokens and
    commits them with the bonus token, so the next starts at t + runs[t] + 1. Each stretch of starts (an
    assistant turn) begins with the decoder's first round after its prefill. -> accepted per round."""
    s, r = starts.tolist(), runs.tolist()
    out, t = [], 0
    while t < len(s):
        if s[t]:
            out.append(r[t])
            t += r[t] + 1
        else:
            t += 1
    return out


def tally(draft, taps, ids, mask, top, K: int, reach=None) -> Tally:
    starts, runs, reached, kept, loglik, loglik_n = run_lengths(draft, taps, ids, mask, top, K, reach)
    rounds = walk(starts, runs)
    accepted = torch.zeros(K, dtype=torch.long)
    for n in rounds:
        accepted[:n] += 1
    n = int(starts.sum())
    return Tally(starts=n, hits1=int(kept[0]), walk_tokens=sum(rounds) + len(rounds), walk_rounds=len(rounds),
                 walk_accepted=accepted, reached=reached, kept=kept, all_starts_tokens=n + int(runs.sum()),
                 loglik=loglik, loglik_n=loglik_n)


def summarize(tallies: list[Tally], K: int) -> dict:
    """The probe's figures for one wiring over all sequences (the report and the JSON)."""
    rounds = sum(t.walk_rounds for t in tallies)
    starts = sum(t.starts for t in tallies)
    reached = sum((t.reached for t in tallies), torch.zeros(K, dtype=torch.long))
    kept = sum((t.kept for t in tallies), torch.zeros(K, dtype=torch.long))
    accepted = sum((t.walk_accepted for t in tallies), torch.zeros(K, dtype=torch.long))
    ratio = lambda a, b: a / b if b else None  # noqa: E731
    return {"acc1": ratio(sum(t.hits1 for t in tallies), starts),
            "loglik1": ratio(sum(t.loglik for t in tallies), sum(t.loglik_n for t in tallies)),
            "cond_acc": [ratio(int(a), int(b)) for a, b in zip(kept, reached)],
            "acceptance_length": ratio(sum(t.walk_tokens for t in tallies), rounds) or 1.0,
            "accepted_per_pos": [ratio(int(a), rounds) for a in accepted],
            "acceptance_length_all_starts": ratio(sum(t.all_starts_tokens for t in tallies), starts) or 1.0,
            "positions": starts, "rounds": rounds}
