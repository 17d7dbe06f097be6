"""Static checks of the taps: which ids the engine reads, from which key, and what they make it capture,
against what the draft was trained on (its record), or without a record, against what its files state.
"""

from __future__ import annotations

from .. import interop
from ..errors import TapError
from ..interop.common import IDS_KEY
from ..taps import CONVENTIONS
from .context import Context, engine_name, ids_for, probe_command, raw_taps, taps_remedy
from .findings import Finding, Remedy, finding


# --- taps --------------------------------------------------------------------------------------------

def check_taps(ctx: Context) -> list[Finding]:
    s, v, N = ctx.subject, ctx.view, ctx.num_layers
    out = []
    if s.contract is not None and not s.recorded:
        what = (f"which taps it was trained on is {s.contract_from}" if s.contract_from.startswith("unknown")
                else f"the draft's taps {list(s.contract.taps)} are {s.contract_from}")
        out.append(finding("TAPS_UNVERIFIED", "warning", f"no tap record from eaglewire: {what}",
                           f"measure which taps it reads (`{' '.join(probe_command(ctx))}`), or import the draft "
                           "with the --source it really came from"))
    out += _target_class(ctx)
    if s.contract is not None and N is not None and s.contract.num_layers != N:
        return out  # TARGET_MISMATCH says it; every tap comparison would be noise
    if v is None or not v.recognised:
        return out
    truth = s.contract.taps if s.contract else None
    name, key = engine_name(ctx), ctx.ids_key
    if N is None:  # nothing known of the target: only where the ids are can be checked
        return out + (_missing(ctx, None, None) if v.ids is None else [])
    if truth is not None:
        want, why_not = ids_for(ctx, truth)
        if want is None:
            return out + [_unsupported(ctx, truth, why_not)]
        if len(truth) != v.num_aux_expected:
            out.append(finding("TAPS_UNSUPPORTED", "error",
                               f"{name} builds the draft's fc for {v.num_aux_expected} taps; this draft reads "
                               f"{len(truth)} taps {list(truth)}",
                               "serve it with SGLang 0.5.12 or newer (fc width follows the ids): "
                               "--engine-version 0.5.12" if ctx.engine == "sglang" else
                               f"write num_aux_hidden_states = {len(truth)} in the layer config (vLLM 0.26.0 "
                               "llama_eagle3.py:176-182 sizes fc by it), or export the draft again"))
    if not s.recorded and v.ids is None:
        truth = None  # what the engine reads says nothing of the trained taps: stated ids (if any) are the evidence
    if truth is not None and ctx.engine == "vllm" and N in truth:
        out.append(finding("TAPS_UNSUPPORTED", "info", f"taps {list(truth)} include the last layer's output ({N}): "
                           "vLLM captures it only with EagleModelMixin (PR #36063; DeepSeek-family targets: "
                           "PR #46973); older vLLM returns fewer hidden states",
                           "serve it with a vLLM release that includes those pull requests"))
    remedy = taps_remedy(ctx, truth) if truth is not None else None
    if v.ids is None:
        return out + _missing(ctx, truth, remedy)
    raw = raw_taps(ctx.convention, v.ids, N)
    if any(not 0 <= t <= N for t in raw):
        out.append(finding("TAPS_OUT_OF_RANGE", "error",
                           f"{key} = {v.ids} mean taps {list(raw)} to {name}, beyond the target's "
                           f"{N} layers (taps 0..{N})", "write the ids in the engine's convention", remedy))
    elif v.captured_taps is None:
        out.append(finding("TAPS_UNSUPPORTED", "error", f"{name} cannot capture {key} = {v.ids}: "
                           + "; ".join(p for p in v.problems if IDS_KEY in p), "write ids it can capture", remedy))
    elif truth is not None and tuple(v.captured_taps) != truth:
        meaning = CONVENTIONS[ctx.convention].meaning
        out.append(finding("TAPS_SHIFTED", "error",
                           f"{name} reads {key} = {v.ids} as taps {v.captured_taps} ({meaning}); the draft was "
                           f"trained on taps {list(truth)} ({s.contract_from})",
                           f"write the trained taps in {name}'s convention", remedy))
    return out


def _target_class(ctx: Context) -> list[Finding]:
    """A target class the engine cannot feed an EAGLE-3 draft at all (interop.<engine>.target_fault)."""
    faults = {"sglang": interop.sglang.target_fault, "vllm": interop.vllm.target_fault}
    fault = faults[ctx.engine](ctx.target.architecture) if ctx.engine in faults and ctx.target else None
    if not fault:
        return []
    return [finding("TAPS_UNSUPPORTED", "warning", f"{fault} (read from its source)",
                    "serve it with an engine release that captures this target's residual stream; "
                    f"`eaglewire serve-check --engine {ctx.engine}` measures what this one does")]


def _unsupported(ctx: Context, truth, why: str) -> Finding:
    if ctx.engine == "sglang":
        fix = ("serve it with vLLM, which captures taps 1..N by id (tap N with EagleModelMixin, PR #36063): export "
               "the native checkpoint with --format vllm" if 0 not in truth else
               "retrain on taps 1..N-1: neither SGLang nor vLLM feeds the draft the embedding (tap 0)")
    else:
        fix = "retrain on taps this engine captures (`eaglewire taps --target T` lists each engine's range)"
    return finding("TAPS_UNSUPPORTED", "error", f"{engine_name(ctx)} cannot capture the trained taps {list(truth)}: "
                   f"{why}", fix)


def _missing(ctx: Context, truth, remedy: Remedy | None) -> list[Finding]:
    """The engine reads no ids and falls back to its default taps. Against a record that is right or wrong;
    without one, ids written under a key the engine ignores state what was meant, and with no ids at all
    nothing says which taps the draft was trained on."""
    v, name, key = ctx.view, engine_name(ctx), ctx.ids_key
    default = list(v.captured_taps) if v.captured_taps else None
    fallback = f"{name} falls back to its default taps {default if default else '(2, N//2, N-3)'}"
    quirk = " (read inside a bare `except:`, so nothing is logged)" if ctx.engine == "sglang" else ""
    ignored = next(iter(v.ids_ignored.items()), None)
    if truth is not None:
        right = default is not None and tuple(default) == tuple(truth)
        fallback += (", the trained taps, reached only through its default" if right
                     else f", not the trained taps {list(truth)}")
        sev = "warning" if right else "error"
    elif ignored is not None:
        return [_stated_elsewhere(ctx, *ignored, default, fallback)]
    else:
        sev = "warning"
        fallback += ("; this checkpoint records no taps and states no ids, so which taps it was trained on is unknown "
                     "(many public drafts rely on the default)")
        remedy = Remedy(commands=(probe_command(ctx),))
    if ignored is not None:
        where, ids = ignored
        unread = _never_reads(ctx, where, ids, truth)
        return [finding("TAPS_WRONG_PLACE", sev, f"layer ids {ids} are under {where}, {unread} (it reads {key}): "
                        f"{fallback}", "put them where the engine reads them", remedy)]
    fix = "write the ids explicitly" if truth is not None else "measure which taps it reads"
    return [finding("TAPS_MISSING", sev, f"no {key} in config.json{quirk}: {fallback}", fix, remedy)]


def _stated_elsewhere(ctx: Context, where: str, ids: list[int], default, fallback: str) -> Finding:
    """No record: ids under a key this engine never reads still state which taps were meant, in the
    convention of the engines that read that key."""
    key = ctx.ids_key
    readings = stated_taps(ctx, where, ids)
    said = " or ".join(f"taps {list(t)} as {who} reads them" for who, t in readings) or "no taps this target has"
    agree = default is not None and any(tuple(t) == tuple(default) for _, t in readings)
    unread = _never_reads(ctx, where, ids, None)
    msg = f"layer ids {ids} are under {where}, {unread} (it reads {key}); they state {said}"
    one = {tuple(t) for _, t in readings}
    remedy = taps_remedy(ctx, next(iter(one))) if len(one) == 1 else None
    if agree:
        return finding("TAPS_WRONG_PLACE", "warning", f"{msg}: {fallback}, the same taps, reached only through its "
                       "default", "put them where the engine reads them", remedy)
    return finding("TAPS_WRONG_PLACE", "error", f"{msg}, but {fallback}",
                   "write the stated taps where the engine reads them" if remedy else
                   "find out which convention wrote them, then write the ids where the engine reads them "
                   f"(measure with `{' '.join(probe_command(ctx))}`)", remedy)


def _never_reads(ctx: Context, where: str, ids: list[int], truth) -> str:
    """'which <engine> never reads', and for vLLM's nested key what its V1 runner does with it instead. vLLM 0.26.0's
    V2 runner (dense targets: config/vllm.py:600-622) reads the top-level key only (v1/worker/gpu/spec_decode/
    eagle/eagle3_utils.py:35-58); V1 (MoE and hybrid targets) falls back to the nested key where the top-level one
    is absent (v1/worker/gpu_model_runner.py:5445-5476), as its own ids."""
    if ctx.engine != "vllm" or not where.startswith("eagle_config."):
        return f"which {engine_name(ctx)} never reads"
    try:
        taps = list(CONVENTIONS["vllm"].from_ids(ids, ctx.num_layers)) if ctx.num_layers else None
    except TapError:
        taps = None
    read = f"as taps {taps}" if taps else "as its own ids"
    if truth is not None and taps:
        read += ", the trained taps" if tuple(taps) == tuple(truth) else ", not the trained taps"
    return (f"which vLLM's V2 runner (dense targets) never reads; its V1 runner (MoE and hybrid targets) reads them "
            f"{read}")


def stated_taps(ctx: Context, where: str, ids: list[int]) -> list[tuple[str, tuple[int, ...]]]:
    """What ids under a key mean to the engines and trainers that write that key: the nested eagle_config
    key is SGLang's and SpecForge's (docs/CONVENTIONS.md section 1), the top-level one vLLM's and
    speculators'."""
    N = ctx.num_layers
    if where.startswith("eagle_config."):
        convs = [("SGLang", interop.sglang.convention_for(ctx.model_type, ctx.version)), ("SpecForge", "specforge")]
    else:
        convs = [("vLLM", "vllm")]
    out = []
    for who, conv in convs:
        try:
            taps = tuple(CONVENTIONS[conv].from_ids(ids, N))
        except TapError:
            continue
        if all(taps != t for _, t in out):
            out.append((who, taps))
    return out
