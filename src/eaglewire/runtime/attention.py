"""Grouped-query attention that reads each K/V head in place (batchgen.py; the decoder's models on request).

transformers' sdpa path (5.17 and 5.24) gives a masked forward K/V for every query head: `repeat_kv`
copies each K/V head once per query head that shares it. Only 5.24's uncompiled single-row call packs
the query heads instead. The runners always pass a mask, and on a GPU they compile, so with sdpa every
layer of every step copies its whole K/V buffer twice (SmolLM2-135M: 9 query heads on 3 K/V heads).

Here the G query heads of one K/V head become G*T query rows of that head, (B, Hq, T, D) -> (B, Hkv, G*T, D).
The mask is repeated G times to match: the same attention over the same keys, without the copies.
Fewer, taller heads are not always faster for the attention kernel itself. On a GPU grouped sdpa wins the
verify rounds of many rows but can lose the one-row step: 3 heads of 3 rows give a fused kernel too little to
split. A one-row step is therefore spelt as two matmuls and a softmax instead (`matmul_attention`). That wins
the plain step too, so the decoder's target on CUDA attends this way by default. Verifies of up to
MATMUL_MAX_ROWS rows may be spelt so too. `python benchmarks/decode_steps.py --random-draft --attention
sdpa,grouped,matmul` times each way (measured: benchmarks/results/).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..targets import text_config

NAME = "eaglewire_grouped_sdpa"
ROWS_MASK = "eaglewire_rows_mask"  # a forward's kwarg: its mask repeated for the grouped rows once, not per layer
# Query rows a head may have for its attention to be spelt as matmuls rather than sdpa. As shipped, a decode step
# only. On a GPU an 8-row verify's cuDNN attention is a few microseconds a layer, plus a memset, a layout copy
# and its mask's kernel. `decode_steps.py --attention default,matmul` times multi-row verifies spelt as matmuls.
MATMUL_MAX_ROWS = 1
# Batch x K/V heads from which even a one-row step goes to sdpa. Matmuls win at batch 1, where a fused kernel has
# too few query rows to split; regeneration steps thousands of rows at once, and its matmuls read each K head in
# fp32 (a copy twice the size of the bf16 cache, every layer). None: matmuls at every batch, as measured so far;
# `benchmarks/regen_step.py --attention matmul,sdpa` times regeneration's step both ways.
SDPA_MIN_HEADS: int | None = None


def rows_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, 1, T, S) -> (B, 1, G*T, S), row g*T + t = row t: the mask of the grouped query rows (a copy for
    T > 1, which a compiled forward would otherwise make in every layer)."""
    b, _, t, s = mask.shape
    return mask[:, :, None].expand(b, 1, groups, t, s).reshape(b, 1, groups * t, s)


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, query (B, Hq, T, D) over key/value (B, Hkv, S, D) with Hkv dividing
    Hq. The mask is (B or 1, 1, T, S), or already `rows_mask`'s (.., G*T, S): bool (True = attend) or
    additive.
    Returns (B, Hq, T, Dv)."""
    b, hq, t, d = query.shape
    g = hq // key.shape[1]
    rows = query.reshape(b, key.shape[1], g * t, d)
    if t == 1:  # every grouped row is the one row: its mask is the first, broadcast
        mask = mask[:, :, :1]
    elif mask.shape[2] != g * t:
        mask = rows_mask(mask, g)
    if t <= MATMUL_MAX_ROWS and (SDPA_MIN_HEADS is None or b * key.shape[1] < SDPA_MIN_HEADS):
        out = matmul_attention(rows, key, value, mask, d ** -0.5 if scale is None else scale)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scale)
    return out.reshape(b, hq, t, value.shape[-1])


def matmul_attention(rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """A few query rows' attention: rows (B, Hkv, R, D), mask (B or 1, 1, R or 1, S). Spelt as two matmuls and
    a softmax, which a compiled step fuses into a few small kernels: the fused attention kernels split their
    work by query rows, and a decode step has G of them per K/V head. Scores stay fp32 as in those kernels
    (bf16 scores would round a weight by up to ~5%)."""
    scores = torch.matmul(rows.float(), key.float().transpose(-1, -2)) * scale  # (B, Hkv, G, S)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(scores.softmax(-1).to(value.dtype), value)


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                 **kwargs):
    """`grouped_attention` behind transformers' attention-function signature: returns ((B, T, Hq, Dv), None)
    as `sdpa_attention_forward` does, and hands it whatever it does not cover. The forward's ROWS_MASK
    kwarg, where given, is the mask already grouped."""
    grouped = kwargs.pop(ROWS_MASK, None)
    plain = (query.shape[1] == key.shape[1] or attention_mask is None or attention_mask.shape[1] != 1 or dropout
             or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None)
    if plain:  # nothing to gain, or what transformers' own path handles (per-head masks, biases, errors)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = grouped if grouped is not None else attention_mask[:, :, :, :key.shape[2]]
    return grouped_attention(query, key, value, mask, scaling).transpose(1, 2).contiguous(), None


def use_grouped(model: torch.nn.Module) -> bool:
    """Switch `model` from sdpa to `grouped_sdpa` if its query heads share K/V heads; whether it did.
    This changes the model's config: pass the decoder's own copy (targets.shared_copy), not the caller's."""
    cfg = text_config(model.config)
    heads, kv_heads = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or not heads or not kv_heads or heads == kv_heads:
        return False
    AttentionInterface.register(NAME, grouped_sdpa)
    model.set_attn_implementation(NAME)
    return True


def groups(model: torch.nn.Module) -> int:
    """Query heads per K/V head of a model switched by `use_grouped`; 1 for any other model."""
    cfg = text_config(model.config)
    if getattr(cfg, "_attn_implementation", None) != NAME:
        return 1
    return cfg.num_attention_heads // cfg.num_key_value_heads


class GroupedDraftAttention(torch.nn.Module):
    """A draft attention module (draft.DraftAttention) whose query heads share K/V heads, attending through
    `grouped_attention` under a mask (each K/V head read in place) instead of repeating each K/V head per query
    head: what the decoder's target does through `grouped_sdpa`. Wrapped around the decoder's copy of the draft
    from outside (speedups.py); without a mask (a training forward) it is the module's own attention."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x, cos, sin, cache, mask):
        q, k, v = self.inner.qkv(x, cos, sin, cache)
        out = self.inner.attend(q, k, v, mask) if mask is None else grouped_attention(q, k, v, mask)
        return self.inner.output(out)
