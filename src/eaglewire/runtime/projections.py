"""Sibling projections fused into one matmul: q/k/v in attention, gate/up in the MLP
(`Speedups(fuse_projections=...)`, speedups.py: on by default for targets up to 1B parameters;
`bench --no-fuse-projections` to compare).

A decode step of a small model on a GPU is bound by how many kernels it runs, not by its bytes: for
SmolLM2-135M its graph replay takes over twenty times as long as reading its weights once.
`python benchmarks/decode_steps.py --random-draft --modes plain` measures the replay (measured: benchmarks/results/).
Llama-style layers run q_proj, k_proj and v_proj one after another on the same hidden states, and
gate_proj then up_proj: five matmuls a layer where two do. HF's forwards are left as they are. The
first projection of a group computes the whole group in one matmul and keeps the result. The others
return their slice of it when they are called on that same tensor, and compute their own matmul
otherwise (so any call order stays correct, it only loses the saving).

`fused(model)` returns a copy whose groups are fused, every other tensor shared with the model
(HF `generate` in the same benchmark keeps its own layers); the fused weights are a second copy of
the grouped projections.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..targets import shared_copy

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Last:
    """The group's last fused output, by input. A plain object, so the fused weight is registered
    in one module only."""

    def __init__(self, fused: nn.Linear, sizes: list[int], sources: list[nn.Linear]):
        self.fused, self.sizes = fused, sizes
        # the group's own weights (tensors shared with the model fused): `refresh` fuses them again
        self.sources = [(m.weight, m.bias) for m in sources]
        self.input: torch.Tensor | None = None
        self.parts: tuple[torch.Tensor, ...] = ()

    def __deepcopy__(self, memo):
        """A copy (shared_copy: prepacking copies the fused model) that keeps the sources themselves: they are the
        source model's tensors, no longer parameters of the fused one, so shared_copy's memo does not hold them."""
        new = _Last(copy.deepcopy(self.fused, memo), list(self.sizes), [])
        new.sources = self.sources
        memo[id(self)] = new
        return new


class FusedFirst(nn.Module):
    """The group's first projection: runs the fused matmul, returns its own slice."""

    def __init__(self, fused: nn.Linear, last: _Last):
        super().__init__()
        self.fused, self.last = fused, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.fused(x).split(self.last.sizes, dim=-1)
        self.last.input, self.last.parts = x, parts
        return parts[0]


class FusedSlice(nn.Module):
    """A later projection of the group: its slice of the fused output for the same input."""

    def __init__(self, index: int, last: _Last):
        super().__init__()
        self.index, self.last = index, last
        start = sum(last.sizes[:index])
        self.rows = slice(start, start + last.sizes[index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.last.input is x:
            return self.last.parts[self.index]
        f = self.last.fused  # called on another tensor: its own rows of the fused weight
        return nn.functional.linear(x, f.weight[self.rows], None if f.bias is None else f.bias[self.rows])


def _fusable(module: nn.Module, names: tuple[str, ...]) -> bool:
    layers = [getattr(module, n, None) for n in names]
    if not all(type(m) is nn.Linear for m in layers):
        return False
    first = layers[0]
    return all(m.in_features == first.in_features and (m.bias is None) == (first.bias is None)
               and m.weight.dtype == first.weight.dtype and m.weight.device == first.weight.device for m in layers)


def _fuse(module: nn.Module, names: tuple[str, ...]) -> None:
    layers = [getattr(module, n) for n in names]
    sizes = [m.out_features for m in layers]
    w = torch.cat([m.weight.detach() for m in layers])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=layers[0].bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fused.weight.copy_(w)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([m.bias.detach() for m in layers]))
    fused.requires_grad_(False)
    last = _Last(fused, sizes, layers)
    setattr(module, names[0], FusedFirst(fused, last))
    for i, name in enumerate(names[1:], start=1):
        setattr(module, name, FusedSlice(i, last))


def groups(model: nn.Module) -> int:
    """How many projection groups `fused` would fuse."""
    return sum(_fusable(m, names) for m in model.modules() for names in GROUPS)


def fused(model: nn.Module) -> nn.Module:
    """A copy of `model` with every q/k/v and gate/up group fused; the model itself when there is none."""
    if not groups(model):
        return model
    out = shared_copy(model)
    for m in list(out.modules()):
        for names in GROUPS:
            if _fusable(m, names):
                _fuse(m, names)
    return out.eval()


@torch.no_grad()
def refresh(model: nn.Module) -> None:
    """Fuse each group's weights again, in place, after the model they came from changed its weights in place:
    compiled code and CUDA graphs hold the fused tensors, not copies."""
    for m in model.modules():
        if isinstance(m, FusedFirst):
            f, sources = m.fused, m.last.sources
            f.weight.copy_(torch.cat([w for w, _ in sources]))
            if f.bias is not None:
                f.bias.copy_(torch.cat([b for _, b in sources]))
