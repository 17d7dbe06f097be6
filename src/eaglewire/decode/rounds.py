"""The decode round: one traceable body per kind (ChainRounds, SampledChainRounds, TreeRounds,
SampledTreeRounds) over fixed buffers, which `SpecDecoder.generate` runs every round.

A round is a few static functions of the runners over buffers shared between them:

  1. the draft's extend over `rows` rows (the last round's committed tokens and their taps; rows past
     the accepted count are computed and never used) and its drafting from the last committed row: a
     greedy chain (ChainRounds), a sampled one (SampledChainRounds) or an EAGLE-2 tree (TreeRounds; its
     verdict sampled in SampledTreeRounds), written as the verify's input, with the draft's position moved
     past the kept rows;
  2. the target's verify (its usual static forward) and, launched by the host, its argmax (greedy) or
     the round's uniform draws (sampled);
  3. the verdict: what was accepted (acceptance.py's rules), the committed tokens written in the round's
     row, the next extend's inputs, the target's position moved on (a tree also moves the accepted
     branch's K/V).

Each static function is built from the runners' fixed-shape interface (runtime/runners.py: make_function,
forward_function, static_inputs, causal_block, masked_forward, move_rows; draft_runner.py: extend_chain,
extend_tree). The same body runs eagerly (a CPU, debugging), compiled (compile=True) or captured in CUDA
graphs (cuda_graphs=True).

The verdict stays on the device: the host queues `count` rounds, then reads their counts and tokens back in
one go (`queue`, then `collect`). On a CPU one round is queued and read back at once. On CUDA the next
batch is queued before a read-back: the copy to pinned memory is ordered behind the batch's last replay, so
the GPU works on the next rounds while the host takes in the last ones. Rounds past an EOS are computed and
dropped (up to 2 * ahead - 1 overlapped; the decoder queues no more rounds than the token limit could need),
so both caches get room for them. What a round costs outside its replays:
`python benchmarks/decode_steps.py --random-draft --rounds on,batched`.
"""

from __future__ import annotations

import torch

from ..runtime.runners import TargetRunner
from ..runtime.sampling import logits_to_probs
from .acceptance import chain_sampling_verdict, chain_verdict, tree_sampling_verdict, tree_verdict
from .draft_runner import DraftRunner
from .tree import grown_nodes

# Rounds a read-back on CUDA, the next batch queued before it. Batched without that overlap, the GPU waits while the
# host takes a batch in and launches the next; overlapped, one a batch is enough, and wastes least after an EOS
# (benchmarks/decode_steps.py --rounds on,batched measures both).
ROUNDS_AHEAD = 1


class _Rounds:
    """What both kinds share: the extend's and the verdict's buffers, taking over, reading back."""

    def __init__(self, drafter: DraftRunner, verifier: TargetRunner, rows: int, *keys: tuple):
        self.drafter, self.verifier, self.rows = drafter, verifier, rows  # rows: the most a round commits
        # (runner, key) of each static function a round replays: the draft's round, the verify, the verdict ...
        self.keys = ((drafter, keys[0]), (verifier, keys[1]), (drafter, keys[2]), *((verifier, k) for k in keys[3:]))
        self.statics: tuple | None = None
        self.host: tuple | None = None  # pinned mirrors of the accepted counts and committed tokens (CUDA)

    def headroom(self, ahead: int) -> int:
        """Cache rows beyond the token limit that rounds past it may commit."""
        return ahead * self.rows

    def _current(self) -> tuple:
        return tuple(runner.function(key) for runner, key in self.keys)

    def start(self, feed: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Start after the prefills: feed = (taps (n+1, nH), next tokens (n+1,)), the committed rows the draft has
        not seen yet (n + 1 <= rows), both runners committed and nothing pending."""
        d, v, rows = self.drafter, self.verifier, self.rows
        taps, ids = feed
        assert d.pending == 0 and v.pending == 0 and len(ids) <= rows
        if self.statics is None or any(a is not b for a, b in zip(self.statics, self._current())):
            # never made, or a reset that grew the caches made the runners' static functions anew
            self._make(taps)
            self.statics = self._current()
        n = len(ids) - 1
        self.extend["ids"][0, :n + 1].copy_(ids)
        self.extend["taps"][0, :n + 1].copy_(taps)
        self.extend["last"].fill_(n)
        for runner, buffers in ((d, self.extend), (v, self.verify)):  # positions from each one's length on
            torch.arange(runner.length, runner.length + buffers["pos"].shape[1], out=buffers["pos"][0])
            buffers["at"].fill_(runner.length)
        self.verdict["round"].zero_()
        self.rounds = 0

    def _buffers(self, taps: torch.Tensor) -> None:
        """The verify's static forward (its buffers) and the extend's and verdict's common buffers."""
        d, v, rows, dev = self.drafter, self.verifier, self.rows, self.verifier.device
        self.verify_st = v.forward_function(v.sizes[0], {"ids": torch.zeros(v.sizes[0], dtype=torch.long, device=dev)})
        self.verify = self.verify_st.inputs
        # the captures below write from each runner's length on: slots nothing committed is in
        self.verify["at"].fill_(v.length)
        extend = d.static_inputs(rows, {"ids": torch.zeros(rows, dtype=torch.long), "taps": taps[:1]}, scratch=0)
        extend["block"].copy_(d.causal_block(rows))
        extend["at"].fill_(d.length)
        extend.update(last=torch.zeros(1, dtype=torch.long, device=dev), verify_ids=self.verify["ids"])
        self.extend = extend
        s = v.book.max_len
        self.verdict = {"best": torch.zeros(v.sizes[0], dtype=torch.long, device=dev),
                        "verify_ids": self.verify["ids"], "verify_at": self.verify["at"], "draft_ids": extend["ids"],
                        "last": extend["last"], "committed": torch.zeros(s, rows, dtype=torch.long, device=dev),
                        "accepted": torch.zeros(s, dtype=torch.long, device=dev),
                        "round": torch.zeros(1, dtype=torch.long, device=dev)}
        if dev.type == "cuda":  # what a read-back copies into without waiting (a round commits >= 1 token)
            self.host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                              for t in (self.verdict["accepted"], self.verdict["committed"]))

    def _more_buffers(self, taps: torch.Tensor) -> None:
        """What a kind of round needs besides the common buffers (a greedy one: nothing)."""

    @staticmethod
    def _keep(feed: dict[str, torch.Tensor], row: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor]:
        """A round's verdict kept, as every kind keeps it: n accepted, row[:n + 1] committed in the round's row
        (the accepted tokens and the one after them), the next extend's inputs, the target's position moved on."""
        feed["committed"].index_copy_(0, feed["round"], row.view(1, -1))
        feed["accepted"].index_copy_(0, feed["round"], n)
        feed["round"].add_(1)
        feed["draft_ids"][0].copy_(row)  # the next extend
        feed["last"].copy_(n)
        feed["verify_at"].add_(n + 1)
        return (n,)

    def queue(self, count: int) -> tuple[int, int, torch.cuda.Event | None]:
        """`count` rounds queued without a read-back, and on CUDA their verdicts' copy to pinned memory:
        (first round, count, the copy's event) for `collect`."""
        for _ in range(count):
            self._round()
        first = self.rounds
        self.rounds += count
        if self.host is None:
            return first, count, None
        for host, dev in zip(self.host, (self.verdict["accepted"], self.verdict["committed"])):
            host[first:self.rounds].copy_(dev[first:self.rounds], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return first, count, done

    def collect(self, batch: tuple[int, int, torch.cuda.Event | None]) -> list[tuple[int, list[int]]]:
        """A queued batch read back, batches in the order queued: [(accepted draft tokens, committed
        tokens)] per round. The runners' lengths follow what was committed."""
        first, count, done = batch
        if done is not None:
            done.synchronize()  # its rounds only: rounds queued after it keep the GPU busy
        accepted, committed = self.host or (self.verdict["accepted"], self.verdict["committed"])
        out = [(n, tokens[:n + 1]) for n, tokens in zip(accepted[first:first + count].tolist(),
                                                          committed[first:first + count].tolist())]
        step = sum(n + 1 for n, _ in out)
        self.verifier.length += step
        self.drafter.length += step
        return out


class ChainRounds(_Rounds):
    """Greedy chain-of-K rounds: the draft's extend and chain, the verify, the verdict (three replays),
    and the target's argmax and the taps' copy (two launches)."""

    def __init__(self, drafter: DraftRunner, verifier: TargetRunner, K: int):
        super().__init__(drafter, verifier, K + 1, ("rounds", K + 1, K - 1), (K + 1, ("ids",)), ("verdict", K + 1))
        self.K = K

    def _make(self, taps: torch.Tensor) -> None:
        v, rows = self.verifier, self.rows
        self._buffers(taps)
        self.verify["block"].copy_(v.causal_block(rows))  # the chain
        self.verdict["verify_pos"] = self.verify["pos"]
        self._more_buffers(taps)
        (d, draft_key), _, (_, verdict_key) = self.keys[:3]
        self.draft_st = d.make_function(draft_key, self._draft_round, self.extend, self.K - 1)
        self.verdict_st = d.make_function(verdict_key, self._verdict, self.verdict)

    def _round(self) -> None:
        self.draft_st.run()
        logits, taps = self.verify_st.run()
        torch.argmax(logits[0], -1, out=self.verdict["best"])
        self.extend["taps"].copy_(taps)
        self.verdict_st.run()

    def _draft_round(self, feed: dict[str, torch.Tensor], steps: int) -> tuple[torch.Tensor]:
        """The extend of K+1 rows and the chain from row `last` (`_chain_tokens`), then [root] + draft tokens
        into the verify's ids and the draft's position moved past the kept rows."""
        tokens = self._chain_tokens(feed, steps)
        last = feed["last"]
        feed["verify_ids"][0].copy_(torch.cat([feed["ids"][0].index_select(0, last), tokens]))
        feed["pos"].add_(last + 1)
        feed["at"].add_(last + 1)
        return (tokens,)

    def _chain_tokens(self, feed: dict[str, torch.Tensor], steps: int) -> torch.Tensor:
        """The extend and the greedy chain (DraftRunner.extend_chain): (K,) target ids."""
        tokens, = self.drafter.extend_chain({k: t for k, t in feed.items() if k != "verify_ids"}, steps)
        return tokens

    @staticmethod
    def _verdict(feed: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        """The greedy chain rule (acceptance.chain_verdict) on the target's argmax; row i's argmax is the
        token at position pos[i] + 1."""
        n, row = chain_verdict(feed["verify_ids"][0, 1:], feed["best"])
        return ChainRounds._commit(feed, row[:feed["committed"].shape[1]], n)

    @staticmethod
    def _commit(feed: dict[str, torch.Tensor], row: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor]:
        """A chain round's verdict kept (`_keep`), the verify's positions moved on with the target's."""
        feed["verify_pos"].add_(n + 1)
        return _Rounds._keep(feed, row, n)


class SampledChainRounds(ChainRounds):
    """Sampled chain-of-K rounds, lossless on the device: the draft's extend and sampled chain
    (DraftRunner.extend_chain, sampled), the verify, the verdict (acceptance.chain_sampling_verdict), three
    replays; launched by the host, the round's uniform draws (K for the draft before it, K + 1 for the
    verdict after the verify: the order in which acceptance.py's host rules draw them, so the same seed gives the
    same tokens) and the verify's logits and taps copied in. `gen` is the generation's generator."""

    def __init__(self, drafter: DraftRunner, verifier: TargetRunner, K: int, sampling, draft_ids: torch.Tensor,
                 vocab: int):
        _Rounds.__init__(self, drafter, verifier, K + 1, ("sampled_rounds", K + 1, K - 1, sampling),
                         (K + 1, ("ids",)), ("sampled_verdict", K + 1, sampling))
        self.K, self.sampling, self.draft_ids, self.vocab = K, sampling, draft_ids, vocab
        self.gen: torch.Generator | None = None

    def _more_buffers(self, taps: torch.Tensor) -> None:
        """The round's uniform draws, the draft's distributions and the verify's logits."""
        dev = self.verifier.device
        probs = torch.zeros(self.K, self.draft_ids.numel(), device=dev)
        self.extend.update(u=torch.zeros(self.K, device=dev), probs=probs)
        self.verdict.update(u=torch.zeros(self.K + 1, device=dev), probs=probs,
                            logits=torch.zeros(self.rows, self.vocab, dtype=taps.dtype, device=dev))

    def _round(self) -> None:
        self.extend["u"].uniform_(generator=self.gen)  # torch.rand's draws, into the buffer
        self.draft_st.run()
        logits, taps = self.verify_st.run()
        self.verdict["u"].uniform_(generator=self.gen)
        self.verdict["logits"].copy_(logits[0])
        self.extend["taps"].copy_(taps)
        self.verdict_st.run()

    def _chain_tokens(self, feed: dict[str, torch.Tensor], steps: int) -> torch.Tensor:
        """The chain sampled, and the distributions its tokens were drawn from kept for the verdict."""
        tokens, probs = self.drafter.extend_chain({k: t for k, t in feed.items() if k not in ("verify_ids", "probs")},
                                                   steps, self.sampling)
        feed["probs"].copy_(probs)
        return tokens

    def _verdict(self, feed: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        """Speculative sampling's rule (acceptance.chain_sampling_verdict) on the target's distributions."""
        p = logits_to_probs(feed["logits"], self.sampling)  # (K + 1, V)
        q = p.new_zeros(self.K, p.shape[1]).index_copy(1, self.draft_ids, feed["probs"])
        n, row = chain_sampling_verdict(feed["verify_ids"][0, 1:], q, p, feed["u"])
        return self._commit(feed, row, n)


class TreeRounds(_Rounds):
    """Greedy EAGLE-2 tree rounds: the draft's extend and tree, the verify, the verdict, the K/V move of
    the accepted branch (four replays), and the target's argmax and the taps' gather (two launches)."""

    def __init__(self, drafter: DraftRunner, verifier: TargetRunner, depth: int, topk: int, budget: int):
        super().__init__(drafter, verifier, depth + 1, ("tree_rounds", depth, topk, budget), (budget + 1, ("ids",)),
                         ("tree_verdict", depth, budget), ("tree_move", budget + 1))
        self.depth, self.topk, self.budget = depth, topk, budget

    def _make(self, taps: torch.Tensor) -> None:
        v, dev = self.verifier, self.verifier.device
        self._buffers(taps)
        width = v.sizes[0]  # the verify's rows: what a move may have to cover
        self.extend.update(verify_pos=self.verify["pos"], verify_block=self.verify["block"],
                           verify_at=self.verify["at"], parents=torch.zeros(self.budget, dtype=torch.long, device=dev),
                           node_depth=torch.zeros(self.budget, dtype=torch.long, device=dev))
        self.move = {"src": torch.arange(width, device=dev) + v.length, "verify_at": self.verify["at"],
                     "last": self.extend["last"]}
        self.verdict.update(parents=self.extend["parents"], node_depth=self.extend["node_depth"],
                            rows=torch.zeros(self.rows, dtype=torch.long, device=dev), move_src=self.move["src"])
        self._more_buffers(taps)
        (d, draft_key), _, (_, verdict_key), (_, move_key) = self.keys
        self.draft_st = d.make_function(draft_key, self._draft_round, self.extend)
        self.verdict_st = d.make_function(verdict_key, self._verdict, self.verdict, self.depth)
        # eager inside its graph, as the runners' own move (runners.py): a few index copies, nothing to fuse
        self.move_st = v.make_function(move_key, self._move, self.move, width, compile=False)

    def _round(self) -> None:
        self.draft_st.run()
        logits, taps = self.verify_st.run()
        self._choose(logits[0])
        self.verdict_st.run()
        torch.index_select(taps[0], 0, self.verdict["rows"], out=self.extend["taps"][0])  # the kept rows' taps
        self.move_st.run()

    def _choose(self, logits: torch.Tensor) -> None:
        """What the verdict needs of the verify's logits, launched by the host: a greedy round its argmax."""
        torch.argmax(logits, -1, out=self.verdict["best"])

    def _draft_round(self, feed: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        """The extend of depth+1 rows, then the tree from row `last` (DraftRunner.extend_tree), written as the
        verify's ids, positions and mask; the draft's position moved past the kept rows."""
        tokens, parents, depth, _, block, rel = self.drafter.extend_tree(feed, self.depth, self.topk, self.budget)
        last = feed["last"]
        t, ts = tokens.shape[0] + 1, feed["verify_block"].shape[0]
        feed["verify_ids"][0, :t].copy_(torch.cat([feed["ids"][0].index_select(0, last), tokens]))
        feed["verify_pos"][0, :t].copy_(feed["verify_at"][:1] + rel)
        full = torch.eye(ts, feed["verify_block"].shape[1], dtype=torch.bool, device=block.device)
        full[:t, :t] = block  # the tree's mask; padding rows see only themselves
        feed["verify_block"].copy_(full)
        feed["parents"][:t - 1].copy_(parents)
        feed["node_depth"][:t - 1].copy_(depth)
        feed["pos"].add_(last + 1)
        feed["at"].add_(last + 1)
        return (tokens,)

    def _move(self, feed: dict[str, torch.Tensor], width: int) -> tuple[torch.Tensor]:
        """The kept rows' K/V down to the slots after the committed prefix, which the verdict has moved on
        by last + 1 (the move's destination is worked out here, from what the verdict left: compiled, a
        destination the verdict copied from the position it then moved on came out moved, torch 2.13)."""
        dst = feed["verify_at"][:1] - feed["last"] - 1
        return (self.verifier.move_rows({"src": feed["src"], "dst": dst}, width),)

    @staticmethod
    def _nodes(feed: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The round's tree as its verdict sees it: (tokens, parents, depth) of its `budget` node slots (past
        the pruned tree's nodes, stale slots of depth 0: never accepted)."""
        parents = feed["parents"]
        return feed["verify_ids"][0, 1:parents.shape[0] + 1], parents, feed["node_depth"]

    @staticmethod
    def _verdict(feed: dict[str, torch.Tensor], depth: int) -> tuple[torch.Tensor]:
        """The greedy tree rule (acceptance.tree_verdict) on the target's argmax."""
        return TreeRounds._commit(feed, *tree_verdict(*TreeRounds._nodes(feed), feed["best"], depth))

    @staticmethod
    def _commit(feed: dict[str, torch.Tensor], n: torch.Tensor, rows: torch.Tensor, committed: torch.Tensor
                ) -> tuple[torch.Tensor]:
        """A tree round's verdict kept (`_keep`), with the kept rows (for the taps' gather) and the move's sources.
        rows: the root's row and each level's (a level past the path its own index: the move copies that slot
        onto itself)."""
        most = rows.shape[0] - 1  # levels a path can reach
        v_len = feed["verify_at"][:1]  # read before _keep moves it on
        feed["rows"][:most + 1].copy_(rows)
        src = v_len + torch.arange(feed["move_src"].shape[0], device=rows.device)  # slots onto themselves ...
        src[:most + 1] = v_len + rows  # ... but the kept rows', which move down to v_len, v_len + 1, ...
        feed["move_src"].copy_(src)
        row = torch.nn.functional.pad(committed, (0, feed["committed"].shape[1] - most - 1))  # the first n + 1
        return _Rounds._keep(feed, row, n)


class SampledTreeRounds(TreeRounds):
    """Sampled EAGLE-2 tree rounds, lossless on the device: TreeRounds' round with the target's choice at each
    row drawn from its distribution instead of its argmax (acceptance.tree_sampling_verdict: draw x at a
    node, descend into the child that holds x, else emit x). Launched by the host: the round's uniform draws,
    one a row of the tree (the order in which acceptance.py's host rules draw them, so the same seed gives the same
    tokens), and the verify's logits copied in. `gen` is the generation's generator."""

    def __init__(self, drafter: DraftRunner, verifier: TargetRunner, depth: int, topk: int, budget: int, sampling,
                 vocab: int):
        _Rounds.__init__(self, drafter, verifier, depth + 1, ("sampled_tree_rounds", depth, topk, budget, sampling),
                         (budget + 1, ("ids",)), ("sampled_tree_verdict", depth, budget, sampling),
                         ("sampled_tree_move", budget + 1, sampling))
        self.depth, self.topk, self.budget, self.sampling, self.vocab = depth, topk, budget, sampling, vocab
        self.gen: torch.Generator | None = None

    def _more_buffers(self, taps: torch.Tensor) -> None:
        """The round's uniform draws (the root and every node of the pruned tree) and the verify's logits."""
        dev = self.verifier.device
        nodes = min(self.budget, grown_nodes(self.depth, self.topk))  # what tree.prune keeps
        self.verdict.update(u=torch.zeros(nodes + 1, device=dev),
                            logits=torch.zeros(self.verifier.sizes[0], self.vocab, dtype=taps.dtype, device=dev))

    def _choose(self, logits: torch.Tensor) -> None:
        self.verdict["u"].uniform_(generator=self.gen)  # torch.rand's draws, into the buffer
        self.verdict["logits"].copy_(logits)

    def _verdict(self, feed: dict[str, torch.Tensor], depth: int) -> tuple[torch.Tensor]:
        """The sampled tree rule (acceptance.tree_sampling_verdict): a draw from the target's distribution at
        each row of the tree, then the walk."""
        u = feed["u"]
        p = logits_to_probs(feed["logits"][:u.shape[0]], self.sampling)
        return self._commit(feed, *tree_sampling_verdict(*self._nodes(feed), p, u, depth))

