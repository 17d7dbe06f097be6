"""Greedy chain rounds that never wait for the host (`SpecDecoder`, static shapes: CUDA graphs on a GPU).

A round that reads its verdict back leaves the GPU idle from that read-back until the next replay
starts: the host must learn how many draft tokens were accepted before it can feed the next extend
(on the H200, 0.29 ms of a 2.0 ms chain-7 round was spent outside the replays; docs/PERFORMANCE.md).
Here the accepted count never leaves the device. Each round is three replays over fixed buffers:

  1. the draft's extend of K+1 rows (the last round's accepted tokens and their taps, rows past the
     accepted count computed and never used) and its greedy chain from the last accepted row, which
     writes [root] + the K draft tokens into the verify's input and moves the draft's position on;
  2. the target's verify of those K+1 rows (its usual static forward);
  3. the verdict: the accepted count n from the target's argmax, the committed tokens written at
     their positions, the next extend's inputs and both positions moved on by n + 1.

The host queues `ahead` rounds, then reads the counts and tokens back in one go. Up to ahead - 1
rounds past an EOS or the token limit are computed and dropped, so both caches get room for them.
"""

from __future__ import annotations

import torch

from .runners import DraftRunner, TargetRunner

ROUNDS_AHEAD = 4  # rounds queued between read-backs on CUDA


class ChainRounds:
    """The buffers and static functions of greedy chain-of-K rounds for one decoder's runners."""

    def __init__(self, drafter: DraftRunner, verifier: TargetRunner, K: int):
        self.drafter, self.verifier, self.K = drafter, verifier, K
        self.rows = K + 1
        # the static functions' keys in the runners: the draft's round, the verify, the verdict
        self.keys = (("rounds", self.rows, K - 1), (self.rows, ("ids",)), ("verdict", self.rows))
        self.draft_st = self.verify_st = self.verdict_st = None

    @staticmethod
    def headroom(K: int, ahead: int) -> int:
        """Cache rows beyond the token limit that rounds past it may write."""
        return ahead * (K + 1)

    def start(self, feed: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Take over after a synced round: feed = (taps (n+1, nH), next tokens (n+1,)) as `_step` returns
        it, both runners committed and nothing pending."""
        d, v, rows = self.drafter, self.verifier, self.rows
        taps, ids = feed
        assert d.pending == 0 and v.pending == 0 and len(ids) <= rows
        current = (d._static.get(self.keys[0]), v._static.get(self.keys[1]), d._static.get(self.keys[2]))
        if (self.draft_st, self.verify_st, self.verdict_st) != current:  # never made, or a reset grew the caches
            self._make(taps)
        n = len(ids) - 1
        self.extend["ids"][0, :n + 1].copy_(ids)
        self.extend["taps"][0, :n + 1].copy_(taps)
        self.extend["last"].fill_(n)
        for runner, buffers in ((d, self.extend), (v, self.verify)):  # positions from each one's length on
            torch.arange(runner.length, runner.length + rows, out=buffers["pos"][0])
            buffers["at"].fill_(runner.length)
        self.verdict["round"].zero_()
        self.rounds = 0

    def _make(self, taps: torch.Tensor) -> None:
        """The three static functions, made (and on CUDA captured) once; their buffers are shared."""
        d, v, rows, dev = self.drafter, self.verifier, self.rows, self.verifier.device
        draft_key, _, verdict_key = self.keys
        self.verify_st = v._static_size(rows, {"ids": torch.zeros(rows, dtype=torch.long, device=dev)})
        self.verify = self.verify_st.inputs
        self.verify["block"].copy_(v._block(None, rows, rows, v.max_pending))  # causal: the chain
        # the captures below write from each runner's length on: slots nothing committed is in
        self.verify["at"].fill_(v.length)
        extend = d._static_inputs(rows, {"ids": torch.zeros(rows, dtype=torch.long), "taps": taps[:1]}, scratch=0)
        extend["block"].copy_(d._block(None, rows, rows, d.max_pending))
        extend["at"].fill_(d.length)
        extend.update(last=torch.zeros(1, dtype=torch.long, device=dev), verify_ids=self.verify["ids"])
        d._static_function(draft_key, self._draft_round, extend, self.K - 1)
        self.draft_st, self.extend = d._static[draft_key], extend
        s = v.book.max_len
        verdict = {"best": torch.zeros(rows, dtype=torch.long, device=dev), "verify_ids": self.verify["ids"],
                   "verify_pos": self.verify["pos"], "verify_at": self.verify["at"], "draft_ids": extend["ids"],
                   "last": extend["last"], "tokens": torch.zeros(s + 1, dtype=torch.long, device=dev),
                   "accepted": torch.zeros(s, dtype=torch.long, device=dev),
                   "round": torch.zeros(1, dtype=torch.long, device=dev)}
        d._static_function(verdict_key, self._verdict, verdict)
        self.verdict_st, self.verdict = d._static[verdict_key], verdict

    def _draft_round(self, feed: dict[str, torch.Tensor], steps: int) -> tuple[torch.Tensor]:
        """The extend of K+1 rows and the greedy chain from row `last` (DraftRunner._extend_chain), then
        [root] + draft tokens into the verify's ids and the draft's position moved past the kept rows."""
        tokens, = self.drafter._extend_chain({k: t for k, t in feed.items() if k != "verify_ids"}, steps)
        last = feed["last"]
        feed["verify_ids"][0].copy_(torch.cat([feed["ids"][0].index_select(0, last), tokens]))
        feed["pos"].add_(last + 1)
        feed["at"].add_(last + 1)
        return (tokens,)

    @staticmethod
    def _verdict(feed: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        """Accept the longest prefix of the draft tokens equal to the target's argmax (acceptance.py's
        greedy chain rule); row i's argmax is the token at position pos[i] + 1."""
        best = feed["best"]
        n = (feed["verify_ids"][0, 1:] == best[:-1]).long().cumprod(0).sum().view(1)
        feed["tokens"].index_copy_(0, feed["verify_pos"][0] + 1, best)
        feed["accepted"].index_copy_(0, feed["round"], n)
        feed["round"].add_(1)
        feed["draft_ids"][0].copy_(best)  # the next extend: the accepted tokens and the one after them
        feed["last"].copy_(n)
        feed["verify_pos"].add_(n + 1)
        feed["verify_at"].add_(n + 1)
        return (n,)

    def run(self, count: int) -> list[tuple[int, list[int]]]:
        """`count` rounds queued without a read-back, then read back: [(accepted draft tokens, committed
        tokens)] per round. The runners' lengths follow what was committed."""
        for _ in range(count):
            self.draft_st.run()
            logits, taps = self.verify_st.run()
            torch.argmax(logits[0], -1, out=self.verdict["best"])
            self.extend["taps"].copy_(taps)
            self.verdict_st.run()
        first = self.rounds
        self.rounds += count
        accepted = self.verdict["accepted"][first:self.rounds].tolist()  # the read-back
        v, d = self.verifier, self.drafter
        start, end = v.length + 1, v.length + 1 + sum(n + 1 for n in accepted)
        tokens = self.verdict["tokens"][start:end].tolist()
        out, at = [], 0
        for n in accepted:
            out.append((n, tokens[at:at + n + 1]))
            at += n + 1
        v.length += at
        d.length += at
        return out
