"""Both sides of decoding as slot runners: static KV buffers written at slots, masked forwards, CUDA graphs.

gpt-fast style. Every layer's K/V live in one preallocated buffer. A forward writes the K/V of its
T new tokens at the slots after the committed ones (and after earlier uncommitted "pending" rows of
the same round) and attends through an explicit mask over the buffer, so

- a rejected token needs no rollback: `commit` just does not count its slot, the next forward
  overwrites it;
- an accepted tree branch is kept by copying its slots down (`commit(rows)`);
- with static shapes (`static=True`, implied by `cuda_graphs=True`) a block is padded to a fixed
  size and attends over the whole buffer, so ONE captured CUDA graph per size replays every step.
  Padding rows attend to themselves only; their outputs are dropped.

`TargetRunner` drives an unmodified HF model: its cache is a `transformers.Cache` of `SlotLayer`s
and the 4D float mask is passed through as-is by HF's mask code (transformers 5.17 and 5.24, eager
and sdpa attention); taps come from `capture.TapHooks` around the forward. `DraftRunner` drives an
`Eagle3Draft` through the cache protocol its attention uses (`append(layer, k, v)`, `length`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .capture import TapHooks, locate
from .taps import TapContract
from .targets import cache_kwarg, text_config


@dataclass
class _Book:
    """What a runner tells its cache before each forward."""

    max_len: int = 0
    slots: torch.Tensor | None = None  # (Ts,) where this forward writes its K/V
    view_len: int = 0  # attention sees slots 0..view_len-1


class _Slots:
    """K/V buffers (B, heads, max_len, D) per layer, allocated on first write, written at book.slots."""

    def __init__(self, book: _Book):
        self.book = book
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys = k.new_zeros(*k.shape[:2], self.book.max_len, k.shape[3])
            self.values = v.new_zeros(*v.shape[:2], self.book.max_len, v.shape[3])
        self.keys.index_copy_(2, self.book.slots, k)
        self.values.index_copy_(2, self.book.slots, v)
        n = self.book.view_len
        return self.keys[:, :, :n], self.values[:, :, :n]

    def move(self, src: torch.Tensor, dst: int) -> None:
        """Copy slots `src` to dst, dst+1, ... (index_select copies first, so overlap is safe)."""
        for buf in (self.keys, self.values):
            if buf is not None:
                buf[:, :, dst:dst + len(src)] = buf.index_select(2, src)


class SlotLayer(CacheLayerMixin):
    """A transformers cache layer over `_Slots` (HF attention calls `update`, mask code the sizes)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, book: _Book):
        super().__init__()
        self.book, self.slots = book, _Slots(book)

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers are made by _Slots
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        self.keys, self.values = self.slots.write(key_states, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.book.view_len, 0

    def get_query_offset(self) -> int:
        return 0

    def get_seq_length(self) -> int:
        return self.book.view_len

    def get_max_length(self) -> int:
        return self.book.max_len


class _DraftCache:
    """The cache protocol `Eagle3Draft`'s attention uses (`append`, `length`), over slot buffers."""

    def __init__(self, book: _Book, num_layers: int):
        self.book = book
        self.layers = [_Slots(book) for _ in range(num_layers)]

    @property
    def length(self) -> int:  # keys before the new ones in the view the draft attends over
        return self.book.view_len - len(self.book.slots)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return self.layers[layer].write(k, v)


@dataclass
class _Graph:
    replay: object  # torch.cuda.CUDAGraph.replay
    inputs: dict[str, torch.Tensor]  # static buffers (1, Ts, ...), plus pos, mask, slots
    outputs: tuple[torch.Tensor, ...]  # static outputs (1, Ts, ...)


class SlotRunner:
    """Slot bookkeeping, masks, static-shape padding and CUDA graphs, shared by both sides.

    runner.reset(capacity)
    out = runner.forward(inputs, positions, block)  # writes T pending rows; length unchanged
    runner.commit(keep)                            # keep pending rows, length += len(keep)
    """

    mask_dtype: torch.dtype = torch.bool  # the TargetRunner turns it into an additive float mask

    def __init__(self, device: torch.device, *, static: bool, cuda_graphs: bool, sizes: tuple[int, ...],
                 max_pending: int = 0, max_position: int | None = None):
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, the model is on {device}")
        self.device, self.cuda_graphs, self.static = device, cuda_graphs, static or cuda_graphs
        self.sizes = tuple(sorted(set(sizes)))  # padded block sizes of static forwards
        self.headroom = max_pending + max(self.sizes, default=0) + 1
        self.max_position = max_position
        self.book = _Book()
        self.length = 0  # committed tokens: slots 0..length-1
        self.pending = 0  # rows written this round, not committed: slots length..length+pending-1
        self._graphs: dict[tuple, _Graph] = {}
        self._pool = None

    def _new_cache(self) -> None:
        raise NotImplementedError

    def _run(self, inputs: dict[str, torch.Tensor], pos, mask, view_len: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _layers(self) -> list[_Slots]:
        raise NotImplementedError

    def reset(self, capacity: int) -> None:
        """Forget the sequence; make room for `capacity` committed tokens plus one round's rows."""
        need = capacity + self.headroom
        if self.book.max_len < need:
            self.book.max_len = -(-need // 256) * 256  # rounded: nearby lengths keep buffers and graphs
            self._new_cache()
            self._graphs.clear()
        self.length = self.pending = 0

    def commit(self, keep: torch.Tensor | list[int] | int) -> None:
        """Keep pending rows: an int n keeps rows 0..n-1, a list/tensor those rows in that order."""
        if not isinstance(keep, int):
            rows = torch.as_tensor(keep, dtype=torch.long).cpu()
            assert rows.numel() == 0 or int(rows.max()) < self.pending, "commit of a row never written"
            if torch.equal(rows, torch.arange(len(rows))):
                keep = len(rows)
            else:  # a tree branch: copy its slots down
                src = (rows + self.length).to(self.device)
                for layer in self._layers():
                    layer.move(src, self.length)
                keep = len(rows)
        assert keep <= self.pending
        self.length += keep
        self.pending = 0

    @torch.no_grad()
    def forward(self, inputs: dict[str, torch.Tensor], positions: torch.Tensor, block: torch.Tensor,
                exact: bool = False) -> tuple[torch.Tensor, ...]:
        """T new rows: inputs name -> (T, ...), positions (T,), block (T, pending+T) bool = which of this
        round's rows (earlier pending ones, then the new ones) each new row sees; the committed prefix is
        always seen. Returns the outputs, each (T, ...). exact: no padding and no graph (prefills)."""
        t = positions.shape[0]
        assert block.shape == (t, self.pending + t), (tuple(block.shape), t, self.pending)
        if self.max_position is not None:  # learned position tables end there; such rows are never used
            positions = positions.clamp(max=self.max_position - 1)
        start = self.length + self.pending
        size = next((s for s in self.sizes if s >= t), None) if self.static and not exact else None
        ts, view = (size, self.book.max_len) if size else (t, start + t)  # static: padded, whole buffer
        assert start + ts <= self.book.max_len, "reset() with a larger capacity"
        idx = torch.arange(ts, device=self.device).clamp(max=t - 1)  # padding repeats the last row
        feed = {k: v.to(self.device)[idx][None] for k, v in inputs.items()}
        feed["pos"] = positions.to(self.device)[idx][None]
        feed["mask"] = self._mask(block, ts, view)
        feed["slots"] = torch.arange(start, start + ts, device=self.device)
        if self.cuda_graphs and size:
            g = self._graph(ts, feed)
            for k, v in feed.items():
                g.inputs[k].copy_(v)
            g.replay()
            out = g.outputs
        else:
            out = self._call(feed, view)
        self.pending += t
        # Copies: a graph's outputs are overwritten by its next replay.
        return tuple(o[0, :t].clone() for o in out)

    def _call(self, feed: dict[str, torch.Tensor], view_len: int) -> tuple[torch.Tensor, ...]:
        self.book.slots, self.book.view_len = feed["slots"], view_len
        inputs = {k: v for k, v in feed.items() if k not in ("pos", "mask", "slots")}
        return self._run(inputs, feed["pos"], feed["mask"], view_len)

    def _mask(self, block: torch.Tensor, ts: int, view_len: int) -> torch.Tensor:
        """(1, 1, Ts, view_len): the committed prefix, then `block` over this round's rows."""
        t, start = block.shape[0], self.length + self.pending
        allowed = torch.zeros(ts, view_len, dtype=torch.bool, device=self.device)
        allowed[:, :self.length] = True
        allowed[:t, self.length:start + t] = block.to(self.device)
        pad = torch.arange(t, ts, device=self.device)
        allowed[pad, start + pad] = True  # padding rows see only themselves
        if self.mask_dtype == torch.bool:
            return allowed[None, None]
        zero = torch.zeros((), dtype=self.mask_dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.mask_dtype).min)[None, None]

    def _graph(self, ts: int, example: dict[str, torch.Tensor]) -> _Graph:
        """Capture (once per size and input kind) the forward of Ts rows over the whole buffer."""
        key = (ts, tuple(sorted(example)))
        if key not in self._graphs:
            s = self.book.max_len
            static = {k: v.clone() for k, v in example.items()}
            static["slots"].copy_(torch.arange(s - ts, s))  # warm-up writes land in scratch slots
            replay, out = self._capture(lambda: self._call(static, s))
            self._graphs[key] = _Graph(replay, static, out)
        return self._graphs[key]

    def _capture(self, fn) -> tuple[object, tuple[torch.Tensor, ...]]:
        """Warm fn up on a side stream, capture it in a CUDA graph: (replay, its static outputs)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # lazy allocations and library autotuning happen outside the capture
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        return graph.replay, out


class TargetRunner(SlotRunner):
    """An HF causal LM; `forward({"ids": (T,)}, ...)` returns (logits (T, V) fp32, taps (T, n*H)),
    or (logits,) alone when the contract is None (plain decoding captures no taps)."""

    def __init__(self, model: torch.nn.Module, contract: TapContract | None, **kw):
        p = next(model.parameters())
        cfg = text_config(model.config)
        super().__init__(p.device, max_position=getattr(cfg, "max_position_embeddings", None), **kw)
        self.model, self.contract, self.mask_dtype = model, contract, p.dtype
        self.stack = locate(model)
        self.cache_kw = cache_kwarg(model)
        self.cache: Cache | None = None
        self.keep_last = 0  # > 0: only the last rows' logits (prefill), where the model supports it
        self._can_keep = "logits_to_keep" in inspect.signature(model.forward).parameters

    def _new_cache(self) -> None:
        self.cache = Cache(layers=[SlotLayer(self.book) for _ in range(self.stack.num_layers)])

    def _layers(self) -> list[_Slots]:
        return [layer.slots for layer in self.cache.layers]

    def _run(self, inputs, pos, mask, view_len):
        kw = {"input_ids": inputs["ids"], "attention_mask": mask, "position_ids": pos, "use_cache": True,
              self.cache_kw: self.cache, **({"logits_to_keep": self.keep_last} if self._can_keep else {})}
        if self.contract is None:
            return (self.model(**kw).logits.float(),)
        with TapHooks(self.stack, self.contract) as hooks:
            out = self.model(**kw)
        return out.logits.float(), hooks.taps

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The prompt (P,) into the empty cache: last-position logits (V,) and taps (P, n*H) if any."""
        assert self.length == 0 and self.pending == 0, "reset() before prefill"
        p = ids.shape[0]
        self.keep_last = 1  # the prompt's other logits are never used: skip their lm_head
        try:
            out = self.forward({"ids": ids}, torch.arange(p), torch.ones(p, p, dtype=torch.bool).tril(), exact=True)
        finally:
            self.keep_last = 0
        self.commit(p)
        return (out[0][-1],) + out[1:]


class DraftRunner(SlotRunner):
    """An Eagle3Draft; `forward({"ids", "taps" | "hidden"}, ...)` returns (logits (T, Vd), hidden (T, H))."""

    def __init__(self, draft: torch.nn.Module, **kw):
        p = next(draft.parameters())
        super().__init__(p.device, **kw)
        self.draft = draft
        self.kv: _DraftCache | None = None

    def _new_cache(self) -> None:
        self.kv = _DraftCache(self.book, self.draft.config.num_layers)

    def _layers(self) -> list[_Slots]:
        return self.kv.layers

    def _run(self, inputs, pos, mask, view_len):
        hidden = self.draft.fuse(inputs["taps"]) if "taps" in inputs else inputs["hidden"]
        return self.draft(inputs["ids"], hidden, pos, cache=self.kv, attn_mask=mask)
