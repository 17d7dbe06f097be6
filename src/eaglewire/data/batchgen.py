"""Batched generation for regeneration (`GenConfig(engine="slots")`): left-padded rows over a slot
KV cache, the decode step captured in one CUDA graph per (rows, width), no compilation.

transformers' `generate` with a static cache compiles its decode step (about a minute per new
shape). Under an attention mask, its SDPA path also copies K/V to every query head (`repeat_kv`): at
2048 rows that copy is most of a step's memory traffic. Here the step attends with the query heads
grouped onto their K/V head (attention.py), so K/V are read once. The graph replays eager kernels:
at thousands of rows each kernel is large, so fusing them buys little and the capture takes a
second.

Rows are left-padded to a common width W; row r's prompt starts at column pad[r]. Step t writes
every row's K/V at slot W + t and attends to columns pad[r] .. W + t; positions count from each
row's first real token, so a padded row computes what it would alone.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..runtime import attention
from ..runtime.compiled import capture_graph
from ..runtime.kv_slots import Book, SlotLayer
from ..runtime.runners import additive_mask
from ..targets import cache_kwarg, shared_copy


def supports(model) -> bool:
    """Decoder-only models whose attention goes through transformers' attention interface with
    grouped K/V heads of the query's head size (Llama, Mistral, Qwen2/3 ...)."""
    cfg = model.config
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    return bool(heads and kv and heads % kv == 0 and cfg.model_type in SUPPORTED)


SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}

# Tokens one prefill forward takes. A batch's K/V fit the memory its rows were sized for, but one forward over all
# of them also makes each layer's activations for every token: 2,000 rows x 512 columns of Qwen2.5-1.5B asked for
# 21 GiB more in its MLP on an 80 GB H100. Slices this size keep that near a gigabyte; at thousands of rows they are
# still large kernels.
PREFILL_TOKENS = 1 << 16


class BatchGenerator:
    """Generates up to `max_new` tokens for `rows` left-padded prompts of width `width`."""

    def __init__(self, model, rows: int, width: int, max_new: int, cuda_graphs: bool):
        self.model = shared_copy(model)  # the caller's model keeps its attention
        attention.use_grouped(self.model)  # False (eager attention, say): transformers attends, K/V repeated
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.rows, self.width, self.max_new = rows, width, max_new
        self.cache_kw = cache_kwarg(model)
        self.book = Book(max_len=width + max_new)
        self.cache = Cache(layers=[SlotLayer(self.book) for _ in range(model.config.num_hidden_layers)])
        self.cols = torch.arange(self.book.max_len, device=self.device)
        self.replay = None
        self.cuda_graphs = cuda_graphs
        self.inputs = {"tok": torch.zeros(rows, 1, dtype=torch.long, device=self.device),
                       "at": torch.zeros(1, dtype=torch.long, device=self.device),
                       "pad": torch.zeros(rows, dtype=torch.long, device=self.device)}

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """ids (rows, width) left-padded, pad (rows,) pad lengths -> last-position logits (rows, V).
        Column slices of at most PREFILL_TOKENS tokens, each attending to the columns before it."""
        w = self.width
        cols = torch.arange(w, device=self.device)
        pos = (cols[None] - pad[:, None]).clamp(min=0)
        step = max(1, PREFILL_TOKENS // self.rows)
        for c0 in range(0, w, step):
            q, seen = cols[c0:c0 + step], cols[:c0 + step]
            allowed = (seen[None, None, :] <= q[None, :, None]) & (seen >= pad[:, None])[:, None, :]  # (B, Q, seen)
            allowed |= seen[None, None, :] == q[None, :, None]  # a pad row sees itself (no empty softmax)
            self.book.slots, self.book.view_len = q, len(seen)
            out = self.model(input_ids=ids[:, c0:c0 + step], attention_mask=additive_mask(allowed, self.dtype)[:, None],
                             position_ids=pos[:, c0:c0 + step], use_cache=True, logits_to_keep=1,
                             **{self.cache_kw: self.cache})
        self.inputs["pad"].copy_(pad)
        return out.logits[:, -1].float()

    def _step(self) -> torch.Tensor:
        at, pad = self.inputs["at"], self.inputs["pad"]
        self.book.slots, self.book.view_len = at, self.book.max_len
        allowed = (self.cols[None] >= pad[:, None]) & (self.cols[None] <= at)  # (B, L)
        out = self.model(input_ids=self.inputs["tok"], attention_mask=additive_mask(allowed, self.dtype)[:, None, None],
                         position_ids=(at - pad)[:, None], use_cache=True, **{self.cache_kw: self.cache})
        return out.logits[:, -1].float()

    @torch.no_grad()
    def step(self, tok: torch.Tensor, t: int) -> torch.Tensor:
        """The tokens (rows,) at new position t (0-based) -> logits (rows, V) for position t + 1."""
        self.inputs["tok"][:, 0].copy_(tok)
        self.inputs["at"].fill_(self.width + t)
        if not self.cuda_graphs:
            return self._step()
        if self.replay is None:  # the warm-up steps write the slot this step rewrites
            self.replay, self.logits = capture_graph(self._step, self.device)
        self.replay()
        return self.logits


CHECK_EVERY = 16  # steps between reads of "has every row ended?" (each read waits for the GPU)


@torch.no_grad()
def generate(gen: BatchGenerator, ids: torch.Tensor, pad: torch.Tensor, stops: list[int], choose) -> torch.Tensor:
    """New tokens (rows, steps) for left-padded ids (rows, width); choose(logits (rows, V)) -> (rows,)
    picks each next token. Ends when every row has emitted a stop token or after max_new."""
    logits = gen.prefill(ids, pad)
    stop = torch.tensor(stops, device=gen.device)
    out = torch.empty(gen.rows, gen.max_new, dtype=torch.long, device=gen.device)
    ended = torch.zeros(gen.rows, dtype=torch.bool, device=gen.device)
    for t in range(gen.max_new):
        tok = choose(logits)
        out[:, t] = tok
        ended |= torch.isin(tok, stop)
        if t + 1 == gen.max_new or ((t + 1) % CHECK_EVERY == 0 and bool(ended.all())):
            break
        logits = gen.step(tok, t)
    return out[:, :t + 1]
