"""Static checks: what the engine will really read from the draft directory (interop.read_engine_view)
against what the draft is (its recorded taps, config and tensors) and what the target is.

Each check returns findings; a finding's remedy does exactly what its fix says. Index rules come
only from eaglewire.taps (through the engine view and CONVENTIONS); this module compares.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import interop
from ..errors import EaglewireError, TapError
from ..interop.common import IDS_KEY, NORM_FLAGS
from ..taps import CONVENTIONS, TapContract
from ..vocab import d2t_from_ids, t2d_from_d2t, validate_vocab
from .engine_args import EngineRun, with_option, with_speculative_config
from .findings import Finding, Remedy, finding
from .subject import Subject, TargetFacts

# Norm flags whose absence engines read differently (docs/CONVENTIONS.md section 3).
AMBIGUOUS_WHEN_ABSENT = {
    "norm_before_residual": "vLLM reads a speculators config without it as true (update_eagle3), plain configs "
                            "and the speculators library as false, SGLang hard-codes false",
    "norm_output": "SpecForge (final norm before lm_head) and speculators/vLLM (post-norm state fed back) give it "
                   "different meanings",
}
_NOT_WEIGHTS = {"t2d"}  # skipped by design by SGLang and vLLM: never a dropped weight


@dataclass
class Context:
    subject: Subject
    target: TargetFacts | None  # loaded (--target) or from the draft's recorded fingerprint
    engine: str | None
    version: str | None  # the engine version the checks assume
    version_assumed: str  # how that version was chosen, in words
    view: interop.EngineView | None
    run: EngineRun | None
    engine_args: str | None

    @property
    def num_layers(self) -> int | None:
        n = self.target.num_layers if self.target else None
        if n is None and self.subject.contract is not None:
            n = self.subject.contract.num_layers
        return n

    @property
    def model_type(self) -> str | None:
        return self.target.model_type if self.target else None

    @property
    def loaded(self) -> bool:
        return bool(self.target and self.target.loaded)

    @property
    def convention(self) -> str | None:
        if self.engine == "sglang":
            return interop.sglang.convention_for(self.model_type, self.version)
        return "vllm" if self.engine else None

    @property
    def ids_key(self) -> str:
        return f"eagle_config.{IDS_KEY}" if self.engine == "sglang" else IDS_KEY

    @property
    def is_native(self) -> bool:
        return self.subject.kind == "native"


def engine_name(ctx: Context) -> str:
    return f"SGLang {ctx.view.engine_version}" if ctx.engine == "sglang" and ctx.view else (
        "vLLM" if ctx.engine == "vllm" else str(ctx.engine))


def ids_for(ctx: Context, taps) -> tuple[list[int] | None, str | None]:
    """Ids that make this engine capture `taps` -> (ids, None) or (None, why it cannot)."""
    try:
        return CONVENTIONS[ctx.convention].to_ids(tuple(taps), ctx.num_layers), None
    except TapError as e:
        return None, str(e)


def raw_taps(convention: str, ids: list[int]) -> tuple[int, ...]:
    """The taps a convention's rule maps ids to, before its range check (to tell out-of-range apart)."""
    conv = CONVENTIONS[convention]
    loose = dataclasses.replace(conv, lowest_tap=lambda n: -(1 << 30), highest_tap=lambda n: 1 << 30)
    return loose.from_ids(ids, 1)


def taps_remedy(ctx: Context, taps) -> Remedy | None:
    ids, _ = ids_for(ctx, taps)
    return Remedy(config_set={ctx.ids_key: ids}) if ids is not None else None


# --- format -----------------------------------------------------------------------------------------

def check_format(ctx: Context) -> list[Finding]:
    s, e = ctx.subject, ctx.engine
    if e is None:
        return []
    if ctx.is_native:
        out = f"{s.path}-{e}"
        return [finding("NOT_ENGINE_FORMAT", "error",
                        f"{s.path} is an eaglewire native checkpoint; {e} cannot load it as an EAGLE-3 draft",
                        "export it for the engine",
                        Remedy(commands=(("eaglewire", "export", "--draft", str(s.path), "--format", e,
                                          "--out", out),), then_doctor=out))]
    v = ctx.view
    if v is not None and not v.recognised:
        native = f"{s.path}-native"
        return [finding("NOT_ENGINE_FORMAT", "error", f"{engine_name(ctx)}: {v.problems[0]}",
                        f"convert it (exported for {s.kind})" if s.provenance else "convert it",
                        Remedy(commands=(("eaglewire", "import", "--from", str(s.path), "--out", native),
                                         ("eaglewire", "export", "--draft", native, "--format", e,
                                          "--out", f"{s.path}-{e}")), then_doctor=f"{s.path}-{e}"))]
    return []


# --- taps --------------------------------------------------------------------------------------------

def check_taps(ctx: Context) -> list[Finding]:
    s, v, N = ctx.subject, ctx.view, ctx.num_layers
    out = []
    if s.contract is not None and not s.recorded:
        what = (f"which taps it was trained on is {s.contract_from}" if s.contract_from.startswith("unknown")
                else f"the draft's taps {list(s.contract.taps)} are {s.contract_from}")
        out.append(finding("TAPS_UNVERIFIED", "warning", f"no tap record from eaglewire: {what}",
                           f"measure which taps it reads (`{' '.join(_probe_command(ctx))}`), or import the draft "
                           "with the --source it really came from"))
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
                               "retrain on 3 taps (vLLM's llama_eagle3.py fc is 3 taps wide)"))
    if not s.recorded and v.ids is None:
        truth = None  # what the engine reads says nothing of the trained taps: stated ids (if any) are the evidence
    if truth is not None and ctx.engine == "vllm" and (0 in truth or N in truth):
        out.append(finding("TAPS_UNSUPPORTED", "info", f"taps {list(truth)} include the embedding (0) or the last "
                           f"layer's output ({N}): vLLM captures those only with EagleModelMixin (PR #36063; "
                           "DeepSeek-family targets: PR #46973); older vLLM returns fewer hidden states",
                           "serve it with a vLLM release that includes those pull requests"))
    remedy = taps_remedy(ctx, truth) if truth is not None else None
    if v.ids is None:
        return out + _missing(ctx, truth, remedy)
    raw = raw_taps(ctx.convention, v.ids)
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


def _unsupported(ctx: Context, truth, why: str) -> Finding:
    if ctx.engine == "sglang":
        fix = ("serve it with vLLM, which captures every tap 0..N by id (vLLM with EagleModelMixin, PR #36063): "
               "export the native checkpoint with --format vllm")
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
        remedy = Remedy(commands=(_probe_command(ctx),))
    if ignored is not None:
        where, ids = ignored
        return [finding("TAPS_WRONG_PLACE", sev, f"layer ids {ids} are under {where}, which {name} never reads "
                        f"(it reads only {key}): {fallback}", "put them where the engine reads them", remedy)]
    fix = "write the ids explicitly" if truth is not None else "measure which taps it reads"
    return [finding("TAPS_MISSING", sev, f"no {key} in config.json{quirk}: {fallback}", fix, remedy)]


def _stated_elsewhere(ctx: Context, where: str, ids: list[int], default, fallback: str) -> Finding:
    """No record: ids under a key this engine never reads still state which taps were meant, in the
    convention of the engines that read that key."""
    name, key = engine_name(ctx), ctx.ids_key
    readings = stated_taps(ctx, where, ids)
    said = " or ".join(f"taps {list(t)} as {who} reads them" for who, t in readings) or "no taps this target has"
    agree = default is not None and any(tuple(t) == tuple(default) for _, t in readings)
    msg = f"layer ids {ids} are under {where}, which {name} never reads (it reads only {key}); they state {said}"
    one = {tuple(t) for _, t in readings}
    remedy = taps_remedy(ctx, next(iter(one))) if len(one) == 1 else None
    if agree:
        return finding("TAPS_WRONG_PLACE", "warning", f"{msg}: {fallback}, the same taps, reached only through its "
                       "default", "put them where the engine reads them", remedy)
    return finding("TAPS_WRONG_PLACE", "error", f"{msg}, but {fallback}",
                   "write the stated taps where the engine reads them" if remedy else
                   "find out which convention wrote them, then write the ids where the engine reads them "
                   f"(measure with `{' '.join(_probe_command(ctx))}`)", remedy)


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


def _probe_command(ctx: Context) -> tuple[str, ...]:
    target = ctx.target.spec if ctx.target is not None and ctx.target.spec else "TARGET"
    return ("eaglewire", "doctor", "--draft", str(ctx.subject.path), "--target", target, "--engine",
            str(ctx.engine), "--probe", "32")


# --- fc ----------------------------------------------------------------------------------------------

def check_fc(ctx: Context) -> list[Finding]:
    s, v = ctx.subject, ctx.view
    fc = s.dd.tensors.get("fc.weight")
    if fc is None or fc.dim() != 2:
        return []
    width, out = int(fc.shape[1]), []
    n = len(s.contract.taps) if s.contract else (s.config.num_taps if s.config else None)
    ht = ctx.target.hidden_size if ctx.loaded else (s.config.target_hidden_size if s.config else None)
    own = paired_width(ctx)
    if own is not None:  # the draft's files agree with each other: the pairing is wrong, not the draft
        return [finding("TARGET_MISMATCH", "error", f"the draft reads {n} taps {own} wide (fc.weight is {width} = "
                        f"{n} x {own}), the target {ctx.target.spec} has hidden size {ht}",
                        "pass the target the draft was trained for, or train a draft for this one")]
    if n and ht and width != n * ht:
        hint = (" (as wide as ONE hidden state: an EAGLE-1/2 draft, which has no fusion)" if width == ht else
                f" (= {width // ht} taps)" if width % ht == 0 else "")
        return [finding("FC_SHAPE", "error", f"fc.weight input width {width} != {n} taps x target hidden size {ht} "
                        f"= {n * ht}{hint}",
                        "this draft was built for another target or tap count: retrain it for this one")]
    if n and v is not None and n != v.num_aux_expected:
        return out  # TAPS_UNSUPPORTED says the engine builds fc for another tap count
    if v is not None and v.recognised and v.target_hidden_size and width != v.num_aux_expected * v.target_hidden_size:
        cfg, remedy = s.dd.config, None
        if n and width % n == 0 and v.num_aux_expected == n and "target_hidden_size" not in cfg:
            remedy = Remedy(config_set={"target_hidden_size": width // n})
        out.append(finding("FC_SHAPE", "error", f"{engine_name(ctx)} builds fc for {v.num_aux_expected} taps x "
                           f"{v.target_hidden_size} = {v.num_aux_expected * v.target_hidden_size} inputs, but "
                           f"fc.weight is {width} wide" + (" (config.json has no target_hidden_size, so the engine "
                                                           "uses hidden_size)" if remedy else ""),
                           "state the target's hidden size" if remedy else "re-export the draft with eaglewire",
                           remedy))
    return out


def paired_width(ctx: Context) -> int | None:
    """The width of the hidden states the draft reads, when the draft's files agree on it (fc.weight = taps x
    target_hidden_size) but a loaded target's hidden size differs; else None."""
    s = ctx.subject
    fc = s.dd.tensors.get("fc.weight")
    if not ctx.loaded or s.config is None or fc is None or fc.dim() != 2:
        return None
    own, n = s.config.target_hidden_size, (len(s.contract.taps) if s.contract else s.config.num_taps)
    ht = ctx.target.hidden_size
    return own if ht and own != ht and int(fc.shape[1]) == n * own else None


def check_bypass(ctx: Context) -> list[Finding]:
    out, name = [], engine_name(ctx)
    nested = ctx.subject.dd.config.get("eagle_config")
    if ctx.engine and isinstance(nested, dict) and nested.get("use_aux_hidden_state") is False:
        out.append(finding("FC_BYPASS", "error",
                           f"eagle_config.use_aux_hidden_state is false: {name} captures no taps and feeds the draft "
                           "the target's last hidden state (one hidden size wide), so the fc fusion is skipped "
                           "(SGLang llama_eagle3.py applies fc only when the width differs)",
                           "turn aux hidden states on", Remedy(config_set={"eagle_config.use_aux_hidden_state": True})))
    run = ctx.run
    if run is None or run.algorithm is None or run.is_eagle3 or run.algorithm == "none":
        return out
    if run.engine == "sglang":
        fixed = with_option(ctx.engine_args, "speculative-algorithm", "EAGLE3")
        msg = (f"--speculative-algorithm {run.algorithm}: SGLang runs the EAGLE-1/2 path, captures no taps and feeds "
               "the draft one hidden state, so llama_eagle3.py skips fc (hidden width == embedding width): "
               "acceptance length ~1.0")
    else:
        fixed = with_speculative_config(ctx.engine_args, method="eagle3")
        msg = (f"speculative_config method {run.algorithm!r}: vLLM does not run this directory as an EAGLE-3 "
               "draft over the fused taps")
    out.append(finding("FC_BYPASS", "error", msg, "run it as EAGLE-3", Remedy(engine_args=fixed)))
    return out


# --- weights, vocabulary, lm_head, embedding -----------------------------------------------------

def _rename_candidates(name: str):
    yield name.replace("layers.0.", "midlayer.")
    yield name.replace("midlayer.", "layers.0.")
    yield name.removeprefix("model.")
    yield {"fc_input_norm.weight": "input_norm.weight", "input_norm.weight": "fc_input_norm.weight"}.get(name, name)


def check_weights(ctx: Context) -> list[Finding]:
    v = ctx.view
    if v is None or not v.recognised:
        return []
    cfg = ctx.subject.dd.config
    dropped = [n for n in v.weights_dropped if n not in _NOT_WEIGHTS
               and not (n == "lm_head.weight" and cfg.get("tie_word_embeddings"))]  # LM_HEAD_REPLACED says it
    missing = [n for n in v.weights_missing if n != "lm_head.weight" or not cfg.get("tie_word_embeddings")]
    if not dropped and not missing:
        return []
    renames = {}
    for n in dropped:
        target = next((c for c in _rename_candidates(n) if c != n and c in missing), None)
        if target:
            renames[n] = target
    left = [m for m in missing if m not in renames.values()]
    how = "silently drops" if ctx.engine == "sglang" else "refuses (its loader raises on)"
    parts = []
    if dropped:
        parts.append(f"{engine_name(ctx)} {how} {len(dropped)} weight(s) it has no parameter for: {_few(dropped)}")
    if missing:
        parts.append(f"it needs {_few(missing)}, which the directory lacks (those parameters keep their random "
                     "initialisation)")
    remedy = Remedy(renames=renames) if renames and not left else None
    fix = "rename them to the engine's names" if remedy else (
        "export the draft again with eaglewire (it writes every name the engine requires)")
    return [finding("WEIGHTS_DROPPED", "error", "; ".join(parts), fix, remedy)]


def _few(names: list[str], k: int = 4) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def _vocab_size(ctx: Context) -> int | None:
    t = ctx.subject.dd.tensors
    if ctx.loaded:
        return ctx.target.vocab_size
    if "t2d" in t:
        return t["t2d"].numel()
    return (ctx.subject.config.vocab_size if ctx.subject.config else None) or ctx.subject.dd.config.get("vocab_size")


def check_vocab(ctx: Context) -> list[Finding]:
    t = ctx.subject.dd.tensors
    d2t, t2d, head = t.get("d2t"), t.get("t2d"), t.get("lm_head.weight")
    V = _vocab_size(ctx)
    if V is None:
        return []
    if d2t is None:
        if head is not None and head.shape[0] != V:
            return [finding("D2T_INVALID", "error", f"no d2t, but lm_head predicts {head.shape[0]} draft tokens of a "
                            f"{V}-token target vocabulary: engines would read draft id i as target id i",
                            "export the draft with eaglewire, which always writes d2t (offsets) and t2d")]
        return []
    d2t = d2t.long()
    t2d = t2d.bool() if t2d is not None else None
    try:
        validate_vocab(d2t, t2d, V, where="d2t/t2d")
        return []
    except EaglewireError as e:
        msg = str(e)
    remedy = None
    if "absolute target ids" in msg:
        fixed = d2t_from_ids(d2t)  # the stored table holds target ids: make them offsets
        remedy = Remedy(tensors={"d2t": fixed.to(t["d2t"].dtype)}, why="offsets, d2t - arange(len(d2t))")
    elif t2d is not None and _valid(d2t, None, V):
        remedy = Remedy(tensors={"t2d": t2d_from_d2t(d2t, V)}, why="the mask of the target ids d2t maps to")
    return [finding("D2T_INVALID", "error", msg + " (every engine reads target_id = draft_id + d2t[draft_id])",
                    "" if remedy else "import the draft again from its source (eaglewire import rebuilds d2t/t2d)",
                    remedy)]


def _valid(d2t, t2d, V) -> bool:
    try:
        validate_vocab(d2t, t2d, V)
        return True
    except EaglewireError:
        return False


def check_lm_head(ctx: Context) -> list[Finding]:
    s, v, out = ctx.subject, ctx.view, []
    cfg, t = s.dd.config, s.dd.tensors
    head, d2t = t.get("lm_head.weight"), t.get("d2t")
    rows = int(head.shape[0]) if head is not None else None
    if ctx.engine == "sglang" and v is not None and v.recognised:
        if cfg.get("tie_word_embeddings"):
            out.append(finding("LM_HEAD_REPLACED", "error", "tie_word_embeddings is true: SGLang's "
                               "LlamaForCausalLMEagle3 uses the (target's) embedding as lm_head and drops "
                               "lm_head.weight", "untie it", Remedy(config_set={"tie_word_embeddings": False})))
        elif v.lm_head_from_target:
            out.append(finding("LM_HEAD_REPLACED", "error", "draft_vocab_size is absent: SGLang loads the TARGET's "
                               f"lm_head (full vocabulary) in place of the draft's own ({rows} rows) "
                               "(llama_eagle3.py load_lm_head_from_target)", "state the draft vocabulary size",
                               Remedy(config_set={"draft_vocab_size": rows}) if rows else None))
    key = "draft.draft_vocab_size" if ctx.is_native else "draft_vocab_size"
    dvs = (s.config.draft_vocab_size if ctx.is_native and s.config else None) or cfg.get("draft_vocab_size")
    if rows and dvs and rows != dvs:
        fits = d2t is not None and d2t.numel() == rows
        out.append(finding("LM_HEAD_REPLACED", "error", f"lm_head.weight has {rows} rows but {key} is {dvs}: the "
                           "engine builds an lm_head of the configured size", "state the true size" if fits else
                           "export the draft again with eaglewire", Remedy(config_set={key: rows}) if fits else None))
    elif rows and d2t is not None and d2t.numel() != rows:
        out.append(finding("LM_HEAD_REPLACED", "error", f"lm_head.weight has {rows} rows but d2t maps {d2t.numel()} "
                           "draft tokens", "export the draft again with eaglewire"))
    return out


def check_embedding(ctx: Context) -> list[Finding]:
    v = ctx.view
    stored = ctx.subject.dd.tensors.get("embed_tokens.weight")
    if v is None or not v.recognised or not v.embedding_replaced or stored is None or not ctx.loaded:
        return []
    emb = ctx.target.embedding()
    if tuple(stored.shape) == tuple(emb.shape):
        diff = (stored.float() - emb).abs().max().item()
        if diff <= 1e-2 * max(emb.abs().max().item(), 1e-6):  # bf16 storage rounds by ~0.4%
            return []
        what = f"differs from the target's (max |diff| {diff:.3g})"
    else:
        what = f"has shape {tuple(stored.shape)}, the target's {tuple(emb.shape)}"
    return [finding("EMBED_MISMATCH", "error", f"the draft's embed_tokens.weight {what}, and {engine_name(ctx)} "
                    "replaces it with the target's: the draft will see other token vectors than it was trained on",
                    "retrain with the target's embedding (eaglewire train copies and freezes it), or serve with "
                    "vLLM, which keeps a stored embedding that differs from the target's")]


# --- norm flags ------------------------------------------------------------------------------------

def check_norm_flags(ctx: Context) -> list[Finding]:
    v, s, out = ctx.view, ctx.subject, []
    if v is None or not v.recognised:
        return out
    truth = s.config if s.recorded else None
    for f in NORM_FLAGS:
        fv = v.norm_flags.get(f)
        if fv is None:
            continue
        want = getattr(truth, f) if truth is not None else None
        key = fv.where or f
        if not fv.supported or (want and fv.engine_default is None):
            out.append(finding("NORM_UNSUPPORTED", "error", f"the draft needs {f}=true but {engine_name(ctx)} "
                               "hard-codes the false behaviour", "serve it with vLLM (export with --format vllm)"
                               if ctx.engine == "sglang" else "retrain without it"))
        elif want is not None and fv.effective != want:
            code = "NORM_FLAGS_IMPLICIT" if fv.written is None else "NORM_FLAG_MISMATCH"
            said = (f"{f} is absent and {engine_name(ctx)} assumes {fv.engine_default}" if fv.written is None else
                    f"config.json says {key}={fv.written}")
            out.append(finding(code, "error", f"{said}, but the draft was trained with {f}={want}",
                               "write the trained value", Remedy(config_set={key: want})))
        elif fv.written is None and f in AMBIGUOUS_WHEN_ABSENT and fv.engine_default is not None:
            out.append(finding("NORM_FLAGS_IMPLICIT", "warning", f"{f} is absent: {engine_name(ctx)} assumes "
                               f"{fv.engine_default}, but {AMBIGUOUS_WHEN_ABSENT[f]}", "write it explicitly",
                               Remedy(config_set={f: want if want is not None else fv.effective})))
    return out


# --- engine arguments and target ---------------------------------------------------------------------

def check_engine_args(ctx: Context) -> list[Finding]:
    run, out = ctx.run, []
    if run is None:
        return out
    for o in run.overrides:
        if o.setting == "speculative_config.method" and o.used != "eagle3":
            continue  # FC_BYPASS says it
        remedy = None
        if o.setting == "--speculative-num-draft-tokens":
            remedy = Remedy(engine_args=with_option(ctx.engine_args, "speculative-num-draft-tokens", o.used))
            fix = (f"ask for what will run (or, for {o.requested} draft tokens, build a tree: "
                   "--speculative-eagle-topk > 1)")
        elif o.setting.startswith("--speculative-num-steps/"):
            steps, topk, ndt = o.used
            args = ctx.engine_args
            for name, val in (("speculative-num-steps", steps), ("speculative-eagle-topk", topk),
                              ("speculative-num-draft-tokens", ndt)):
                args = with_option(args, name, val)
            remedy, fix = Remedy(engine_args=args), "write them explicitly"
        elif o.setting == "--speculative-algorithm" and o.used == "none":
            remedy = Remedy(engine_args=with_option(ctx.engine_args, "speculative-algorithm", "EAGLE3"))
            fix = "turn EAGLE-3 speculation on"
        elif o.setting == "--speculative-config" and o.used == "none":
            remedy = Remedy(engine_args=with_speculative_config(
                ctx.engine_args, method="eagle3", model=str(ctx.subject.path), num_speculative_tokens=3))
            fix = "turn EAGLE-3 speculation on"
        elif o.setting == "--speculative-token-map":
            remedy = Remedy(engine_args=_without(ctx.engine_args, "speculative-token-map"))
            fix = "drop the argument"
        else:
            fix = "state the setting explicitly"
        shown = "unset" if o.requested is None else o.requested
        out.append(finding("ENGINE_ARGS_OVERRIDE", o.severity, f"{o.setting}: asked {shown}, the run will use "
                           f"{o.used}: {o.why}", fix, remedy))
    for r in run.refusals:
        args = ctx.engine_args
        if run.engine == "vllm":
            args = with_speculative_config(args, **r.fix)
        else:
            for name, value in r.fix.items():
                args = with_option(args, name, value)
        out.append(finding("ENGINE_ARGS_REFUSED", "error", f"{engine_name(ctx)} will refuse to start: {r.why}",
                           "change them", Remedy(engine_args=args)))
    return out


def _without(text: str, option: str) -> str:
    import shlex

    toks, out, i = shlex.split(text), [], 0
    while i < len(toks):
        t = toks[i]
        if t.startswith("--") and t[2:].partition("=")[0].replace("_", "-") == option:
            i += 1 if "=" in t or i + 1 >= len(toks) or toks[i + 1].startswith("--") else 2
            continue
        out.append(t)
        i += 1
    return shlex.join(out)


STRUCTURAL = ("architecture", "model_type", "num_layers", "hidden_size", "vocab_size", "tokenizer_hash")


def check_target(ctx: Context) -> list[Finding]:
    if not ctx.loaded:
        return []
    rec, live = ctx.subject.recorded_target or {}, ctx.target.fingerprint
    out = []
    for k, want in rec.items():
        got = live.get(k)
        if want is None or got is None or got == want or k not in STRUCTURAL + ("weights_hash", "chat_template_hash"):
            continue
        if k == "hidden_size" and paired_width(ctx) is not None:
            continue  # check_fc names both widths
        sev = "error" if k in STRUCTURAL else "warning"
        out.append(finding("TARGET_MISMATCH", sev, f"--target {ctx.target.spec}: {k} is {got!r}, the draft was "
                           f"{'trained' if ctx.subject.recorded else 'made'} for {want!r}",
                           "pass the target the draft was trained for"
                           + (" (same weights: another checkpoint or quantisation of it changes the hidden states)"
                              if k == "weights_hash" else "") + ", or retrain the draft for this target"))
    return out


CHECKS = (check_format, check_taps, check_fc, check_bypass, check_weights, check_vocab, check_lm_head,
          check_embedding, check_norm_flags, check_engine_args, check_target)


def run_checks(ctx: Context) -> list[Finding]:
    findings = []
    for check in CHECKS:
        findings += check(ctx)
        if check is check_format and any(f.code == "NOT_ENGINE_FORMAT" for f in findings):
            ctx.view = None  # nothing else about this engine means anything until it can load the directory
    return findings


def contract_ids_remedy(ctx: Context, taps) -> tuple[str, Remedy | None]:
    """For the probe: the config change that makes the engine capture `taps` (and records them)."""
    taps = tuple(taps)
    if ctx.engine is None or ctx.view is None:
        if ctx.is_native and ctx.num_layers:
            c = TapContract(ctx.num_layers, tuple(sorted(taps)))
            return "record the taps this draft reads", Remedy(config_set={"taps": c.to_dict()})
        return "feed it these taps", None
    ids, why = ids_for(ctx, taps)
    if ids is None:
        return f"{engine_name(ctx)} cannot be configured to capture them ({why})", None
    sets = {ctx.ids_key: ids}
    if ctx.subject.provenance is not None and ctx.subject.contract and tuple(ctx.subject.contract.taps) != taps:
        sets["eaglewire.taps"] = TapContract(ctx.num_layers, taps).to_dict()  # the record was wrong too
    return f"make {engine_name(ctx)} capture them", Remedy(config_set=sets)
