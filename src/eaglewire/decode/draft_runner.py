"""The draft's side of decoding: `DraftRunner`, a slot runner (runners.py) over an `Eagle3Draft`, with its
drafting loops as traceable bodies of rounds.py's rounds (one compiled graph, one CUDA-graph replay each): an
extend and a greedy or sampled chain, an extend and an EAGLE-2 tree."""

from __future__ import annotations

import torch

from ..runtime.kv_slots import DraftSlotCache, Slots
from ..runtime.runners import SlotRunner
from ..runtime.sampling import logits_to_probs, sample_with
from .tree import grow, prune, tree_attention


class DraftRunner(SlotRunner):
    """An Eagle3Draft; `forward({"ids", "taps" | "hidden"}, ...)` returns (logits (T, Vd), hidden (T, H))."""

    def __init__(self, draft: torch.nn.Module, **kw):
        p = next(draft.parameters())
        super().__init__(p.device, **kw)
        self.draft = draft
        self.kv: DraftSlotCache | None = None

    def _new_cache(self) -> None:
        self.kv = DraftSlotCache(self.book, self.draft.config.num_layers)

    def _layers(self) -> list[Slots]:
        return self.kv.layers

    def move_rows(self, feed: dict[str, torch.Tensor], width: int) -> torch.Tensor:
        dst = super().move_rows(feed, width)
        pos = self.kv.positions if self.kv is not None else None
        if pos is not None:  # a windowed draft's slot positions move with their K/V
            pos.index_copy_(1, dst, pos.index_select(1, feed["src"]))
        return dst

    def _run(self, inputs, pos, mask):
        hidden = self.draft.fuse(inputs["taps"]) if "taps" in inputs else inputs["hidden"]
        return self.draft(inputs["ids"], hidden, pos, cache=self.kv, attn_mask=mask)

    def extend_chain(self, feed: dict[str, torch.Tensor], steps: int, sampling=None) -> tuple[torch.Tensor, ...]:
        """Traceable (the body of rounds.py's chain rounds): the
        extend's forward over `static_inputs` buffers plus last (1,), then the chain from its row `last`: greedy
        (sampling None), or sampled (the first token drawn from the draft's distribution there with
        feed["u"][0], `steps` more with u[1:]). Returns ((1 + steps,) target ids,) and, sampled, the
        (1 + steps, Vd) distributions they were drawn from."""
        last = feed["last"]  # (1,): the extend's last real row
        logits, hidden = self.masked_forward({k: v for k, v in feed.items() if k not in ("last", "u")},
                                              self.book.max_len)
        row = logits[0].index_select(0, last)
        if sampling is None:
            root, q = self.draft.draft_to_target(row.argmax(-1)), None  # (1,)
        else:
            q = logits_to_probs(row, sampling)  # (1, Vd)
            root = self.draft.draft_to_target(sample_with(q[0], feed["u"][:1]))
        if not steps:
            return (root,) if q is None else (root, q)
        chain = {"root": root, "hidden": hidden[0].index_select(0, last),
                 "pos": feed["pos"][0].index_select(0, last) + 1, "at": feed["at"][1:] + last + 1}
        if q is None:
            tokens, = self._greedy_chain(chain, steps)
            return (torch.cat([root, tokens]),)
        tokens, probs = self._sample_chain({**chain, "u": feed["u"][1:]}, steps, sampling)
        return torch.cat([root, tokens]), torch.cat([q, probs])

    def _sample_chain(self, feed: dict[str, torch.Tensor], steps: int, sampling) -> tuple[torch.Tensor, torch.Tensor]:
        def pick(logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            q = logits_to_probs(logits, sampling)
            return self.draft.draft_to_target(sample_with(q, feed["u"][i:i + 1])), q

        tokens, probs = self._chain(feed, steps, pick)
        return tokens, torch.stack(probs)

    def extend_tree(self, feed: dict[str, torch.Tensor], depth: int, topk: int, budget: int
                    ) -> tuple[torch.Tensor, ...]:
        """Traceable (the body of rounds.py's tree rounds): the extend's forward over `static_inputs` buffers
        (ids, taps, pos, block, at) plus last (1,), then `_tree`'s EAGLE-2 tree from its row `last`, the
        tree's rows written after the extend's. Returns `_tree`'s tensors: the pruned tree's tokens, parents,
        depth and scores, its verify block (n+1, n+1) and depth offsets (n+1,)."""
        logits, hidden = self.masked_forward({k: feed[k] for k in ("ids", "taps", "pos", "block", "at")},
                                             self.book.max_len)
        last = feed["last"]
        root = {"root": logits[0].index_select(0, last)[0], "hidden": hidden[0].index_select(0, last),
                "pos": feed["pos"][0].index_select(0, last), "at": feed["at"][1:] + last + 1}
        return self._tree(root, depth, topk, budget)

    def _tree(self, feed: dict[str, torch.Tensor], depth: int, topk: int, budget: int) -> tuple[torch.Tensor, ...]:
        s, dev, start = self.book.max_len, self.device, feed["at"]
        self.book.view_len = s

        def forward(tokens, h_in, block, rel):  # the round's rows from `start` on, the committed prefix before
            f = tokens.shape[0]
            self.book.slots = start + block.shape[1] - f + torch.arange(f, device=dev)
            logits, h = self.draft(tokens[None], h_in[None], (feed["pos"] + rel)[None], cache=self.kv,
                                   attn_mask=self._mask(block, start, s))
            return logits[0], h[0]

        tree = grow(feed["root"], feed["hidden"][0], depth, topk, self.draft.draft_to_target, forward)
        tree = prune(tree, budget, depth)
        block, rel = tree_attention(tree, 0, depth)
        return tree.tokens, tree.parents, tree.depth, tree.scores, block[0, 0], rel

    def _greedy_chain(self, feed: dict[str, torch.Tensor], steps: int) -> tuple[torch.Tensor]:
        tokens, _ = self._chain(feed, steps, lambda logits, i: (self.draft.draft_to_target(logits.argmax()).view(1),
                                                                None))
        return (tokens,)

    def _chain(self, feed: dict[str, torch.Tensor], steps: int, pick) -> tuple[torch.Tensor, list]:
        """`steps` draft steps from feed's root token and hidden state, each at the next position and slot,
        seeing every slot before its own, fed the token pick(logits (Vd,), step) -> (token (1,), extra)
        chooses and its own hidden state: ((steps,) tokens, [extra of each step])."""
        s = self.book.max_len
        cols = torch.arange(s, device=self.device)
        ids, hidden, out, extra = feed["root"], feed["hidden"], [], []
        self.book.view_len = s
        for i in range(steps):
            slot = feed["at"] + i
            self.book.slots = slot
            mask = (cols <= slot)[None, None, None]  # (1, 1, 1, s): everything written before, and itself
            logits, h = self.draft(ids[None], hidden[None], (feed["pos"] + i)[None], cache=self.kv, attn_mask=mask)
            ids, more = pick(logits[0, -1], i)
            hidden = h[0]
            out.append(ids)
            extra.append(more)
        return torch.cat(out), extra
