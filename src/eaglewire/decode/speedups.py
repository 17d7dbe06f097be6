"""The decoder's speed-ups: one config (`Speedups`) and one ordered function (`apply`) that applies them from
outside the models, as torchtitan's `parallelize_llama` applies its own. The models stay plain (draft.py has no
speed-up switch); the decoder runs copies that share every tensor the speed-ups leave alone.

`apply`'s order, each step on the last one's result:

  1. fused projections (runtime/projections.py): q/k/v and gate/up one matmul each, target and draft. A decode step of
     a small model on a GPU is bound by its kernel count, which inductor does not cut by merging these itself.
     On a GPU a compiled plain step is about a fifth faster; on a CPU the gain is within noise (`eaglewire bench
     --no-fuse-projections` against the default measures it). Auto: on for targets up to FUSE_MAX_PARAMS; the
     copy holds those projections twice, which a big target cannot spare.
  2. prepacking (runtime/prepack.py): linear layers over oneDNN-packed weights, each shape timed at the row counts its
     runner will run (the target: a step, PACK_ROWS, the verify; the draft: its extends and steps). Auto: on for
     fp32 on a CPU, not with compile (inductor lays weights out itself and cannot trace oneDNN tensors). The
     draft is packed where the target was.
  3. grouped attention (runtime/attention.py): query heads that share K/V heads read each one in place instead of a copy
     per query head: the target through `grouped_sdpa` (a copy whose config switches from sdpa), the draft's
     attention modules wrapped in `GroupedDraftAttention`. Auto: on CUDA, where it wins the plain step and the
     chain and tree rounds by a few percent. Not on a CPU, where it is mixed: a plain step a little slower, a
     chain round a little faster. `python benchmarks/decode_steps.py --random-draft --attention sdpa,grouped`
     measures it (measured: benchmarks/results/).
  4. static shapes, torch.compile, CUDA graphs: the runners' (runtime/runners.py), built last with
     `Speedups.runner_options` (their sizes are the decoder's shape). `compile` runs their static forwards through
     torch.compile (inductor fuses a decoder layer's many small kernels; with graphs the compiled forward is
     what is captured). Both imply static shapes, which a CPU can run alone to check that logic.

Steps 1-3 copy a model only where it is still the caller's: the caller's target and draft, and their configs,
are never changed.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..draft import DraftAttention
from ..errors import UsageError
from ..runtime import attention
from ..runtime import prepack as packing
from ..runtime import projections
from ..targets import shared_copy

FUSE_MAX_PARAMS = 1_000_000_000  # fused projections by default up to this target size (step 1)


@dataclass(frozen=True, kw_only=True)
class Speedups:
    """Which speed-ups the decoder applies (`apply`). None: the device's choice (the module docstring)."""

    fuse_projections: bool | None = None
    prepack: bool | None = None
    grouped_attention: bool | None = None
    compile: bool = False
    cuda_graphs: bool = False
    static_shapes: bool = False

    def __post_init__(self):
        for name in ("fuse_projections", "prepack", "grouped_attention"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise UsageError(f"speed-ups: {name} must be True, False or None (the device's choice), got {v!r}")
        for name in ("compile", "cuda_graphs", "static_shapes"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise UsageError(f"speed-ups: {name} must be True or False, got {v!r}")

    @property
    def runner_options(self) -> dict[str, bool]:
        """The keywords every runner is built with (step 4)."""
        return {"static": self.static_shapes, "cuda_graphs": self.cuda_graphs, "compile": self.compile}


@dataclass(frozen=True, kw_only=True)
class Applied:
    """What `apply` did to the target, and the packed layers' choices (prepack.choices: which of MKL and
    oneDNN each shape calls; None when nothing is packed). A speed-up is False where it was asked for and
    found nothing to change: no q/k/v or gate/up group, no layer worth packing, no shared K/V heads or not
    sdpa."""

    fuse_projections: bool
    prepack: bool
    grouped_attention: bool
    linears: dict[str, str] | None


def apply(target_model: nn.Module, draft: nn.Module | None, speedups: Speedups, *, verify_rows: int | None = None,
          draft_rows: tuple[int, ...] = ()) -> tuple[nn.Module, nn.Module | None, Applied]:
    """(target model, draft, what was applied) for decoding: steps 1-3 of the module docstring, in order, on the
    models as they are placed (the draft on the target's device and dtype). `verify_rows`: the rows of
    the target's verify (None without a draft). `draft_rows`: the draft's static sizes. Raises UsageError
    for a speed-up the device cannot run."""
    p = next(target_model.parameters())
    if speedups.cuda_graphs and p.device.type != "cuda":
        raise UsageError(f"CUDA graphs need the target on a CUDA device, it is on {p.device}")
    can_pack = packing.available(p.device, p.dtype)
    if speedups.prepack and not can_pack:
        raise UsageError(f"prepack needs an fp32 target on a CPU with oneDNN; it is {p.dtype} on {p.device}")
    model, engine_draft = target_model, draft

    # 1. fused projections
    fuse = speedups.fuse_projections
    if fuse is None:
        fuse = sum(q.numel() for q in target_model.parameters()) <= FUSE_MAX_PARAMS
    if fuse:
        model = projections.fused(model)
        engine_draft = projections.fused(engine_draft) if draft is not None else None
    fused = model is not target_model  # False when the model has no such group

    # 2. prepacking, timed at each row count it will run: a step, PACK_ROWS for prefills, the verify
    pack = (can_pack and not speedups.compile) if speedups.prepack is None else speedups.prepack
    packed = packing.prepacked(model, (1, packing.PACK_ROWS) + ((verify_rows,) if verify_rows else ())) \
        if pack else model
    prepacked, model = packed is not model, packed  # False too when no layer is large enough
    if prepacked and draft is not None:
        engine_draft = packing.prepacked(engine_draft, (1, packing.PACK_ROWS, *draft_rows))

    # 3. grouped attention
    grouped = speedups.grouped_attention
    if grouped is None:
        grouped = p.device.type == "cuda"
    switched = False  # stays so without shared K/V heads or sdpa
    if grouped:
        own = model if model is not target_model else shared_copy(model)  # its config changes
        switched = attention.use_grouped(own)
        model = own if switched else model
        if draft is not None:
            engine_draft = grouped_draft(engine_draft, own=engine_draft is not draft)

    linears = packing.choices(model, *(() if engine_draft is None else (engine_draft,)))
    return model, engine_draft, Applied(fuse_projections=fused, prepack=prepacked, grouped_attention=switched,
                                        linears=linears)


def refresh(engine_draft: nn.Module) -> None:
    """Derive again, in place, what steps 1-2 derived from the draft's weights (fused projections, packed
    layers), after those weights were replaced in place. Grouped attention and the runners only read them."""
    projections.refresh(engine_draft)
    packing.refresh(engine_draft)


def grouped_draft(draft: nn.Module, own: bool = False) -> nn.Module:
    """The draft with each attention module whose query heads share K/V heads wrapped in
    attention.GroupedDraftAttention: on a copy (tensors shared), or in place where `own` (the decoder's copy
    already); the draft itself when no head shares."""
    if not any(isinstance(m, DraftAttention) and m.nh != m.nkv for m in draft.modules()):
        return draft
    out = draft if own else shared_copy(draft)
    for parent in list(out.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DraftAttention) and child.nh != child.nkv:
                setattr(parent, name, attention.GroupedDraftAttention(child).train(child.training))
    return out
