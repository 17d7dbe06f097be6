"""Grouped-query attention that reads each K/V head in place, for the decoder's target forwards.

transformers' sdpa path (5.17 and 5.24) gives a masked forward K/V for every query head: `repeat_kv`
copies each K/V head once per query head that shares it. Only 5.24's uncompiled single-row call packs
the query heads instead. The runners always pass a mask, and on a GPU they compile, so every layer of
every step copied its whole K/V buffer twice (SmolLM2-135M: 9 query heads on 3 K/V heads).

Here the G query heads of one K/V head become G*T query rows of that head, (B, Hq, T, D) -> (B, Hkv, G*T, D),
and the mask is repeated G times to match: the same attention over the same keys, without the copies.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .targets import text_config

NAME = "eaglewire_grouped_sdpa"


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, query (B, Hq, T, D) over key/value (B, Hkv, S, D) with Hkv dividing
    Hq, mask (B or 1, 1, T, S): bool (True = attend) or additive. Returns (B, Hq, T, Dv)."""
    b, hq, t, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    g = hq // hkv
    rows = query.reshape(b, hkv, g * t, d)
    mask = mask[:, :, None].expand(mask.shape[0], 1, g, t, s).reshape(mask.shape[0], 1, g * t, s)  # row g*T+t = row t
    out = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scale)
    return out.reshape(b, hq, t, value.shape[-1])


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                 **kwargs):
    """`grouped_attention` behind transformers' attention-function signature: returns ((B, T, Hq, Dv), None)
    as `sdpa_attention_forward` does, and hands it whatever it does not cover."""
    plain = (query.shape[1] == key.shape[1] or attention_mask is None or attention_mask.shape[1] != 1 or dropout
             or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None)
    if plain:  # nothing to gain, or what transformers' own path handles (per-head masks, biases, errors)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = attention_mask[:, :, :, :key.shape[2]]
    return grouped_attention(query, key, value, mask, scaling).transpose(1, 2).contiguous(), None


def use_grouped(model: torch.nn.Module) -> bool:
    """Switch `model` from sdpa to `grouped_sdpa` if its query heads share K/V heads; whether it did.
    This changes the model's config: pass the decoder's own copy (targets.shared_copy), not the caller's."""
    cfg = text_config(model.config)
    heads, kv_heads = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or not heads or not kv_heads or heads == kv_heads:
        return False
    AttentionInterface.register(NAME, grouped_sdpa)
    for c in {id(c): c for c in (model.config, cfg)}.values():
        c._attn_implementation = NAME
    return True
