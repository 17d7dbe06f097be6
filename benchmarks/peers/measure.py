"""What each draft accepts: replayed in eaglewire's decoder, and counted by the real engines.

- `texts`: each suite's prompts with the target's own greedy continuation, written once, and every tap of
  every sequence captured once (doctor/probe_inputs.py). Every draft is scored on these same tokens, so
  the comparisons between drafts are paired by prompt.
- `replay`: the decoder's greedy chain replayed over those tokens (doctor/chain.py): a round at every
  position, walked as the decoder walks the text. On one text it counts what the decoder accepts there
  (benchmarks/precision.py `--text decoder` checks the two agree).
- Held-out acc@1 is the same replay's first-token accuracy on conversations none of the trainers saw, with
  the target's written replies as the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eaglewire import checkpoint
from eaglewire.doctor import chain, paired, probe_inputs


@dataclass
class Text:
    """One suite's sequences (the target's greedy text), with every tap of each captured."""

    name: str
    seqs: list  # (input_ids (T,), mask (T,) bool over the continuation)
    states: list  # probe_inputs.capture_states per sequence
    conversations: list  # the prompts as chat messages, for the engines


def suite_text(target, suite: str, n: int, new_tokens: int) -> Text:
    from eaglewire.data.suites import load_suite

    sp = load_suite(suite, n)
    s = probe_inputs.sequences(target, n, sp.conversations, f"--suite {sp.name}", new_tokens)
    states = [probe_inputs.capture_states(target.model, ids) for ids, _ in s.seqs]
    return Text(suite, s.seqs, states, sp.conversations[:len(s.seqs)])


def heldout_text(target, conversations: list, max_len: int) -> Text:
    s = probe_inputs.sequences(target, len(conversations), conversations, "held-out conversations", max_len=max_len)
    states = [probe_inputs.capture_states(target.model, ids) for ids, _ in s.seqs]
    return Text("held-out", s.seqs, states, conversations)


def load(native: Path, device) -> tuple:
    """A native checkpoint in fp32 on `device`, and the taps it was trained on."""
    draft, meta = checkpoint.load_draft(native)
    return draft.float().to(device).eval(), tuple(meta.contract.taps)


@torch.no_grad()
def replay(draft, taps: tuple, text: Text, K: int) -> tuple[dict, paired.PerPrompt]:
    tallies = []
    for (ids, mask), st in zip(text.seqs, text.states):
        feed = torch.cat([st[t] for t in taps], dim=-1).float()  # (T, n*H), the taps the draft was trained on
        tallies.append(chain.tally(draft, feed, ids, mask, st["top"], K))
    return chain.summarize(tallies, K), paired.PerPrompt.of(tallies)


def against(base: paired.PerPrompt, others: dict) -> dict:
    """Each of `others` (name -> PerPrompt) against `base`, paired over the same prompts: the acceptance-length
    difference with its simultaneous 95% interval, and relative to base."""
    names = list(others)
    diffs = paired.compare(base, [others[k] for k in names]) if names else []
    return {k: {"difference": d.length, "interval": list(d.length_ci),
                "relative": d.length / d.base_length if d.base_length else None} for k, d in zip(names, diffs)}
