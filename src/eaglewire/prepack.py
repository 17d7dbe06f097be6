"""oneDNN-packed linear layers for fp32 decoding on a CPU (`SpecDecoder(prepack=...)`).

On a CPU, `nn.Linear` hands each call to MKL, which lays the weights out again every time; for
the few rows a decode step has that costs the memory bandwidth the step is bound by. Measured on
2 cores (AVX-512, torch 2.13, SmolLM2-135M fp32): the 49152-wide lm_head took 7.2 ms for one row
and 11.8 ms for eight, a whole forward 42 ms for one token and 62 ms for four. With the weights
packed once for oneDNN: lm_head 3.4 / 5.2 ms, the forward 32 / 41 ms, logits equal to 1e-4 and the
same argmax at every position. Called through oneDNN's pointwise linear on dense activations (no
conversion of the activations in and out), a plain decode step went from 33 to 24 ms.
docs/PERFORMANCE.md has the benchmarks.

`prepacked(module)` returns a copy of the module tree in which every nn.Linear of at least
MIN_WEIGHTS weights is a `PackedLinear`; every other tensor (embeddings, norms, buffers, the dense
weights themselves) is shared, not copied, so the caller's model is untouched (HF `generate` in the
same benchmark keeps its own). Smaller layers stay dense: a oneDNN call costs ~10 us whatever its
size, more than the packing saves there (a 32x32 layer: 1.5 us dense, 11 us packed). The packed weights are
a second copy of the linear layers in memory (about 0.5 GB for SmolLM2-135M in fp32), less the layers that are
faster dense at every row count (`time_layers`).

Whether the packed layout pays is the machine's, not the layer's. Those figures were an AMD EPYC's, where MKL
is slow. On a 2-core Intel Xeon (AVX-512, AMX; fifteenth run), with the weights out of cache as in a step, MKL was
the faster at one row (gate/up 352 against 379 us, down 157 against 216) and oneDNN at four or eight (gate/up 400
against 567 us at four; the lm_head 4.6 ms at one row or four, MKL 5.1 and 9.3): packing everything made a plain
step 50-53 ms against 43-46. So each layer shape is timed both ways once a process, at one row and at PACK_ROWS
(`time_layers`), and a PackedLinear calls whichever was faster for the rows it gets.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from .targets import shared_copy

MIN_WEIGHTS = 1 << 16  # SmolLM2-135M's smallest projection (k_proj) has 110,592
# The row count oneDNN lays a weight out for. Laid out for 8 rows, a SmolLM2 projection serves 1 to
# 64 rows as fast as or faster than one laid out for 1 (2 cores: the 49152-wide lm_head, 8 rows:
# 2.8 ms against 4.2; 1 row: 2.3 against 1.9), and decoding verifies several rows at a time.
PACK_ROWS = 8

def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Packing pays for fp32 on a CPU with oneDNN; elsewhere the dense path is used."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))  # the op inductor's CPU backend calls


class PackedLinear(nn.Module):
    """nn.Linear for inference over a oneDNN-packed copy of its weight (fp32, CPU).

    `weight` (and `bias`) stay the dense parameters, shared with the source layer, for code that
    reads them; the forward calls the packed copy, or MKL on `weight` for the row counts where `time_layers`
    found that faster (`dense_for`).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)
        # (one row, several rows): whether MKL on the dense weight is the faster there (`time_layers`)
        self.dense_for = (False, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_for[x.numel() != x.shape[-1]]:
            return self.dense(x)
        return self.packed(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.detach(), self.bias.detach() if self.bias is not None else None)

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        # dense in, dense out (inductor's CPU linear): no per-call conversion of the activations
        bias = self.bias.detach() if self.bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")


TIMING_REPEATS = 3
_timed: dict[tuple, tuple[bool, bool]] = {}  # (in, out, bias, threads) -> PackedLinear.dense_for


def time_layers(layers: list[PackedLinear]) -> None:
    """Set each layer's `dense_for`: (at one row, at PACK_ROWS rows) whether this machine's dense linear beats
    the packed one for its shape. Timed as a forward meets them: a pass calls every layer once in turn, all of
    them dense or all packed, and adds up each shape's calls, so the weights come from memory as in a step and
    not from cache (a loop over one layer, whose weight stays in cache, favoured MKL where in a step oneDNN
    won). Each side's best of TIMING_REPEATS passes; once a shape and thread count a process (SmolLM2-135M: 8
    passes a side of ~25 ms each)."""
    keys = [(m.in_features, m.out_features, m.bias is not None, torch.get_num_threads()) for m in layers]
    todo = [(m, k) for m, k in zip(layers, keys) if k not in _timed]
    if todo:
        shapes = {k for _, k in todo}
        picks: dict[tuple, list[bool]] = {k: [] for k in shapes}
        with torch.no_grad():
            for rows in (1, PACK_ROWS):
                x = {m.in_features: torch.randn(1, rows, m.in_features, dtype=m.weight.dtype) for m, _ in todo}
                best = {(k, side): float("inf") for k in shapes for side in ("dense", "packed")}
                for i in range(TIMING_REPEATS + 1):
                    for side in ("dense", "packed"):
                        spent = dict.fromkeys(shapes, 0.0)
                        for m, k in todo:
                            t0 = time.perf_counter()
                            getattr(m, side)(x[m.in_features])
                            spent[k] += time.perf_counter() - t0
                        if i:  # the first passes warm both up
                            for k in shapes:
                                best[k, side] = min(best[k, side], spent[k])
                for k in shapes:
                    picks[k].append(best[k, "dense"] <= best[k, "packed"])
        _timed.update({k: tuple(v) for k, v in picks.items()})
    for m, k in zip(layers, keys):
        m.dense_for = _timed[k]
        if all(m.dense_for):  # never called: the packed copy's memory goes back
            m.packed_weight = torch.empty(0, dtype=m.weight.dtype)


def choices(*modules: nn.Module) -> dict[str, str] | None:
    """Which linear each PackedLinear in `modules` calls, by shape, for a bench's JSON:
    {"576x3072": "mkl at 1 row, onednn at 8"}; None when nothing is packed."""
    name = {True: "mkl", False: "onednn"}
    return {f"{m.in_features}x{m.out_features}": f"{name[m.dense_for[0]]} at 1 row, {name[m.dense_for[1]]} at "
            f"{PACK_ROWS}" for module in modules for m in module.modules() if type(m) is PackedLinear} or None


def prepacked(module: nn.Module) -> nn.Module:
    """A copy of `module` whose large nn.Linear layers are PackedLinear (timed: `time_layers`), all other
    tensors shared; the module itself when none is large enough."""
    if not any(_packs(m) for m in module.modules()):
        return module
    out = shared_copy(module)
    _swap(out)
    time_layers([m for m in out.modules() if type(m) is PackedLinear])
    return out.eval()


def _packs(m: nn.Module) -> bool:
    return type(m) is nn.Linear and m.weight.numel() >= MIN_WEIGHTS


def _swap(module: nn.Module) -> None:
    for name, child in module.named_children():
        if _packs(child):
            setattr(module, name, PackedLinear(child))
        else:
            _swap(child)
