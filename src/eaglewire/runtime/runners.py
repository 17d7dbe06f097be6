"""Models as slot runners: static KV buffers written at slots, masked forwards, CUDA graphs. The decoder runs
the target and the draft this way, batched regeneration (data/batchgen.py) borrows the mask and the storage.

gpt-fast style. Every layer's K/V live in one preallocated buffer (kv_slots.py). A forward writes
the K/V of its T new tokens at the slots after the committed ones (and after earlier uncommitted
"pending" rows of the same round) and attends through an explicit mask over the buffer, so

- a rejected token needs no rollback: `commit` just does not count its slot, the next forward
  overwrites it;
- an accepted tree branch is kept by copying its slots down (`commit(rows)`);
- with static shapes (`static=True`, implied by `cuda_graphs=True` and `compile=True`) a block is
  padded to a fixed size and attends over the whole buffer, so ONE compiled function and ONE captured
  CUDA graph per size serve every step. Padding rows attend to themselves only; their outputs are
  dropped. The write slots and the mask are computed on the device from a few small inputs (the
  padded block, positions, the committed length), inside the compiled function and the graph.
- `compile=True` runs that forward through `torch.compile` (dynamic=False; the CUDA graph is our own,
  so inductor's fused kernels are what the graph replays).

`TargetRunner` drives an unmodified HF model. Its cache is a `transformers.Cache` of `SlotLayer`s,
and HF's mask code passes the 4D float mask through as-is (transformers 5.17 and 5.24, eager and
sdpa attention). Taps come from `capture.TapHooks` around the forward. `DraftRunner` drives an
`Eagle3Draft` through the cache protocol its attention uses (`append(layer, k, v)`, `length`);
it lives in decode/draft_runner.py (its drafting loops are the decoder's).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from ..capture import TapHooks, locate
from ..taps import TapContract
from ..targets import cache_kwarg, text_config
from . import attention
from .compiled import CompileError, capture_graph, compile_options
from .kv_slots import Arena, Book, SlotLayer, Slots

CACHE_ROUNDING = 256  # cache lengths are rounded up to this: nearby lengths keep buffers and graphs


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = may attend) as the additive float mask HF attention adds to its scores."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


@dataclass
class StaticFunction:
    """One padded size's input buffers and how to run over them: a CUDA graph's replay, or a call."""

    inputs: dict[str, torch.Tensor]  # (1, Ts, ...) per model input, pos (1, Ts), block (Ts, W), at (2,)
    run: object = None  # () -> outputs (1, Ts, ...); a graph replays into the same output tensors
    outputs: tuple[torch.Tensor, ...] | None = None  # a CUDA graph's static outputs
    block: torch.Tensor | None = None  # the cached causal block inputs["block"] holds, if one does


class SlotRunner:
    """Slot bookkeeping, masks, static-shape padding, torch.compile and CUDA graphs, shared by both sides.

    runner.reset(capacity)
    out = runner.forward(inputs, positions, block)  # writes T pending rows; length unchanged
    runner.commit(keep)                            # keep pending rows, length += len(keep)

    A static forward copies its inputs into the buffers of its padded size Ts: the model inputs,
    positions, `block` padded to (Ts, max_pending + Ts) and `at` = [committed length, first slot
    written]. Everything else (write slots, the (1, 1, Ts, max_len) mask) is computed from those by
    `masked_forward`, so it lives inside the compiled function and the captured graph, and a step
    costs a few copies, one replay and the output copies.
    """

    mask_dtype: torch.dtype = torch.bool  # the TargetRunner turns it into an additive float mask
    autotune: bool = False  # compiled on CUDA: inductor times its matmul kernels against cuBLAS per shape

    def __init__(self, device: torch.device, *, static: bool, cuda_graphs: bool, sizes: tuple[int, ...],
                 max_pending: int = 0, max_position: int | None = None, compile: bool = False):
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, the model is on {device}")
        # compile needs fixed shapes too: one compiled graph per padded size
        self.device, self.cuda_graphs, self.static = device, cuda_graphs, static or cuda_graphs or compile
        self.sizes = tuple(sorted(set(sizes)))  # padded block sizes of static forwards
        self.max_pending = max_pending
        self.headroom = max_pending + max(self.sizes, default=0) + 1
        self.max_position = max_position
        self.book = Book()
        self.length = 0  # committed tokens: slots 0..length-1
        self.pending = 0  # rows written this round, not committed: slots length..length+pending-1
        self._static: dict[tuple, StaticFunction] = {}
        self._causal: dict[tuple, torch.Tensor] = {}
        self._pool = None
        # dynamic=False: one graph per padded size; shapes never vary within one
        self.compiles = compile
        self._compiled = self._compile(self.autotune) if compile else None
        # Only single-row forwards are autotuned. On a GPU inductor's choice makes a 1-row step faster and can make
        # an 8-row verify slower (`decode_steps.py --autotune target,all` times both). A prefill chunk runs once a
        # prompt, not worth a minute of compilation. A wrapper of its own: dynamo recompiles for it.
        tunes = compile and self.autotune and device.type == "cuda"
        self._compiled_untuned = self._compile(False) if tunes else self._compiled

    def _compile(self, autotune: bool):
        return torch.compile(self._traced(), dynamic=False, options=compile_options(self.device, autotune))

    def _traced(self):
        """The function torch.compile traces: masked_forward."""
        return self.masked_forward

    def _new_cache(self) -> None:
        raise NotImplementedError

    def _run(self, inputs: dict[str, torch.Tensor], pos, mask) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _layers(self) -> list[Slots]:
        raise NotImplementedError

    def _kv_made(self) -> bool:
        """Whether the K/V buffers exist: the first forward after a new cache makes them, eagerly (a
        compiled function must find them in place, else its guard `keys is None` recompiles)."""
        return all(layer.keys is not None for layer in self._layers())

    def reset(self, capacity: int) -> None:
        """Forget the sequence; make room for `capacity` committed tokens plus one round's rows."""
        need = capacity + self.headroom
        if self.book.max_len < need:
            self.book.max_len = -(-need // CACHE_ROUNDING) * CACHE_ROUNDING
            self._new_cache()
            self._static.clear()
        self.length = self.pending = 0

    def commit(self, keep: torch.Tensor | list[int] | int) -> None:
        """Keep pending rows: an int n keeps rows 0..n-1, a list/tensor those rows in that order."""
        if not isinstance(keep, int):  # host-side lists: no tensor ops before the move
            rows = keep.tolist() if isinstance(keep, torch.Tensor) else [int(r) for r in keep]
            assert not rows or max(rows) < self.pending, "commit of a row never written"
            if rows != list(range(len(rows))):  # a tree branch: copy its slots down
                self._move([r + self.length for r in rows])
            keep = len(rows)
        assert keep <= self.pending
        self.length += keep
        self.pending = 0

    def _move(self, src: list[int]) -> None:
        """Copy slots `src` to length, length+1, ... in every layer's K and V. `src` is padded to a fixed
        width with slots that copy onto themselves (every read happens before any write), so with CUDA
        graphs it is one replay."""
        width = self.max_pending + max(self.sizes)  # the most rows one round writes
        padded = torch.tensor(src + list(range(self.length + len(src), self.length + width)))
        if not self.cuda_graphs:
            self.move_rows({"src": padded.to(self.device), "dst": torch.tensor([self.length], device=self.device)},
                           width)
            return
        if "move" not in self._static:
            s = self.book.max_len
            inputs = {"src": torch.arange(s - width, s, device=self.device),  # capture: scratch slots onto
                      "dst": torch.tensor([s - width], device=self.device)}  # themselves
            self._static["move"] = self._make_static(inputs, lambda: (self.move_rows(inputs, width),))
        st = self._static["move"]
        st.inputs["src"].copy_(padded)
        st.inputs["dst"].fill_(self.length)
        st.run()

    def move_rows(self, feed: dict[str, torch.Tensor], width: int) -> torch.Tensor:
        """Traceable: every layer's K/V at slots feed["src"] (width,) copied to feed["dst"] (1,) and the width - 1
        slots after it (every read before any write); returns those destination slots."""
        dst = feed["dst"] + torch.arange(width, device=self.device)
        layers = self._layers()
        arena = layers[0].arena if layers else None
        bufs = [(b, 3) for b in (arena.keys, arena.values)] if arena and arena.keys is not None else []
        bufs += [(b, 2) for layer in layers if layer.own and layer.keys is not None for b in (layer.keys, layer.values)]
        for buf, slot_dim in bufs:
            buf.index_copy_(slot_dim, dst, buf.index_select(slot_dim, feed["src"]))
        return dst

    @torch.no_grad()
    def forward(self, inputs: dict[str, torch.Tensor], positions: torch.Tensor | int, block: torch.Tensor | None = None,
                exact: bool = False, pad_to: int | None = None, copy: bool = True) -> tuple[torch.Tensor, ...]:
        """T new rows: inputs name -> (T, ...), and positions (T,) or an int p for p .. p+T-1 (written in
        place, one launch on CUDA instead of making and copying them). The bool block (T, pending+T) says
        which of this round's rows (earlier pending ones, then the new ones) each new row sees. None: all
        earlier pending rows and the new rows up to itself (causal). The committed prefix is always seen.
        Returns the outputs, each (T, ...). exact: no padding, no graph, not compiled. pad_to: this
        static size instead of the smallest of `sizes` that fits (a prefill chunk). With copy=False
        the outputs may be views of a graph's output buffers, valid until this size's next forward.
        That saves a launch per output for a caller that is done with them by then.
        Inputs already on the device avoid a host-to-device copy (a stream sync on CUDA)."""
        t = positions.shape[0] if isinstance(positions, torch.Tensor) else len(next(iter(inputs.values())))
        start = self.length + self.pending
        size = None if exact or not self.static else pad_to or next((s for s in self.sizes if s >= t), None)
        ts = size or t
        assert start + ts <= self.book.max_len, "reset() with a larger capacity"
        if block is not None:
            assert block.shape == (t, self.pending + t), (tuple(block.shape), t, self.pending)
        if size is None:  # exact: this call's shapes, over slots 0..start+t-1
            feed = {k: v.to(self.device)[None] for k, v in inputs.items()}
            pos = positions.to(self.device) if isinstance(positions, torch.Tensor) else \
                torch.arange(positions, positions + t, device=self.device)
            feed.update(pos=pos[None], block=self._block(block, t, t, self.pending),
                        at=torch.tensor([self.length, start], device=self.device))
            out = self._call(feed, start + t, compiled=False)
        else:
            assert self.pending <= self.max_pending, ("more pending rows than max_pending", self.pending)
            st = self.forward_function(ts, inputs)
            self._fill(st, inputs, positions, block, t, ts)
            out = st.run()
        self.pending += t
        # Copies: a graph's outputs are overwritten by its next replay.
        return tuple(o[0, :t].clone() if copy else o[0, :t] for o in out)

    def _fill(self, st: StaticFunction, inputs: dict[str, torch.Tensor], positions: torch.Tensor | int,
              block: torch.Tensor | None, t: int, ts: int) -> None:
        """A static forward's buffers filled for this call's T rows (padding rows keep stale, valid
        values: they see only themselves)."""
        start = self.length + self.pending
        for k, v in inputs.items():
            st.inputs[k][0, :t].copy_(v)
        if isinstance(positions, torch.Tensor):
            st.inputs["pos"][0, :t].copy_(positions)
        else:
            torch.arange(positions, positions + t, out=st.inputs["pos"][0, :t])
        blk = self._block(block, t, ts, self.max_pending)
        if blk is not st.block:  # a cached causal block is copied in once while it stays the same
            st.inputs["block"].copy_(blk)
            st.block = blk if block is None else None
        if start == self.length:  # fill_: no host-to-device copy, no sync
            st.inputs["at"].fill_(start)
        else:
            st.inputs["at"][0].fill_(self.length)
            st.inputs["at"][1].fill_(start)

    def _block(self, block: torch.Tensor | None, t: int, ts: int, width: int) -> torch.Tensor:
        """(Ts, width + Ts) bool over the slots from `length` on: block in the top left, padding rows see
        only their own slot. A causal block (None) of a static size is made once on the device."""
        p = self.pending
        key = (t, ts, width, p)
        if block is None and key in self._causal:
            return self._causal[key]
        full = torch.zeros(ts, width + ts, dtype=torch.bool, device=self.device)
        if block is None:
            full[:t, :p] = True
            full[:t, p:p + t] = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
        else:
            full[:t, :p + t] = block.to(self.device)
        if ts > t:
            pad = torch.arange(t, ts, device=self.device)
            full[pad, p + pad] = True
        if block is None and ts in self.sizes:
            self._causal[key] = full
        return full

    def masked_forward(self, feed: dict[str, torch.Tensor], view_len: int) -> tuple[torch.Tensor, ...]:
        """The forward over slots 0..view_len-1, its write slots and mask made from feed["at"] and
        feed["block"] (the function compiled and captured: no host values but view_len and shapes)."""
        ts = feed["pos"].shape[1]
        length, start = feed["at"][0], feed["at"][1]
        self.book.slots = start + torch.arange(ts, device=self.device)
        self.book.view_len = view_len
        pos = feed["pos"]
        if self.max_position is not None:  # learned position tables end there; such rows are never used
            pos = pos.clamp(max=self.max_position - 1)
        inputs = {k: v for k, v in feed.items() if k not in ("pos", "block", "at")}
        return self._run(inputs, pos, self._mask(feed["block"], length, view_len))

    def _mask(self, block: torch.Tensor, length: torch.Tensor, view_len: int) -> torch.Tensor:
        """(1, 1, Ts, view_len): slots < length (committed), then `block` over the next block.shape[1] slots."""
        cols = torch.arange(view_len, device=self.device)
        rel = cols - length
        w = block.shape[1]
        allowed = (cols < length) | (block[:, rel.clamp(0, w - 1)] & (rel >= 0) & (rel < w))
        if self.mask_dtype == torch.bool:
            return allowed[None, None]
        return additive_mask(allowed, self.mask_dtype)[None, None]

    def _call(self, feed: dict[str, torch.Tensor], view_len: int, compiled: bool = True,
              tuned: bool = True) -> tuple[torch.Tensor, ...]:
        """masked_forward, compiled if the runner compiles (autotuned if `tuned` and the runner autotunes),
        eager until the K/V buffers are made (_kv_made)."""
        if not compiled or self._compiled is None or not self._kv_made():
            return self.masked_forward(feed, view_len)
        return self._guarded(self._compiled if tuned else self._compiled_untuned, feed, view_len)

    def _guarded(self, compiled_fn, *args):
        """Call a torch.compile'd function; fail, never fall back to eager: a silent fallback would
        only show as a slow benchmark."""
        try:
            with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
                return compiled_fn(*args)
        except torch._dynamo.exc.TorchDynamoException as e:
            what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CompileError(f"torch.compile of the {type(self).__name__} forward failed ({what[:300]}); "
                               "run with --no-compile (compile=False)") from e

    # -- the fixed-shape interface: what `forward` pads to, and what rounds.py builds its rounds from ---------
    # A "static function" runs fn(inputs, *args) over fixed input buffers (compiled if the runner compiles, one
    # CUDA-graph replay if it captures); methods that take `feed` (a dict of such buffers) are traceable bodies
    # of one: no read-back, no control flow that depends on the data.

    def function(self, key: tuple) -> StaticFunction | None:
        """The static function made under `key` (make_function, forward_function), or None: never made, or
        dropped by a `reset` that grew the cache (its buffers were sized for the old one)."""
        return self._static.get(key)

    def make_function(self, key: tuple, fn, inputs: dict[str, torch.Tensor], *args, compile: bool = True
                      ) -> StaticFunction:
        """fn(inputs, *args) over the fixed buffers `inputs` as the static function `key`, returned. It is
        compiled if the runner compiles and `compile` (False: eager inside its graph, for a few index copies
        with nothing to fuse). It runs eager until the K/V buffers are made (_kv_made), and is captured on CUDA
        with graphs."""
        compiled = torch.compile(fn, dynamic=False, options=compile_options(self.device, self.autotune)) \
            if self.compiles and compile else None

        def run():
            if compiled is None or not self._kv_made():
                return fn(inputs, *args)
            return self._guarded(compiled, inputs, *args)
        self._static[key] = self._make_static(inputs, run)
        return self._static[key]

    def forward_function(self, rows: int, example: dict[str, torch.Tensor]) -> StaticFunction:
        """The static forward of `rows` rows for these input kinds (the one `forward` pads to): its inputs are
        `static_inputs`' buffers, its outputs (1, rows, ...) each. Made once per cache."""
        key = (rows, tuple(sorted(example)))
        if key not in self._static:
            inputs = self.static_inputs(rows, example, scratch=rows)
            self._static[key] = self._make_static(inputs, lambda: self._call(inputs, self.book.max_len,
                                                                             tuned=rows == 1))
        return self._static[key]

    def static_inputs(self, rows: int, example: dict[str, torch.Tensor], scratch: int) -> dict[str, torch.Tensor]:
        """Input buffers of a static forward of `rows` rows: each input (1, rows, ...) like example's (rows, ...),
        pos (1, rows), block (rows, max_pending + rows), at (2,) = [committed length, first slot written]. A
        capture's writes land in the last `scratch` slots."""
        s, dev = self.book.max_len, self.device
        inputs = {k: torch.zeros(1, rows, *v.shape[1:], dtype=v.dtype, device=dev) for k, v in example.items()}
        inputs.update(pos=torch.zeros(1, rows, dtype=torch.long, device=dev),
                      block=torch.eye(rows, self.max_pending + rows, dtype=torch.bool, device=dev),
                      at=torch.tensor([0, s - scratch], device=dev))
        return inputs

    def causal_block(self, rows: int) -> torch.Tensor:
        """(rows, max_pending + rows) bool: a block input of `rows` new rows that see each other causally, with
        no pending rows before them (a chain's verify, a round's extend)."""
        assert self.pending == 0, "a causal block over no pending rows"
        return self._block(None, rows, rows, self.max_pending)

    def _make_static(self, inputs: dict[str, torch.Tensor], fn) -> StaticFunction:
        """A static-shape function over fixed input buffers: a captured CUDA graph, or a plain call."""
        st = StaticFunction(inputs)
        if self.cuda_graphs:
            replay, st.outputs = self._capture(fn)
            st.run = lambda: (replay(), st.outputs)[1]
        else:
            st.run = fn
        return st

    def _capture(self, fn) -> tuple[object, tuple[torch.Tensor, ...]]:
        self._pool = self._pool or torch.cuda.graph_pool_handle()  # one pool for all of a runner's graphs
        return capture_graph(fn, self.device, self._pool)


class TargetRunner(SlotRunner):
    """An HF causal LM; `forward({"ids": (T,)}, ...)` returns (logits (T, V) fp32, taps (T, n*H)),
    or (logits,) alone when the contract is None (plain decoding captures no taps).

    Its compiled single-row forward (a plain decode step) autotunes its matmuls on CUDA. That makes a
    plain step faster with the same tokens, for about a minute of compilation (inductor keeps the
    results on disk). Its verify and prefill sizes and the draft's functions are not autotuned
    (`python benchmarks/decode_steps.py --autotune target,none` times the choice)."""

    autotune = True
    prefill_chunk = 128  # rows per static prefill forward: one more compiled size (see prefill)

    def __init__(self, model: torch.nn.Module, contract: TapContract | None, **kw):
        p = next(model.parameters())
        cfg = text_config(model.config)
        self.contract = contract  # before the base class picks the function it compiles
        super().__init__(p.device, max_position=getattr(cfg, "max_position_embeddings", None), **kw)
        self.model, self.mask_dtype = model, p.dtype
        self.stack = locate(model)
        self.cache_kw = cache_kwarg(model)
        self.cache: Cache | None = None
        self.keep_last = 0  # > 0: only the last rows' logits (prefill), where the model supports it
        self._can_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.kv_groups = attention.groups(model)  # > 1: the mask goes in grouped too, made once a forward

    def _new_cache(self) -> None:
        arena = Arena(self.stack.num_layers)
        self.cache = Cache(layers=[SlotLayer(self.book, arena, i) for i in range(self.stack.num_layers)])

    def _layers(self) -> list[Slots]:
        return [layer.slots for layer in self.cache.layers]

    def _run(self, inputs, pos, mask):
        kw = {"input_ids": inputs["ids"], "attention_mask": mask, "position_ids": pos, "use_cache": True,
              self.cache_kw: self.cache, **({"logits_to_keep": self.keep_last} if self._can_keep else {})}
        if self.kv_groups > 1:
            kw[attention.ROWS_MASK] = attention.rows_mask(mask, self.kv_groups)
        return (self.model(**kw).logits.float(),)

    def _traced(self):
        return self.masked_forward if self.contract is None else self._tapped_forward

    def _tapped_forward(self, feed, view_len):
        """masked_forward, traced under TapHooks. A function of its own, so compiled graphs are never
        shared with a runner without taps. Dynamo does not guard on module hooks: it would run a graph
        traced without them (e.g. the plain runner's, at the same prefill size) and lose the taps."""
        return self.masked_forward(feed, view_len)

    def _call(self, feed, view_len, compiled=True, tuned=True):
        if self.contract is None:
            return super()._call(feed, view_len, compiled, tuned)
        # The hooks go on outside the compiled function: dynamo traces hooks it finds on the modules
        # (registering them inside would break the graph), and their captures become its outputs.
        with TapHooks(self.stack, self.contract) as hooks:
            logits, = super()._call(feed, view_len, compiled, tuned)
        return logits, hooks.taps

    @torch.no_grad()
    def greedy_steps(self, tok: torch.Tensor, n: int) -> torch.Tensor:
        """n greedy steps of plain decoding from `tok` (0-d, the next token, not yet in the cache),
        committed; returns their tokens (n,) on the device, a view of this runner's buffer (valid until
        this position is decoded again). Each step is one static function that writes its argmax as the
        next step's input and moves its own position on: on CUDA the host only replays, with no copy,
        argmax or fill launched between two steps."""
        assert self.contract is None and self.static and self.pending == 0, "plain static runner, no pending rows"
        key = (1, ("ids",), "greedy")
        if key not in self._static:
            s, dev = self.book.max_len, self.device
            inputs = {"ids": torch.zeros(1, 1, dtype=torch.long, device=dev), "next": torch.zeros(s, dtype=torch.long,
                      device=dev), "pos": torch.zeros(1, 1, dtype=torch.long, device=dev),
                      "block": torch.ones(1, 1, dtype=torch.bool, device=dev),
                      "at": torch.tensor([s - 3, s - 3], device=dev)}  # a capture's two warm-ups write s-3, s-2
            self.make_function(key, self._greedy_step, inputs, s)
        st = self._static[key]
        st.inputs["ids"].copy_(tok)
        st.inputs["pos"].fill_(self.length)
        st.inputs["at"].fill_(self.length)
        for _ in range(n):
            st.run()
        self.length += n
        return st.inputs["next"][self.length - n:self.length]

    def _greedy_step(self, feed: dict[str, torch.Tensor], view_len: int) -> tuple[torch.Tensor]:
        """One plain step whose argmax becomes its next input: next[pos] = that token, pos and at + 1."""
        feed = dict(feed)
        following = feed.pop("next")
        logits, = self.masked_forward(feed, view_len)
        tok = logits[0, -1].argmax().view(1, 1)
        following.index_copy_(0, feed["pos"][0].clone(), tok[0])  # not a view of pos, mutated below (rounds.py)
        feed["ids"].copy_(tok)
        feed["pos"].add_(1)
        feed["at"].add_(1)
        return (tok,)

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The prompt (P,) into the empty cache: last-position logits (V,) and taps (P, n*H) if any.

        A static runner runs it in chunks of `prefill_chunk` rows through one compiled forward (one
        CUDA graph). Run eagerly, a prompt costs a launch per op of every layer: for SmolLM2-135M
        on a GPU, about a tenth of a 256-token reply. The last chunk ends at the prompt's
        end, rewriting the rows it shares with the one before (the same tokens at the same
        positions), so no chunk writes past the prompt and the cache needs no extra room."""
        assert self.length == 0 and self.pending == 0, "reset() before prefill"
        p = ids.shape[0]
        if self.static:
            return self._prefill_chunks(ids)
        self.keep_last = 1  # the prompt's other logits are never used: skip their lm_head
        try:
            out = self.forward({"ids": ids}, 0, exact=True)
        finally:
            self.keep_last = 0
        self.commit(p)
        return (out[0][-1],) + out[1:]

    def _prefill_chunks(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p, c = ids.shape[0], self.prefill_chunk
        assert c <= CACHE_ROUNDING <= self.book.max_len, "a chunk padded past a short prompt must fit the cache"
        taps = []
        for begin in range(0, p, c):
            first = min(begin, max(p - c, 0))
            self.length = first  # rows first..begin-1 are written again, with the same values
            out = self.forward({"ids": ids[first:first + c]}, first, pad_to=c)
            self.commit(len(out[0]))
            taps += [t[begin - first:] for t in out[1:]]
        return (out[0][-1], torch.cat(taps)) if taps else (out[0][-1],)
