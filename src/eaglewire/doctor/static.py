"""Static checks: what the engine will really read from the draft directory (interop.read_engine_view)
against what the draft is (its recorded taps, config and tensors) and what the target is.

Each check returns findings; a finding's remedy does exactly what its fix says. Index rules come
only from eaglewire.taps (through the engine view and CONVENTIONS); this module compares.
"""

from __future__ import annotations

import torch

from ..errors import EaglewireError
from ..interop.common import NORM_FLAGS
from ..vocab import d2t_from_ids, t2d_from_d2t, validate_vocab
from .config_checks import check_config
from .context import Context, engine_name
from .engine_args import _int, with_option, with_speculative_config
from .findings import Finding, Remedy, finding
from .taps_checks import check_taps

# Norm flags whose absence engines read differently (docs/CONVENTIONS.md section 3).
AMBIGUOUS_WHEN_ABSENT = {
    "norm_before_residual": "vLLM reads a speculators config without it as true (update_eagle3), plain configs "
                            "and the speculators library as false, SGLang hard-codes false",
    "norm_output": "SpecForge (final norm before lm_head) and speculators/vLLM (post-norm state fed back) give it "
                   "different meanings",
}
_NOT_WEIGHTS = {"t2d"}  # skipped by design by SGLang and vLLM: never a dropped weight


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
    """SGLang 0.5.17: aux capture only for EAGLE3 and only when eagle_config.use_aux_hidden_state is not false
    (model_runner_components/spec_aux_hidden_state.py:80-88); without it the draft gets the target's last hidden
    state, and llama_eagle3.py:229 runs fc only when that width differs from the embedding's."""
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


def check_finite(ctx: Context) -> list[Finding]:
    """NaN or infinity anywhere in the stored weights (a diverged run, a bad cast): every engine loads them as they
    are, and a draft whose activations are NaN proposes tokens that are never accepted."""
    bad = [n for n, t in sorted(ctx.subject.dd.tensors.items())
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if not bad:
        return []
    return [finding("WEIGHTS_NONFINITE", "error", f"{len(bad)} weight tensor(s) hold NaN or infinity: {_few(bad)}",
                    "train again from the last checkpoint whose weights are finite (a lower learning rate, or "
                    "bf16/fp32 rather than fp16), then export again")]


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
        elif "draft_vocab_size" not in cfg:
            # llama_eagle3.py:295 and :307 (0.5.17; :224, :236 in 0.5.11) read `config.draft_vocab_size`, and
            # transformers' LlamaConfig (5.12.1, SGLang 0.5.17's pin) has no such attribute unless config.json sets it
            out.append(finding("LM_HEAD_REPLACED", "error", "draft_vocab_size is absent: SGLang fails to build the "
                               "draft (llama_eagle3.py reads config.draft_vocab_size, an AttributeError when "
                               "config.json has no such key); written as null it would load the TARGET's lm_head "
                               f"in place of the draft's own ({rows} rows)", "state the draft vocabulary size",
                               Remedy(config_set={"draft_vocab_size": rows}) if rows else None))
        elif v.lm_head_from_target:
            out.append(finding("LM_HEAD_REPLACED", "error", "draft_vocab_size is null: SGLang loads the TARGET's "
                               f"lm_head (full vocabulary) in place of the draft's own ({rows} rows) "
                               "(llama_eagle3.py:295-297 load_lm_head_from_target)", "state the draft vocabulary size",
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
    out += _sglang_window(ctx)
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


def _sglang_window(ctx: Context) -> list[Finding]:
    """SGLang 0.5.17 takes an EAGLE-3 draft's sliding window from --speculative-draft-window-size alone
    (models/llama_eagle3.py:276-288, LlamaForCausalLMEagle3.__init__); the config's window only records it."""
    run, cfg = ctx.run, ctx.subject.config
    window = cfg.sliding_window if cfg is not None else None
    if run.engine != "sglang" or window is None:
        return []
    asked = _int(run.given, "speculative-draft-window-size")
    if asked == window:
        return []
    used = "full attention" if asked is None else f"a window of {asked}"
    return [finding("ENGINE_ARGS_OVERRIDE", "warning", f"--speculative-draft-window-size: asked "
                    f"{'unset' if asked is None else asked}, the run will use {used}: the draft was trained with a "
                    f"sliding window of {window} positions, and SGLang takes the draft's window from this flag "
                    "alone", "serve with the draft's window",
                    Remedy(engine_args=with_option(ctx.engine_args, "speculative-draft-window-size", window)))]


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


CHECKS = (check_format, check_taps, check_fc, check_bypass, check_weights, check_finite, check_vocab, check_lm_head,
          check_embedding, check_norm_flags, check_config, check_engine_args, check_target)


def run_checks(ctx: Context) -> list[Finding]:
    findings = []
    for check in CHECKS:
        findings += check(ctx)
        if check is check_format and any(f.code == "NOT_ENGINE_FORMAT" for f in findings):
            ctx.view = None  # nothing else about this engine means anything until it can load the directory
    return findings

