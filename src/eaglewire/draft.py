"""The EAGLE-3 draft model: `Eagle3Draft`, its `KVCache` and the TTT mask (its `DraftConfig`: draft_config.py).

The core every project shares (SafeAILab/EAGLE eagle/model/cnets.py, SGLang and vLLM
models/llama_eagle3.py, SpecForge specforge/modeling/draft/llama3_eagle.py, speculators
src/speculators/models/eagle3/core.py):

    h0     = fc(cat(taps))                                   # fuse(): (B, T, n*Ht) -> (B, T, H)
    layer 0: x = cat(input_layernorm(embed(ids)), hidden_norm(h))   # (B, T, 2H) into q/k/v
             h = residual + attn(x);  h = h + mlp(post_attention_layernorm(h))
    layers 1..L-1: standard Llama decoder layers over H
    logits = lm_head(norm(h))                                # over the draft vocabulary

Token alignment (docs/ARCHITECTURE.md): the hidden at position t (taps of x_0..x_t, or the draft's
own previous output) goes with the embedding of x_{t+1}; the logits predict x_{t+2}.

Plain torch (F.scaled_dot_product_attention), no transformers internals: the module stays small
and behaves the same across transformers versions. Weight names are eaglewire's own
(`layers.N.*`); the interop exporters rename them (SGLang wants `midlayer.*`).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from .draft_config import ACTIVATIONS, DraftConfig
from .errors import EaglewireError, UsageError


def rope_inv_freq(config: DraftConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (head_dim/2,), float32, on the CPU (transformers' formulas)."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    rs = config.rope_scaling
    if rs is None:
        return inv
    if rs["rope_type"] == "linear":  # positions / factor == frequencies / factor
        return inv / rs["factor"]
    # llama3: long wavelengths scaled by 1/factor, short ones kept, a smooth blend in between.
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    medium = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def causal_mask(q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """(q_len, kv_len) bool, True = attend: the q_len new tokens are the last of kv_len keys."""
    offset = kv_len - q_len
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(diagonal=offset)


def ttt_mask(T: int, k: int, device=None) -> torch.Tensor:
    """(1, 1, T, (k+1)T) mask of training-time-test step k over a cache holding steps 0..k.

    Keys are laid out step by step: the step-0 keys of all T positions (causal), then for each step
    1..k only the key at the query's own position (the diagonal), as in SpecForge
    llama3_eagle.py's cache_hidden attention.
    """
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal_mask(T, T, device)] + [eye] * k, dim=1)[None, None]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32, then back to the input dtype before the weight (as Llama does).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class _MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftAttention(nn.Module):
    """A draft layer's attention: `qkv`, `attend`, `output`. The decoder may run a copy of the draft whose
    attention modules attend otherwise (speedups.py, attention.GroupedDraftAttention): nothing here switches."""

    def __init__(self, c: DraftConfig, in_features: int, layer: int):
        super().__init__()
        self.nh, self.nkv, self.hd, self.layer = c.num_attention_heads, c.num_key_value_heads, c.head_dim, layer
        self.q_proj = nn.Linear(in_features, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_features, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_features, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache, mask):
        return self.output(self.attend(*self.qkv(x, cos, sin, cache), mask))

    def qkv(self, x, cos, sin, cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, in) -> q (B, nh, T, hd) and k, v (B, nkv, S, hd): rotated, the cache's keys and values first."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.append(self.layer, k, v)  # (B, nkv, S, hd): cached keys, then the new ones
        return q, k, v

    def attend(self, q, k, v, mask) -> torch.Tensor:
        """(B, nh, T, hd): sdpa under `mask` (None: causal over the last T of S positions)."""
        T = q.shape[2]
        if self.nh != self.nkv:  # grouped-query attention
            k, v = (t.repeat_interleave(self.nh // self.nkv, dim=1) for t in (k, v))
        S = k.shape[2]
        if mask is None and S == T:
            return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        mask = causal_mask(T, S, q.device) if mask is None else mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """(B, nh, T, hd) -> (B, T, H) through o_proj."""
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class _FirstLayer(nn.Module):
    """layers.0: attention over cat(input_layernorm(embeds), hidden_norm(h)), 2H wide."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c, 2 * c.hidden_size, 0)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, embeds, h, cos, sin, cache, mask):
        normed = self.hidden_norm(h)
        residual = normed if self.norm_before_residual else h
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # (B, T, 2H)
        h = residual + self.self_attn(x, cos, sin, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Layer(nn.Module):
    """layers.N for N >= 1: a standard Llama decoder layer over H."""

    def __init__(self, c: DraftConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c, c.hidden_size, layer)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, h, cos, sin, cache, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft. `fuse` once per target forward, then `forward` once per draft step.

    embed_tokens is a frozen copy of the target's embedding (`load_target_embedding`) when
    hidden_size == target_hidden_size; otherwise the target's cannot be used and it is trained.
    Buffers `d2t` (offsets: target_id = draft_id + d2t[draft_id]) and `t2d` (bool over the target
    vocabulary) default to the first draft_vocab_size target ids; set them with `set_vocab`.
    """

    def __init__(self, config: DraftConfig):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(c.hidden_size != c.target_hidden_size)
        if c.norm_before_fc:
            self.fc_input_norm = RMSNorm(c.fc_in_features, c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(c.num_taps))
        self.fc = nn.Linear(c.fc_in_features, c.hidden_size, bias=False)
        self.layers = nn.ModuleList([_FirstLayer(c)] + [_Layer(c, i) for i in range(1, c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # Not a buffer: stays fp32 whatever dtype the module is cast to.
        self._inv_freq = rope_inv_freq(c)

    # --- inputs -------------------------------------------------------------------------------

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """(B, T, num_taps * target_hidden_size) target taps, low to high -> (B, T, H)."""
        c = self.config
        if taps.shape[-1] != c.fc_in_features:
            raise EaglewireError(f"fc input width {taps.shape[-1]} != {c.num_taps} taps x {c.target_hidden_size} "
                                 f"(= {c.fc_in_features}): the taps fed to the draft do not match the tap "
                                 "contract it was built for")
        if c.norm_before_fc:
            taps = self.fc_input_norm(taps)
        if c.fc_norm:
            taps = torch.cat([n(t) for n, t in zip(self.fc_norm, taps.chunk(c.num_taps, dim=-1))], dim=-1)
        return self.fc(taps)

    def new_cache(self, batch_size: int, max_len: int | None = None, *, dtype=None, device=None) -> "KVCache":
        """A cache for this draft: static (max_len, inference) or growing (None, autograd/TTT)."""
        p = self.fc.weight
        return KVCache(self.config.num_layers, batch_size, self.config.num_key_value_heads, self.config.head_dim,
                       max_len, dtype=dtype or p.dtype, device=device or p.device)

    def load_target_embedding(self, weight: torch.Tensor) -> None:
        """Copy the target's token embedding (vocab, H) in and keep it frozen."""
        c = self.config
        if c.hidden_size != c.target_hidden_size:
            raise UsageError(f"the draft's hidden_size {c.hidden_size} != the target's {c.target_hidden_size}: "
                             "the target's embedding cannot be shared, the draft trains its own")
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise UsageError(f"target embedding has shape {tuple(weight.shape)}, the draft expects "
                             f"{tuple(self.embed_tokens.weight.shape)} (vocab_size x hidden_size)")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)
        self.embed_tokens.weight.requires_grad_(False)

    def load_target_head(self, weight: torch.Tensor) -> None:
        """Start lm_head from the target's (vocab, H) head: the rows of the draft vocabulary (set_vocab first)."""
        c = self.config
        if c.hidden_size != c.target_hidden_size:
            raise UsageError(f"the draft's hidden_size {c.hidden_size} != the target's {c.target_hidden_size}: "
                             "the target's lm_head cannot start the draft's (use head=random)")
        if weight.shape[1] != c.hidden_size or weight.shape[0] < c.draft_vocab_size:
            raise UsageError(f"target lm_head has shape {tuple(weight.shape)}, the draft needs "
                             f"(>= {c.draft_vocab_size}, {c.hidden_size})")
        rows = self.draft_to_target(torch.arange(c.draft_vocab_size, device=self.d2t.device))
        with torch.no_grad():
            self.lm_head.weight.copy_(weight.to(self.lm_head.weight)[rows.to(weight.device)])

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        from .vocab import validate_vocab

        validate_vocab(d2t, t2d, self.config.vocab_size)
        if d2t.numel() != self.config.draft_vocab_size:
            raise UsageError(f"d2t has {d2t.numel()} entries, the draft's draft_vocab_size is "
                             f"{self.config.draft_vocab_size}")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def deepened(self, num_layers: int) -> "Eagle3Draft":
        """A copy with decoder layers added after its own, each starting as the identity (its o_proj and down_proj
        zero, so the residual passes through). The deeper draft predicts exactly as this one until training moves
        the new layers, instead of starting from scratch (block expansion, as LLaMA Pro grows a model)."""
        c, p = self.config, self.fc.weight
        if num_layers <= c.num_layers:
            raise UsageError(f"a draft of {c.num_layers} layer(s) deepens to more, not to {num_layers}")
        out = Eagle3Draft(dataclasses.replace(c, num_layers=num_layers)).to(device=p.device, dtype=p.dtype)
        missing, unexpected = out.load_state_dict(self.state_dict(), strict=False)
        assert not unexpected and all(int(k.split(".")[1]) >= c.num_layers for k in missing), (missing, unexpected)
        with torch.no_grad():
            for layer in out.layers[c.num_layers:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        out.embed_tokens.weight.requires_grad_(self.embed_tokens.weight.requires_grad)
        return out.train(self.training)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        # a 0-d index would be read back to the host (a sync that breaks CUDA-graph capture): index 1-d
        return draft_ids + self.d2t[draft_ids.reshape(-1)].view_as(draft_ids)

    # --- the step -----------------------------------------------------------------------------

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        if self._inv_freq.device != position_ids.device:
            self._inv_freq = self._inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * self._inv_freq  # (B, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # (B, 1, T, hd)

    def _check_inputs(self, input_ids, hidden, position_ids, cache, attn_mask):
        if input_ids.dim() != 2:
            raise EaglewireError(f"draft forward: input_ids must be (B, T), got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        H = self.config.hidden_size
        if hidden.shape != (B, T, H):
            hint = " (taps? call fuse(taps) first)" if hidden.shape[-1] == self.config.fc_in_features else ""
            raise EaglewireError(f"draft forward: hidden has shape {tuple(hidden.shape)}, expected "
                                 f"({B}, {T}, {H}){hint}")
        if position_ids.shape != (B, T):
            raise EaglewireError(f"draft forward: position_ids has shape {tuple(position_ids.shape)}, expected ({B}, {T})")
        if attn_mask is not None:
            S = T + (cache.length if cache is not None else 0)
            if (attn_mask.dtype != torch.bool or attn_mask.dim() != 4 or attn_mask.shape[0] not in (1, B)
                    or attn_mask.shape[1] != 1 or tuple(attn_mask.shape[2:]) != (T, S)):
                raise EaglewireError(f"draft forward: attn_mask must be bool ({B} or 1, 1, {T}, {S}) "
                                     f"(queries x cached+new keys), got {attn_mask.dtype} {tuple(attn_mask.shape)}")

    def _windowed(self, position_ids, cache, attn_mask) -> torch.Tensor:
        """attn_mask (None: causal) AND the sliding window over POSITIONS, not cache slots: a key at position k is
        seen from position p only if p - k < W. The cache records each key's position (`key_positions`), so
        training (TTT steps), tree rows and moved slots all keep their true distance."""
        T = position_ids.shape[1]
        keys = position_ids if cache is None else cache.key_positions(position_ids)  # (B, S)
        near = (position_ids[:, None, :, None] - keys[:, None, None, :]) < self.config.sliding_window
        base = causal_mask(T, keys.shape[1], position_ids.device)[None, None] if attn_mask is None else attn_mask
        return base & near

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                cache: "KVCache | None" = None, attn_mask: torch.Tensor | None = None):
        """One draft step -> (logits (B, T, draft_vocab), hidden_out (B, T, H)).

        input_ids (B, T) target ids; hidden (B, T, H) = fuse(taps) or a previous hidden_out;
        attn_mask (B or 1, 1, T, S) bool, True = attend, over S = cached + new keys; None = causal.
        With a cache, the new K/V are appended first, then attention runs over all of them.
        Every query row of attn_mask must allow at least one key.
        """
        self._check_inputs(input_ids, hidden, position_ids, cache, attn_mask)
        if self.config.sliding_window is not None:
            attn_mask = self._windowed(position_ids, cache, attn_mask)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # (B, T, H)
        cos, sin = self._rope(position_ids, hidden.dtype)
        h = self.layers[0](embeds, hidden, cos, sin, cache, attn_mask)
        for layer in self.layers[1:]:
            h = layer(h, cos, sin, cache, attn_mask)
        normed = self.norm(h)
        return self.lm_head(normed), (normed if self.config.norm_output else h)


class KVCache:
    """Per-layer keys/values of the draft, (B, kv_heads, len, head_dim) each.

    Static (max_len given): preallocated buffers written in place, so shapes stay fixed (CUDA
    graphs) and nothing is reallocated; for inference only, since an in-place write would
    invalidate tensors autograd saved. Growing (max_len None): each append concatenates; use it
    for training (TTT), where gradients flow through every step's keys.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 max_len: int | None = None, *, dtype=torch.float32, device="cpu"):
        self.num_layers, self.batch_size, self.max_len = num_layers, batch_size, max_len
        shape = (batch_size, num_kv_heads, max_len or 0, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._lens = [0] * num_layers
        self.positions: torch.Tensor | None = None  # (B, len): each key's position, kept for a windowed draft

    @property
    def static(self) -> bool:
        return self.max_len is not None

    @property
    def length(self) -> int:
        """Cached positions (all layers agree between forwards)."""
        return self._lens[0]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Add (B, kv_heads, T, hd) new keys/values to `layer`; return the views up to the new length."""
        n, T = self._lens[layer], k.shape[2]
        if self.static:
            if n + T > self.max_len:
                raise EaglewireError(f"draft KV cache full: {n} + {T} tokens > max_len {self.max_len}; "
                                     "create the cache with a larger max_len")
            if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
                raise EaglewireError("a static draft KV cache cannot record gradients (it is written in place): "
                                     "use a growing cache (max_len=None) for training, or torch.no_grad()")
            self.k[layer][:, :, n:n + T].copy_(k)
            self.v[layer][:, :, n:n + T].copy_(v)
        else:
            self.k[layer] = torch.cat([self.k[layer][:, :, :n].to(k.dtype), k], dim=2)
            self.v[layer] = torch.cat([self.v[layer][:, :, :n].to(v.dtype), v], dim=2)
        self._lens[layer] = n + T
        return self.k[layer][:, :, :n + T], self.v[layer][:, :, :n + T]

    def key_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Record the positions (B, T) of the keys a forward is about to append; -> (B, S) every key's position.
        Called once per forward, before the layers append."""
        n, T = self.length, position_ids.shape[1]
        if self.positions is None:
            self.positions = position_ids.new_zeros(self.batch_size, self.max_len or 0)
        if self.static:
            self.positions[:, n:n + T] = position_ids
        else:
            self.positions = torch.cat([self.positions[:, :n], position_ids.expand(self.batch_size, T)], dim=1)
        return self.positions[:, :n + T]

    def crop(self, n: int) -> None:
        """Forget every position from n on (rejected draft tokens)."""
        if not 0 <= n <= self.length:
            raise EaglewireError(f"draft KV cache crop({n}): the cache holds {self.length} positions")
        self._lens = [n] * self.num_layers

    def keep(self, indices, start: int) -> None:
        """Keep positions [0, start) and then only `indices` (positions >= start), in that order.

        indices: (n,) shared by the batch or (B, n) per row. Used when a tree branch is accepted:
        its positions move to start, start+1, ...; the rest of the tree is dropped.
        """
        length = self.length
        device = self.k[0].device
        idx = torch.as_tensor(indices, dtype=torch.long, device=device)
        if not 0 <= start <= length or idx.dim() not in (1, 2) or (idx.dim() == 2 and idx.shape[0] != self.batch_size):
            raise EaglewireError(f"draft KV cache keep(start={start}, indices {tuple(idx.shape)}): need "
                                 f"0 <= start <= {length} and indices (n,) or ({self.batch_size}, n)")
        if idx.numel() and (int(idx.min()) < start or int(idx.max()) >= length):
            raise EaglewireError(f"draft KV cache keep: indices must lie in [{start}, {length}), got "
                                 f"{idx.min().item()}..{idx.max().item()}")
        n = idx.shape[-1]
        for store in (self.k, self.v):
            for i, buf in enumerate(store):
                if idx.dim() == 1:
                    sel = buf.index_select(2, idx)  # a copy: safe to write back over its source
                else:
                    sel = torch.gather(buf, 2, idx[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[3]))
                if self.static:
                    buf[:, :, start:start + n].copy_(sel)
                else:
                    store[i] = torch.cat([buf[:, :, :start], sel], dim=2)
        if self.positions is not None:
            p = self.positions
            sel = p.index_select(1, idx) if idx.dim() == 1 else torch.gather(p, 1, idx)
            if self.static:
                p[:, start:start + n] = sel
            else:
                self.positions = torch.cat([p[:, :start], sel], dim=1)
        self._lens = [start + n] * self.num_layers

    def reset(self) -> None:
        self._lens = [0] * self.num_layers
