"""The draft's side of decoding: `DraftRunner`, a slot runner (runners.py) over an `Eagle3Draft`, with its
drafting loops as static functions (one compiled graph, one CUDA-graph replay each): an extend and a
greedy chain, a sampled chain, an EAGLE-2 tree."""

from __future__ import annotations

import torch

from ..runtime.kv_slots import DraftSlotCache, Slots
from ..runtime.runners import SlotRunner, StaticFunction
from ..runtime.sampling import logits_to_probs, sample_with
from .tree import DraftTree, grow, prune, tree_attention


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

    def _one_function(self, key: tuple, fn, *args, root: torch.Tensor, hidden: torch.Tensor, position: int,
                      start: int, scratch: int, **more: torch.Tensor) -> StaticFunction:
        """fn(inputs, *args) over fixed buffers {root, hidden (1, H), pos (1,), at (1,) = first slot
        written, and `more`}, compiled if the runner compiles, made once per key; the buffers filled for
        this call. The capture's writes land in the last `scratch` slots."""
        given = {"root": root, "hidden": hidden, **more}
        if key not in self._static:
            s, dev = self.book.max_len, self.device
            inputs = {k: torch.zeros_like(t, device=dev) for k, t in given.items()}
            inputs.update(pos=torch.zeros(1, dtype=torch.long, device=dev), at=torch.tensor([s - scratch], device=dev))
            self.make_function(key, fn, inputs, *args)
        st = self._static[key]
        for k, t in given.items():
            st.inputs[k].copy_(t)
        st.inputs["pos"].fill_(position)
        st.inputs["at"].fill_(start)
        return st

    @torch.no_grad()
    def extend_greedy_chain(self, inputs: dict[str, torch.Tensor], steps: int) -> torch.Tensor | None:
        """An extend over the T rows of `inputs` (forward(inputs, length): causal, then committed) and
        `steps` greedy draft steps from its last row, as ONE static function: one replay, none of the
        host work between two. Returns (1 + steps,) target ids (the draft's argmax after the extend,
        then greedy_chain's), the replay's own buffer (valid until the next call); the chain's rows
        stay pending. None where T fits no static size (a long prompt's first extend): then forward
        and greedy_chain do it in two."""
        t = len(next(iter(inputs.values())))
        ts = next((s for s in self.sizes if s >= t), None)
        if not self.static or ts is None or self.pending:
            return None
        assert self.length + ts + steps <= self.book.max_len, "reset() with a larger capacity"
        key = ("extend_chain", ts, tuple(sorted(inputs)), steps)
        if key not in self._static:
            buffers = self.static_inputs(ts, inputs, scratch=ts + steps)
            buffers["last"] = torch.zeros(1, dtype=torch.long, device=self.device)
            self.make_function(key, self.extend_chain, buffers, steps)
        st = self._static[key]
        self._fill(st, inputs, self.length, None, t, ts)
        st.inputs["last"].fill_(t - 1)
        tokens, = st.run()
        self.length, self.pending = self.length + t, steps  # the extend's rows kept, the chain's pending
        return tokens

    def extend_chain(self, feed: dict[str, torch.Tensor], steps: int, sampling=None) -> tuple[torch.Tensor, ...]:
        """Traceable (the body of extend_greedy_chain's static function and of rounds.py's chain rounds): the
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

    @torch.no_grad()
    def greedy_chain(self, token: torch.Tensor, hidden: torch.Tensor, position: int, steps: int) -> torch.Tensor:
        """`steps` greedy draft steps as ONE static function (one compiled graph, one CUDA-graph
        replay): step i feeds the previous step's argmax token (target id) and hidden state at
        `position + i`, seeing every slot before its own. token (1,) target id and hidden (1, H) on
        the device -> (steps,) target ids, the replay's own output buffer (valid until the next call:
        the decoder concatenates them at once). Writes `steps` pending rows, like `steps` forwards."""
        tokens, = self._chain_replay(("greedy_chain", steps), self._greedy_chain, (steps,), token, hidden, position,
                                     steps)
        return tokens

    @torch.no_grad()
    def sample_chain(self, token: torch.Tensor, hidden: torch.Tensor, position: int, steps: int, u: torch.Tensor,
                     sampling) -> tuple[torch.Tensor, torch.Tensor]:
        """`steps` sampled draft steps as ONE static function, as `greedy_chain` but each token drawn from
        the draft's distribution (sampling.logits_to_probs under `sampling`) with the uniform draw u[i]
        (sampling.sample_with). Returns ((steps,) target ids, (steps, Vd) the distributions they were
        drawn from), the replay's own buffers (valid until the next call)."""
        return self._chain_replay(("sample_chain", steps, sampling), self._sample_chain, (steps, sampling), token,
                                  hidden, position, steps, u=u)

    def _chain_replay(self, key: tuple, fn, args: tuple, token: torch.Tensor, hidden: torch.Tensor, position: int,
                      steps: int, **more: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A chain's `steps` draft steps after the pending rows, as the static function `key`, replayed."""
        start = self.length + self.pending
        assert self.static and self._kv_made(), "an extend forward first (static runner)"
        assert self.pending + steps <= self.max_pending + max(self.sizes) and start + steps <= self.book.max_len
        st = self._one_function(key, fn, *args, root=token, hidden=hidden, position=position, start=start,
                                scratch=steps, **more)
        out = st.run()
        self.pending += steps
        return out

    def _sample_chain(self, feed: dict[str, torch.Tensor], steps: int, sampling) -> tuple[torch.Tensor, torch.Tensor]:
        def pick(logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            q = logits_to_probs(logits, sampling)
            return self.draft.draft_to_target(sample_with(q, feed["u"][i:i + 1])), q

        tokens, probs = self._chain(feed, steps, pick)
        return tokens, torch.stack(probs)

    @torch.no_grad()
    def tree(self, logits: torch.Tensor, hidden: torch.Tensor, position: int, depth: int, topk: int,
             budget: int) -> tuple[DraftTree, torch.Tensor, torch.Tensor]:
        """An EAGLE-2 tree drafted, pruned and masked as ONE static function (one compiled graph, one
        CUDA-graph replay), from the root's draft logits (Vd,) and hidden state (1, H) at `position`.
        Returns (the pruned tree, its verify block (n+1, n+1), depth offsets (n+1,)): what
        tree.expand / frontier_attention / prune / tree_attention give step by step, in the replay's
        own output buffers (valid until the next call). Writes (depth - 1) * topk pending rows, like
        depth - 1 frontier forwards."""
        start, rows = self.length + self.pending, (depth - 1) * topk
        assert self.static and self._kv_made(), "an extend forward first (static runner)"
        assert self.pending == 0 and rows <= self.max_pending and start + rows <= self.book.max_len
        st = self._one_function(("tree", depth, topk, budget), self._tree, depth, topk, budget, root=logits,
                                hidden=hidden, position=position, start=start, scratch=max(rows, 1))
        out = st.run()
        self.pending += rows
        return DraftTree(*out[:4]), out[4], out[5]

    def extend_tree(self, feed: dict[str, torch.Tensor], depth: int, topk: int, budget: int
                    ) -> tuple[torch.Tensor, ...]:
        """Traceable (the body of rounds.py's tree rounds): the extend's forward over `static_inputs` buffers
        (ids, taps, pos, block, at) plus last (1,), then `tree`'s EAGLE-2 tree from its row `last`, the
        tree's rows written after the extend's. Returns `tree`'s tensors: the pruned tree's tokens, parents,
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
