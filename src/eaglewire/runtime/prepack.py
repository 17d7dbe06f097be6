"""oneDNN-packed linear layers for fp32 decoding on a CPU (`Speedups(prepack=...)`, speedups.py).

On a CPU, `nn.Linear` hands each call to MKL, which lays the weights out again every time. For the few
rows of a decode step that costs memory bandwidth, and bandwidth is what the step is bound by. Here the
weights are packed once for oneDNN and called through oneDNN's pointwise linear on dense activations (no
conversion of the activations in and out). The logits stay equal to 1e-4, with the same argmax at every
position. Where MKL is slow, this made the lm_head about twice as fast and a plain decode step about a
quarter faster. `eaglewire bench` against `eaglewire bench --no-prepack` measures it (measured:
benchmarks/results/).

`prepacked(module)` returns a copy of the module tree in which every nn.Linear of at least
MIN_WEIGHTS weights is a `PackedLinear`. Every other tensor (embeddings, norms, buffers, the dense
weights themselves) is shared, not copied, so the caller's model is untouched (HF `generate` in the
same benchmark keeps its own). Smaller layers stay dense: a oneDNN call has a fixed cost of some
microseconds whatever its size, more than the packing saves there. The packed weights are a second
copy of the linear layers in memory (about 0.5 GB for SmolLM2-135M in fp32). Layers that are faster
dense at every row count (`time_layers`) are not copied.

Whether the packed layout pays is the machine's, not the layer's. On a CPU where MKL is slow, packing
wins at every row count. On another, with the weights out of cache as in a step, MKL can be the faster
at one row and oneDNN at four or eight. MKL's cost can also jump between three rows and four, so that a
3-row verify wants MKL and a 4-row one oneDNN. So each layer shape is timed both ways once a process,
at each row count the caller will run (`prepacked(rows=...)`: one row, the verify's rows, PACK_ROWS).
A PackedLinear calls whichever was faster for the rows it gets. A row count not timed goes the way of
the next larger one that was. A bench's JSON lists the choices under settings.linears.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from ..targets import shared_copy

MIN_WEIGHTS = 1 << 16  # SmolLM2-135M's smallest projection (k_proj) has 110,592
# The row count oneDNN lays a weight out for. Laid out for 8 rows, a SmolLM2 projection serves 1 to
# 64 rows about as fast as one laid out for 1, or faster: the 49152-wide lm_head is a third faster at
# 8 rows and a little slower at 1. Decoding verifies several rows at a time.
PACK_ROWS = 8

def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Packing pays for fp32 on a CPU with oneDNN; elsewhere the dense path is used."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))  # the op inductor's CPU backend calls


class PackedLinear(nn.Module):
    """nn.Linear for inference over a oneDNN-packed copy of its weight (fp32, CPU).

    `weight` (and `bias`) stay the dense parameters, shared with the source layer, for code that
    reads them; the forward calls the packed copy, or MKL on `weight` for the row counts where `time_layers`
    found that faster (`dense_at`).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        # views without autograd, made once: a detach a call was ~1% of a CPU decode step (profiled)
        self._w, self._b = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.dense_at = {}  # rows -> whether MKL on the dense weight is the faster there (`time_layers`)

    @property
    def dense_at(self) -> dict[int, bool]:
        return self._dense_at

    @dense_at.setter
    def dense_at(self, timed: dict[int, bool]) -> None:
        self._dense_at = dict(sorted(timed.items()))
        # route[n]: dense or not for n rows (the last entry for more): the choice at the fewest timed rows >= n
        counts = list(self._dense_at) or [1]
        self._route = tuple(self._dense_at.get(next((c for c in counts if c >= n), counts[-1]), False)
                            for n in range(counts[-1] + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = self._route
        if route[min(x.numel() // x.shape[-1], len(route) - 1)]:
            return self.dense(x)
        return self.packed(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._w, self._b)

    def repack(self) -> None:
        """Pack `weight` again after it changed in place (the dense views follow it by themselves)."""
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS)

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        # dense in, dense out (inductor's CPU linear): no per-call conversion of the activations
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self._b, "none", [], "")


TIMING_REPEATS = 3
_timed: dict[tuple, bool] = {}  # (in, out, bias, threads, rows) -> whether dense is the faster


def time_layers(layers: list[PackedLinear], rows: tuple[int, ...] = (1, PACK_ROWS)) -> None:
    """Set each layer's `dense_at`: at each row count in `rows`, whether this machine's dense linear beats the
    packed one for its shape. Timed as a forward meets them: a pass calls every layer once in turn, all of
    them dense or all packed, and adds up each shape's calls. So the weights come from memory as in a step,
    not from cache. A loop over one layer keeps its weight in cache, and favoured MKL where in a step oneDNN
    won. Each side's best of TIMING_REPEATS passes; once a shape, row count and thread count a process
    (SmolLM2-135M: 8 passes a side of ~25 ms each a row count)."""
    rows = tuple(sorted(set(rows)))
    threads = torch.get_num_threads()
    shape = {id(m): (m.in_features, m.out_features, m.bias is not None, threads) for m in layers}
    with torch.no_grad():
        for n in rows:
            todo = [m for m in layers if (*shape[id(m)], n) not in _timed]
            if not todo:
                continue
            shapes = {shape[id(m)] for m in todo}
            x = {m.in_features: torch.randn(1, n, m.in_features, dtype=m.weight.dtype) for m in todo}
            best = {(k, side): float("inf") for k in shapes for side in ("dense", "packed")}
            for i in range(TIMING_REPEATS + 1):
                for side in ("dense", "packed"):
                    spent = dict.fromkeys(shapes, 0.0)
                    for m in todo:
                        t0 = time.perf_counter()
                        getattr(m, side)(x[m.in_features])
                        spent[shape[id(m)]] += time.perf_counter() - t0
                    if i:  # the first passes warm both up
                        for k in shapes:
                            best[k, side] = min(best[k, side], spent[k])
            _timed.update({(*k, n): best[k, "dense"] <= best[k, "packed"] for k in shapes})
    for m in layers:
        m.dense_at = {n: _timed[(*shape[id(m)], n)] for n in rows}
        if all(m.dense_at.values()):  # never called: the packed copy's memory goes back
            m.packed_weight = torch.empty(0, dtype=m.weight.dtype)


def choices(*modules: nn.Module) -> dict[str, str] | None:
    """Which linear each PackedLinear in `modules` calls, by shape and row count, for a bench's JSON:
    {"576x3072": "mkl at 1 row, onednn at 8"}; None when nothing is packed."""
    name = {True: "mkl", False: "onednn"}
    return {f"{m.in_features}x{m.out_features}": ", ".join(f"{name[d]} at {n}" + (" row" if n == 1 else "")
                                                           for n, d in m.dense_at.items())
            for module in modules for m in module.modules() if type(m) is PackedLinear} or None


def prepacked(module: nn.Module, rows: tuple[int, ...] = (1, PACK_ROWS)) -> nn.Module:
    """A copy of `module` whose large nn.Linear layers are PackedLinear (timed at each row count in `rows`:
    `time_layers`), all other tensors shared; the module itself when none is large enough."""
    if not any(_packs(m) for m in module.modules()):
        return module
    out = shared_copy(module)
    _swap(out)
    time_layers([m for m in out.modules() if type(m) is PackedLinear], rows)
    return out.eval()


def refresh(module: nn.Module) -> None:
    """Pack every PackedLinear's weight again after the weights changed in place (never compiled: see `prepacked`)."""
    for m in module.modules():
        if type(m) is PackedLinear:
            m.repack()


def _packs(m: nn.Module) -> bool:
    return type(m) is nn.Linear and m.weight.numel() >= MIN_WEIGHTS


def _swap(module: nn.Module) -> None:
    for name, child in module.named_children():
        if _packs(child):
            setattr(module, name, PackedLinear(child))
        else:
            _swap(child)
