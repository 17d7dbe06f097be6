"""Static checks of the architecture fields an engine builds the draft from: config.json beyond the taps,
the fc, the norm flags and the vocabulary maps. They are checked against the draft's own tensors, its
training record and its target. docs/DOCTOR.md "Architecture fields" has the table with the engines'
file:line.

Both engines build the draft's config with transformers' LlamaConfig, then read it (SGLang 0.5.17
models/llama.py:293-339 and llama_eagle3.py:124-198; vLLM 0.26.0 models/llama.py:155-156, 240-245,
262-287 and llama_eagle3.py:139-221); a speculators directory is read from `transformer_layer_config`
(vLLM transformers_utils/configs/speculators/base.py:61). `engine_value` reads a field as that chain does.
"""

from __future__ import annotations

from ..interop import vllm as vllm_fmt
from .context import Context, engine_name, probe_command
from .findings import Finding, Remedy, finding

# LlamaConfig's defaults for absent fields (transformers 5.x configuration_llama.py); rope theta 10000 is
# also the engines' own fallback (SGLang llama.py:296/299).
LLAMA_DEFAULTS = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
                  "num_hidden_layers": 32, "vocab_size": 32000, "max_position_embeddings": 2048,
                  "rms_norm_eps": 1e-6, "hidden_act": "silu"}
INT_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_hidden_layers", "vocab_size", "max_position_embeddings")
# Not LlamaConfig fields: nothing validates them before the engine uses them as sizes.
EAGLE_INT_FIELDS = ("draft_vocab_size", "target_hidden_size")
FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
MISSING = object()


def layer_config(ctx: Context) -> tuple[dict, str]:
    """(the dict the engine builds the layer from, its key prefix for a Remedy)."""
    cfg = ctx.subject.dd.config
    if vllm_fmt.is_speculators(cfg) and isinstance(cfg.get("transformer_layer_config"), dict):
        return cfg["transformer_layer_config"], "transformer_layer_config."
    return cfg, ""


def _rope(layer: dict) -> tuple[object, str, dict | None]:
    """(theta, where it is read, scaling) as transformers 5 standardises them: rope_parameters wins over a
    top-level rope_theta (tested on LlamaConfig: both written, rope_parameters' theta is used)."""
    rp = layer.get("rope_parameters")
    rp = rp if isinstance(rp, dict) else (layer.get("rope_scaling") if isinstance(layer.get("rope_scaling"), dict)
                                          else None)
    key = "rope_parameters" if isinstance(layer.get("rope_parameters"), dict) else "rope_scaling"
    if rp is not None and "rope_theta" in rp:
        theta, where = rp["rope_theta"], f"{key}.rope_theta"
    else:
        theta, where = layer.get("rope_theta", 10000.0), "rope_theta"
    scaling = None
    if rp is not None:
        kind = rp.get("rope_type") or rp.get("type") or "default"
        if kind != "default":
            scaling = {k: v for k, v in rp.items() if k not in ("rope_theta", "type")} | {"rope_type": kind}
    return theta, where, scaling


def engine_value(layer: dict, field: str):
    """A field as the engine will have it after LlamaConfig: absent -> its default (MISSING where none)."""
    v = layer.get(field)
    if v is not None:
        return v
    if field == "num_key_value_heads":
        return engine_value(layer, "num_attention_heads")
    if field == "head_dim":
        h, n = engine_value(layer, "hidden_size"), engine_value(layer, "num_attention_heads")
        return h // n if _is_int(h) and _is_int(n) and n else MISSING
    return LLAMA_DEFAULTS.get(field, MISSING)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_config(ctx: Context) -> list[Finding]:
    """Every architecture field the engine reads. Only for engine-format directories the engine recognises."""
    v = ctx.view
    if ctx.is_native or v is None or not v.recognised:
        return []
    layer, prefix = layer_config(ctx)
    out = _types(ctx, layer, prefix)
    if out:
        return out  # the engine stops at the config: nothing else it would build means anything
    shaped, fields = _against_tensors(ctx, layer, prefix)
    out += shaped + _against_record(ctx, layer, prefix, skip=fields)
    out += _against_target(ctx, layer, prefix, skip=fields)
    return out + _dtype(ctx)


def _dtype(ctx: Context) -> list[Finding]:
    """SGLang builds the draft in the dtype the draft's own config states, through its --dtype (default auto).
    None, or float32, becomes float16 (0.5.17 configs/model_config.py:494, 531-561, 1655-1684), beside a target
    that usually runs in bf16. vLLM builds the draft in the target's dtype. What float16 costs a bf16-trained draft
    was not measured, so this is a warning."""
    if ctx.engine != "sglang":
        return []
    cfg = ctx.subject.dd.config
    said = cfg.get("dtype") or cfg.get("torch_dtype")
    if said not in (None, "float32", "float"):
        return []
    what = "states no dtype" if said is None else f"states {said}"
    return [finding("CONFIG_DRIFT", "warning", f"config.json {what}: with its default --dtype auto, SGLang builds "
                    "the draft in float16 (configs/model_config.py:1663-1684), whatever the target runs in",
                    'write "torch_dtype": "bfloat16" in config.json (eaglewire export does), or serve with '
                    "--dtype bfloat16")]


# --- types ----------------------------------------------------------------------------------------

def _types(ctx: Context, layer: dict, prefix: str) -> list[Finding]:
    cfg, out = ctx.subject.dd.config, []
    fields = [(f, layer, prefix, "int") for f in INT_FIELDS] + [(f, layer, prefix, "float") for f in FLOAT_FIELDS]
    fields += [(f, cfg, "", "int") for f in EAGLE_INT_FIELDS]
    for f, holder, pre, kind in fields:
        if f not in holder or holder[f] is None:
            continue
        val = holder[f]
        ok = _is_int(val) if kind == "int" else _is_num(val)
        if ok:
            continue
        fixed = _coerce(val, kind)
        if f in EAGLE_INT_FIELDS:
            what = (f"no config class validates it: {engine_name(ctx)} uses it as a size "
                    + ("(llama_eagle3.py fc width, target_hidden_size * num_aux)" if f == "target_hidden_size"
                       else "(the lm_head's rows)") + " and fails building the draft")
        elif f == "rope_theta":
            what = ("transformers' LlamaConfig keeps it as written; the engine's rotary embedding raises on "
                    "base ** (...) with a non-number when it builds the draft")
        else:
            what = (f"transformers' LlamaConfig refuses it ({'int' if kind == 'int' else 'float'} field, "
                    "StrictDataclassFieldValidationError): the engine fails loading the draft's config")
        out.append(finding("CONFIG_TYPE", "error", f"{pre}{f} is {val!r} ({type(val).__name__}): {what}",
                           "write it as a number" if fixed is not MISSING else "write the number the draft was "
                           "built with", Remedy(config_set={pre + f: fixed}) if fixed is not MISSING else None))
    act = layer.get("hidden_act", "silu")
    if act != "silu":  # SGLang llama.py:104-107, vLLM llama.py:109-111: LlamaMLP raises on anything else
        trained = ctx.subject.config.hidden_act if ctx.subject.recorded and ctx.subject.config else None
        other = trained not in (None, "silu")  # trained with it: writing silu would change the arithmetic
        out.append(finding("CONFIG_TYPE", "error", f"{prefix}hidden_act is {act!r}: {engine_name(ctx)}'s LlamaMLP "
                           "raises 'Unsupported activation' for anything but silu, so loading the draft fails",
                           "retrain the draft with silu" if other else "write silu",
                           None if other else Remedy(config_set={prefix + "hidden_act": "silu"})))
    rp = layer.get("rope_parameters", layer.get("rope_scaling"))
    if rp is not None and not isinstance(rp, dict):
        out.append(finding("CONFIG_TYPE", "error", f"{prefix}rope_parameters/rope_scaling is {rp!r}: the engines "
                           "read it as a dict (SGLang llama.py:294-300 `.get`), so loading the draft fails",
                           "write null or an object"))
    return out


def _coerce(val, kind):
    try:
        x = float(val) if isinstance(val, str) else val
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            return MISSING
        if kind == "int":
            return int(x) if float(x).is_integer() and x > 0 else MISSING
        return float(x)
    except (TypeError, ValueError):
        return MISSING


# --- the draft's own tensors ----------------------------------------------------------------------

def _tensors(ctx: Context) -> dict:
    """Stored tensors under one naming (layers.0.*, no `model.` prefix)."""
    return {k.removeprefix("model.").replace("midlayer.", "layers.0."): t for k, t in ctx.subject.dd.tensors.items()}


def _against_tensors(ctx: Context, layer: dict, prefix: str) -> tuple[list[Finding], set[str]]:
    """Each engine builds its parameters from the config and its weight loader copies the stored tensor into
    them: a size that disagrees fails the load (default_weight_loader asserts equal sizes in both engines).
    -> (findings, the fields they name)."""
    t, out = _tensors(ctx), []
    H, inter = engine_value(layer, "hidden_size"), engine_value(layer, "intermediate_size")
    nh, nkv, hd = (engine_value(layer, f) for f in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    V = engine_value(layer, "vocab_size")

    def rows(name, dim=0):
        x = t.get(name)
        return int(x.shape[dim]) if x is not None and x.dim() > dim else None

    # (field, the value the engine uses, what the tensors say it is, the evidence, a single field to set)
    checks = [("hidden_size", H, rows("norm.weight"), "norm.weight", True),
              ("hidden_size", H, rows("fc.weight"), "fc.weight's output rows", True),
              ("intermediate_size", inter, rows("layers.0.mlp.gate_proj.weight"), "layers.0.mlp.gate_proj.weight",
               True)]
    if _is_int(nh) and _is_int(hd):
        checks.append(("num_attention_heads x head_dim", nh * hd, rows("layers.0.self_attn.q_proj.weight"),
                       "layers.0.self_attn.q_proj.weight", False))
    if _is_int(nkv) and _is_int(hd):
        checks.append(("num_key_value_heads x head_dim", nkv * hd, rows("layers.0.self_attn.k_proj.weight"),
                       "layers.0.self_attn.k_proj.weight", False))
    if "embed_tokens.weight" in t:  # loaded before the engine swaps in the target's (SGLang set_embed)
        checks.append(("vocab_size", V, rows("embed_tokens.weight"), "embed_tokens.weight", True))
    stored = {int(k.split(".")[1]) for k in t if k.startswith("layers.") and k.split(".")[1].isdigit()}
    n = engine_value(layer, "num_hidden_layers")
    if stored and _is_int(n) and n != max(stored) + 1:
        # SGLang llama_eagle3.py:193 / vLLM llama_eagle3.py:172 build num_hidden_layers layers: SGLang leaves
        # layers without weights at their random initialisation, vLLM refuses unloaded parameters
        # (model_loader/default_loader.py:465-470) and unknown names (llama_eagle3.py load_weights)
        checks.append(("num_hidden_layers", n, max(stored) + 1, "the stored layers.N.* count", True))
    seen = set()
    for field, want, got, evidence, settable in checks:
        if got is None or want is MISSING or want == got or field in seen:
            continue
        seen.add(field)
        absent = field in LLAMA_DEFAULTS and field not in layer
        said = (f"{prefix}{field} is absent (LlamaConfig's default {want})" if absent
                else f"{prefix}{field} is {want}")
        what = (f"the directory holds {got} draft layer(s): {engine_name(ctx)} builds {want}, and "
                + ("leaves the ones without weights at random initialisation" if ctx.engine == "sglang" and want > got
                   else "drops the extra ones" if ctx.engine == "sglang" else "refuses parameters it cannot load")
                if field == "num_hidden_layers" else
                f"{evidence} is {got} wide: {engine_name(ctx)} builds that parameter from the config and refuses "
                "the stored tensor at load (its weight loader asserts equal shapes)")
        out.append(finding("CONFIG_SHAPE", "error", f"{said}, but {what}",
                           "state the size the tensors have" if settable else
                           "state num_attention_heads, num_key_value_heads and head_dim as the draft was built",
                           Remedy(config_set={prefix + field: got}) if settable else None))
    return out, seen


# --- the training record --------------------------------------------------------------------------

def _recorded_fields(c) -> dict:
    """The engine-read fields of a DraftConfig, in config.json's names."""
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
            "hidden_act": c.hidden_act}


def _against_record(ctx: Context, layer: dict, prefix: str, skip=frozenset()) -> list[Finding]:
    """An export carries the DraftConfig it was trained with; a field edited since runs other arithmetic.
    skip: fields CONFIG_SHAPE already names (the same fix)."""
    s = ctx.subject
    if not s.recorded or s.config is None:
        return []  # a foreign draft's config is read from this very file: nothing to compare
    out = []
    for field, want in _recorded_fields(s.config).items():
        got = engine_value(layer, field)
        if got is MISSING or _same(got, want) or field in skip:
            continue
        if field == "hidden_act" and want != "silu":
            out.append(finding("CONFIG_DRIFT", "error", f"the draft was trained with hidden_act={want!r} (its "
                               f"eaglewire record); {engine_name(ctx)} runs only silu (LlamaMLP raises on others), "
                               f"and config.json says {got!r}", "retrain the draft with silu"))
            continue
        absent = field not in layer or layer[field] is None
        said = f"{prefix}{field} is " + (f"absent ({engine_name(ctx)} uses {got})" if absent else f"{got!r}")
        out.append(finding("CONFIG_DRIFT", "error", f"{said}, but the draft was trained with {field}={want!r} "
                           f"(its eaglewire record): {_consequence(field)}", "write the trained value",
                           Remedy(config_set={prefix + field: want})))
    theta, where, scaling = _rope(layer)
    c = s.config
    if _is_num(theta) and not _same(theta, c.rope_theta):
        out.append(finding("CONFIG_DRIFT", "error", f"{prefix}{where} is {theta!r}, but the draft was trained with "
                           f"rope_theta={c.rope_theta!r} (its eaglewire record): {_consequence('rope_theta')}",
                           "write the trained value", Remedy(config_set={prefix + where: c.rope_theta})))
    if not _same_scaling(scaling, c.rope_scaling):
        out.append(finding("CONFIG_DRIFT", "error", f"{prefix}rope scaling reads as {scaling!r}, but the draft was "
                           f"trained with {c.rope_scaling!r} (its eaglewire record): {_consequence('rope_theta')}",
                           "write the trained scaling", Remedy(
                               config_set={prefix + "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None},
                               config_delete=(prefix + "rope_parameters",))))
    return out


def _same(a, b) -> bool:
    if _is_num(a) and _is_num(b):
        return abs(float(a) - float(b)) <= 1e-9 * max(abs(float(a)), abs(float(b)), 1e-30)
    return a == b


def _same_scaling(a: dict | None, b: dict | None) -> bool:
    if not a or not b:
        return not a and not b
    keys = set(a) | set(b)
    return all(_same(a.get(k), b.get(k)) for k in keys)


def _consequence(field: str) -> str:
    return {"rms_norm_eps": "every RMSNorm of the draft divides by another epsilon",
            "rope_theta": "the draft's attention rotates queries and keys at other frequencies than in training",
            "max_position_embeddings": "the engine sizes the draft's rotary cache (SGLang) or caps its max_model_len "
                                       "(vLLM) from it",
            "hidden_act": "the draft's MLP runs another activation",
            }.get(field, "the engine builds the draft with other shapes than it was trained with")


# --- the target ------------------------------------------------------------------------------------

def _target_config(ctx: Context):
    if not ctx.loaded:
        return None
    from ..targets import text_config

    return text_config(ctx.target.loaded.model.config)


def _against_target(ctx: Context, layer: dict, prefix: str, skip=frozenset()) -> list[Finding]:
    out, s = [], ctx.subject
    V = engine_value(layer, "vocab_size")
    tv = ctx.target.vocab_size if ctx.loaded else (int(s.dd.tensors["t2d"].numel()) if "t2d" in s.dd.tensors
                                                    else None)
    if _is_int(V) and tv and V != tv and ctx.engine == "vllm" and "vocab_size" not in skip:
        # vLLM llama_eagle3.py:347-357: logits scattered into config.vocab_size columns (target = draft + d2t)
        out.append(finding("CONFIG_DRIFT", "error", f"{prefix}vocab_size is {V}, the target's vocabulary is {tv} "
                           f"({'the loaded target' if ctx.loaded else 't2d'}): vLLM scatters the draft's logits into "
                           "vocab_size columns (llama_eagle3.py compute_logits), which the target's verification "
                           "does not match", "state the target's vocabulary size",
                           Remedy(config_set={prefix + "vocab_size": tv})))
    tc = _target_config(ctx)
    if tc is None or s.recorded:  # a record says what the draft was trained with: _against_record compares
        return out
    from ..draft_config import _target_rope

    t_theta, t_scaling = _target_rope(tc)
    t_scaling = {k: v for k, v in (t_scaling or {}).items() if k != "type"} or None
    if t_scaling and (t_scaling.get("rope_type") or "default") == "default":
        t_scaling = None
    theta, where, scaling = _rope(layer)
    trained = "nothing records what the draft was trained with"
    sev = "warning"  # the draft may have been trained that way: only its own record or a measurement says
    cmd = " ".join(probe_command(ctx))
    if _is_num(theta) and not _same(theta, t_theta):
        out.append(finding("CONFIG_DRIFT", sev, f"{prefix}{where} is {theta!r}, the target's rope_theta is "
                           f"{t_theta!r}: the draft attends at the target's positions with other rotary "
                           f"frequencies; {trained}",
                           "keep it if the draft was trained so; the probe measures the draft as written "
                           f"(`{cmd}`): low acceptance against its training accuracy says it was not"))
    if not _same_scaling(scaling, t_scaling):
        out.append(finding("CONFIG_DRIFT", sev, f"{prefix}rope scaling reads as {scaling!r}, the target's as "
                           f"{t_scaling!r}; {trained}",
                           f"keep it if the draft was trained so; the probe measures the draft as written (`{cmd}`)"))
    eps, t_eps = engine_value(layer, "rms_norm_eps"), getattr(tc, "rms_norm_eps", None)
    if _is_num(eps) and _is_num(t_eps) and not _same(eps, t_eps):
        out.append(finding("CONFIG_DRIFT", sev, f"{prefix}rms_norm_eps is {eps!r}"
                           + (" (absent: LlamaConfig's default)" if "rms_norm_eps" not in layer else "")
                           + f", the target's {t_eps!r}: EAGLE-3 trainers copy the target's; {trained}",
                           f"keep it if the draft was trained so; the probe measures the draft as written (`{cmd}`)"))
    mpe, t_mpe = engine_value(layer, "max_position_embeddings"), getattr(tc, "max_position_embeddings", None)
    if _is_int(mpe) and _is_int(t_mpe) and mpe < t_mpe:
        out.append(finding("CONFIG_DRIFT", "warning", f"{prefix}max_position_embeddings is {mpe}"
                           + (" (absent: LlamaConfig's default)" if "max_position_embeddings" not in layer else "")
                           + f", the target's {t_mpe}: vLLM caps the draft's max_model_len at it "
                           "(config/speculative.py _maybe_override_draft_max_model_len), SGLang sizes the draft's "
                           "rotary cache from it; "
                           "what either does past it is not measured here",
                           "state the target's value if the draft was trained with its rope (serve-check with "
                           "prompts longer than it measures the effect)",
                           Remedy(config_set={prefix + "max_position_embeddings": t_mpe})))
    return out
