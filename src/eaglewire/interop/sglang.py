"""SGLang's EAGLE-3 draft format (`LlamaForCausalLMEagle3`): rules by version, export, reading.

Rules read from the sglang wheels' source (sglang/srt/...), per release; lines are 0.5.17's, the release
`eaglewire serve-check --engine sglang` runs (engines/sglang.py):
- models/llama_eagle3.py `load_weights` (:314-367): names not in the model's parameters are silently
  dropped (:359-367); `d2t` becomes hot_token_id (target = draft + d2t, :339-342), `t2d` is skipped
  (:344-345). Before 0.5.12 the first layer is the attribute `midlayer` (so `layers.0.*` is dropped) and fc
  is `hidden_size_in * 3` wide. From 0.5.12 a legacy map renames `midlayer` -> `layers.0` (:327-337). The fc
  width is then `num_aux_hidden_states` taps if set, else the nested ids' count, else 3 (:148-153). Layers >= 1
  carry their pre-attention norm as `hidden_norm` (:78, :95-97). `fc_norm` (per-tap norms, :177-189) and
  `norm_output` (feed the post-norm state to the next step, :198) are read. From 0.5.17 `norm_before_fc` is
  read too (one norm over the concatenated taps, `input_norm.weight`, :162-175). The fc runs only when the
  hidden state is not already draft-wide (:229). The first layer's residual is always the raw fc output
  (:89-91): norm_before_residual is hard-coded False. `tie_word_embeddings` makes lm_head the embedding
  (:292-293); draft_vocab_size null loads the target's lm_head, absent it is an AttributeError (:295-307).
- model_runner_components/spec_aux_hidden_state.py:80-94 (0.5.17; model_runner.py before): the ids are
  read ONLY from the nested `eagle_config`, inside a bare `except:` that falls back to None (= the model's
  default taps) on any error; `use_aux_hidden_state` is read there too (:86-88). A top-level key only sizes
  the draft's input (speculative/eagle_utils.py:472-477).
- models/llama.py:885-897, qwen2.py:747-760, qwen3.py:688-701, glm4_moe.py:1446-1458
  `set_eagle3_layers_to_capture`: None -> [2, N//2, N-3] used as-is; explicit ids -> `val + 1`. The
  capture at layer i is `hidden_states + residual` entering it (llama.py:434-437). In models/deepseek_v2.py
  (:3134-3149) and glm4_moe_lite.py (:1013-1028) the same holds before 0.5.13. From 0.5.13 (PR #25454) they
  add 1 only when ids[0] == 1. Other families read them otherwise in 0.5.17 (gpt_oss, glm4_moe_lite, the Qwen
  MoEs' embedding at id -1: eaglewire.taps.SGLANG_FAMILIES), and some targets cannot feed a draft at all
  (EAGLE3_TARGETS, CAPTURE_FAULTS below).
The index rules themselves live in eaglewire.taps (sglang_convention); this module only picks one.
"""

from __future__ import annotations

import re

import torch

from ..draft import DraftConfig, Eagle3Draft
from ..errors import TapError, UsageError
from ..taps import CONVENTIONS, TapContract, sglang_convention, sglang_default_taps, sglang_eras, sglang_releases
from .common import (AS_WRITTEN_KEYS, IDS_KEY, NORM_FLAGS, PROVENANCE_KEY, DraftDir, Reading, as_written,
                     check_flag_values, complete_vocab, draft_fields_from_hf, hf_fields, int_field, provenance,
                     vocab_sizes, window_from_hf)
from .engine_view import EngineView, FlagView

NAME = "sglang"
ARCH = "LlamaForCausalLMEagle3"
LATEST = "0.5.23"  # the newest release whose source these rules were checked against
# First releases with each behaviour (checked in the published wheels).
LAYERS_RENAME_SINCE = (0, 5, 12)  # layers.0 naming, fc width from the ids, fc_norm, norm_output, >1 layer
NORM_BEFORE_FC_SINCE = (0, 5, 17)
REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")  # SpecForge export/to_sglang.py

# The target classes SGLang 0.5.17 can run an EAGLE-3 draft on: srt/models/*.py EntryClass with
# set_eagle3_layers_to_capture, its own or inherited (`python benchmarks/eagle3_targets.py sglang SITE` lists them).
# SGLang loads the class registered under the target's architectures, an unknown one as TransformersForCausalLM
# (models/registry.py:61-91), and calls the setter on any EAGLE-3 target
# (model_executor/model_runner_components/attention_backend_setup.py:54): any other class stops it at start-up.
EAGLE3_TARGETS = frozenset({
    "ApertusForCausalLM", "BailingMoEForCausalLM", "BailingMoeForCausalLM", "BailingMoeV2ForCausalLM",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "ExaoneMoEForCausalLM",
    "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
    "Gemma4UnifiedForConditionalGeneration", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM",
    "GptOssForCausalLM", "IQuestCoderForCausalLM", "InternLM3ForCausalLM", "InternS1ProForConditionalGeneration",
    "InternS2PreviewForConditionalGeneration", "KimiK25ForConditionalGeneration", "Llama4ForCausalLM",
    "Llama4ForConditionalGeneration", "LlamaForCausalLM", "LongcatFlashForCausalLM", "MellumForCausalLM",
    "MindSporeForCausalLM", "MiniMaxM2ForCausalLM", "MiniMaxM3SparseForCausalLM", "Ministral3ForCausalLM",
    "MistralForCausalLM", "MistralLarge3ForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen2_5_VLForConditionalGeneration", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration", "SarvamMoEForCausalLM", "TeleFLMForCausalLM"})

# Targets SGLang 0.5.17 has the setter for, but whose capture does not hand the draft the residual stream entering
# the layer (what eaglewire trains on: HF's hidden_states). Read from the source; no run has measured them.
_NO_CAPTURE = ("its setter (qwen3_vl.py:1542-1553) fills layers_to_capture, which this class's forward never reads "
               "(qwen3_5.py:1441-1445): nothing is captured, and the first forward fails")
_GEMMA3 = ("gemma3 captures `hidden_states` alone (gemma3_causal.py:641-661), the layer's normed MLP output in its "
           "live-residual layout (:388-410), not the residual stream: the draft is fed other numbers than it was "
           "trained on")
_GEMMA4 = ("gemma4 captures the tensor each layer then takes as its residual (gemma4_causal.py:978-979, :658) and "
           "updates in place with the attention output (gemma_fused_add_rmsnorm, :667-672): on CUDA the draft reads "
           "the stream after attention, not the one entering the layer")
CAPTURE_FAULTS = {
    "Qwen3_5ForConditionalGeneration": _NO_CAPTURE, "Qwen3_5MoeForConditionalGeneration": _NO_CAPTURE,
    "InternS2PreviewForConditionalGeneration": _NO_CAPTURE,
    "MiniMaxM3SparseForCausalLM": "its setter (minimax_m3.py:1511-1524) fills layers_to_capture, which the forward "
                                  "never reads (:1399-1403): nothing is captured, and the first forward fails",
    "Gemma3ForCausalLM": _GEMMA3, "Gemma3ForConditionalGeneration": _GEMMA3,
    "Gemma4ForCausalLM": _GEMMA4, "Gemma4ForConditionalGeneration": _GEMMA4,
    "Gemma4UnifiedForConditionalGeneration": _GEMMA4}


def target_fault(architecture: str | None) -> str | None:
    """Why SGLang 0.5.17 cannot feed an EAGLE-3 draft the taps of a target of this architecture, or None (also
    None for an unknown architecture: nothing can be said)."""
    if not architecture:
        return None
    if architecture not in EAGLE3_TARGETS:
        return (f"SGLang 0.5.17 has no EAGLE-3 capture for {architecture} (no set_eagle3_layers_to_capture in its "
                "srt/models/): it stops at start-up (model_runner_components/attention_backend_setup.py:54)")
    fault = CAPTURE_FAULTS.get(architecture)
    return f"SGLang 0.5.17 runs {architecture}, but {fault}" if fault else None


def parse_version(v: str | None) -> tuple[int, ...]:
    """'0.5.13', 'v0.5.12.post1', 'latest' or None (= latest) -> comparable tuple."""
    if v is None or v == "latest":
        v = LATEST
    m = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)(?:\.?post(\d+))?(?:rc\d+)?", str(v).strip())
    if not m:
        raise UsageError(f"--engine-version {v!r}: expected an SGLang release such as 0.5.13 or 'latest'")
    return tuple(int(x or 0) for x in m.groups())


def convention_for(model_type: str | None, version: str | None) -> str:
    return sglang_convention(model_type, parse_version(version))


# --- export ---------------------------------------------------------------------------------------

def _engine_names(state: dict[str, torch.Tensor], version: tuple) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        m = re.match(r"layers\.(\d+)\.(.*)", k)
        if m and m.group(1) == "0":
            k = "midlayer." + m.group(2)  # understood by every release (renamed to layers.0 from 0.5.12)
        elif m and m.group(2) == "input_layernorm.weight":
            k = f"layers.{m.group(1)}.hidden_norm.weight"  # layers >= 1 norm their input with hidden_norm
        elif k == "fc_input_norm.weight":
            k = "input_norm.weight"
        out[k] = v
    return out


def check_exportable(c: DraftConfig, contract: TapContract, version: tuple) -> None:
    """Refuse what this SGLang cannot run, before anything is written."""
    v = ".".join(map(str, version[:3]))
    if c.norm_before_residual:
        raise UsageError("SGLang cannot run norm_before_residual=true (llama_eagle3.py hard-codes the raw fc "
                         "output as the first layer's residual); serve this draft with vLLM instead")
    if version < LAYERS_RENAME_SINCE:
        for what, bad in (("a tap count other than 3", len(contract.taps) != 3),
                          ("more than one draft layer", c.num_layers > 1),
                          ("fc_norm", c.fc_norm), ("norm_output", c.norm_output)):
            if bad:
                raise UsageError(f"SGLang {v} cannot run {what} (llama_eagle3.py before 0.5.12); use "
                                 "--engine-version 0.5.12 or newer")
    if c.norm_before_fc and version < NORM_BEFORE_FC_SINCE:
        raise UsageError(f"SGLang {v} cannot run norm_before_fc (read from 0.5.17 on); use --engine-version 0.5.17 "
                         "or newer")


def choose_ids(contract: TapContract, model_type: str | None, version: str | None) -> tuple[list[int], str, list[str]]:
    """Ids in SGLang's words -> (ids, convention, notes). Refuses taps SGLang cannot capture. Where the family's
    rule changed between releases (eaglewire.taps.SGLANG_FAMILIES), ids every release reads as the same taps are
    preferred, and otherwise a note says which releases the ids are right for."""
    conv = convention_for(model_type, version)
    try:
        ids = CONVENTIONS[conv].to_ids(contract.taps, contract.num_layers)
    except TapError as e:
        raise UsageError(f"SGLang cannot capture these taps: {e}") from None
    eras = sglang_eras(model_type)
    if len(eras) == 1:
        return ids, conv, []

    def reads(era_conv: str, cand: list[int]) -> bool:
        try:
            return CONVENTIONS[era_conv].from_ids(cand, contract.num_layers) == contract.taps
        except TapError:
            return False

    candidates = [ids]  # the release's own form first, then each other rule's
    for _, era_conv in eras:
        try:
            if era_conv != conv:
                candidates.append(CONVENTIONS[era_conv].to_ids(contract.taps, contract.num_layers))
        except TapError:
            pass
    everywhere = next((c for c in candidates if all(reads(e, c) for _, e in eras)), None)
    if everywhere is not None:
        if everywhere != ids:  # the release's own form reads otherwise elsewhere: this one works on each
            return everywhere, conv, [f"ids {everywhere} mean taps {list(contract.taps)} under each of SGLang's rules "
                                      f"for {model_type} ({sglang_releases(eras)}): this export works on every "
                                      "SGLang version"]
        return ids, conv, []
    right = [e for e in eras if reads(e[1], ids)]
    others = [(since, e) for since, e in eras if (since, e) not in right]
    note = f"{model_type} target: ids {ids} are right for SGLang {sglang_releases(right, eras)} only"
    for since, e in others:
        try:
            alt = CONVENTIONS[e].to_ids(contract.taps, contract.num_layers)
            note += (f"; SGLang {sglang_releases([(since, e)], eras)} needs {alt} ({CONVENTIONS[e].meaning}): "
                     "export again with --engine-version")
        except TapError:
            note += f"; SGLang {sglang_releases([(since, e)], eras)} cannot be given taps {list(contract.taps)}"
    return ids, conv, [note]


CARRIED = "llama-eagle3-config"  # Reading.carried["format"] of an SGLang / SpecForge import


def carried_of(cfg: dict) -> dict:
    """The rope/window keys of a LlamaForCausalLMEagle3 config as written (SpecForge on transformers 5 writes
    rope_parameters), for an export to this format to write them back."""
    return {"format": CARRIED, "layer": {k: cfg[k] for k in AS_WRITTEN_KEYS if k in cfg},
            "flags": [f for f in NORM_FLAGS if f in cfg]}


def export(model: Eagle3Draft, contract: TapContract, target: dict, engine_version: str | None,
           carried: dict | None = None):
    """-> (config dict, tensors, ids, convention, notes). Pure: writes nothing."""
    c = model.config
    version = parse_version(engine_version)
    check_exportable(c, contract, version)
    ids, conv, notes = choose_ids(contract, target.get("model_type"), engine_version)
    fault = target_fault(target.get("architecture"))
    if fault:
        notes.append(f"{fault} (read from its source; other releases not read)")
    if c.sliding_window is not None:
        # 0.5.17 llama_eagle3.py:276-288 (LlamaForCausalLMEagle3.__init__) takes the draft's window from the server
        # argument speculative_draft_window_size alone; config.json's layer_types/sliding_window only record it.
        notes.append(f"the draft attends with a sliding window of {c.sliding_window} positions: SGLang applies it "
                     f"only when served with --speculative-draft-window-size {c.sliding_window} (in the command "
                     "below); a release without that flag attends to every position")
    layer, written = hf_fields(c), NORM_FLAGS
    if (carried or {}).get("format") == CARRIED:
        layer = as_written(layer, carried.get("layer"), c, "the imported draft's config")
        # A flag the source left out stays out where it is False (SGLang's default for each): SpecForge's own
        # class reads an explicit norm_output=false as "no final norm before lm_head" (llama3_eagle.py).
        written = tuple(carried.get("flags") or ())
    cfg = {"architectures": [ARCH], **layer, "draft_vocab_size": c.draft_vocab_size,
           # SGLang reads the ids only here (model_runner.py); the nested key is mandatory.
           "eagle_config": {IDS_KEY: ids, "use_aux_hidden_state": True},
           **{f: getattr(c, f) for f in NORM_FLAGS if f in written or getattr(c, f)},
           # SGLang builds the draft in the dtype its own config states; none reads as float32, which its default
           # --dtype auto turns into float16 (0.5.17 configs/model_config.py:494, 1663-1684): say bf16, as served
           "torch_dtype": "bfloat16",
           PROVENANCE_KEY: provenance(NAME, conv, contract, target, engine_version or LATEST, c)}
    tensors = _engine_names({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, version)
    return cfg, tensors, ids, conv, notes


# --- what SGLang reads ----------------------------------------------------------------------------

def _params(cfg: dict, num_aux: int, version: tuple) -> set[str]:
    """The parameter names (without the `model.` prefix) SGLang's LlamaForCausalLMEagle3 builds."""
    n = int_field(cfg, "num_hidden_layers") or 1
    layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "post_attention_layernorm.weight", "hidden_norm.weight"]
    names = {"fc.weight", "norm.weight", "embed_tokens.weight"}
    if not cfg.get("tie_word_embeddings"):
        names.add("lm_head.weight")
    if version >= LAYERS_RENAME_SINCE:
        names |= {f"layers.0.{p}" for p in layer + ["input_layernorm.weight"]}
        names |= {f"layers.{i}.{p}" for i in range(1, n) for p in layer}
        if cfg.get("fc_norm") or cfg.get("use_aux_norm"):
            names |= {f"fc_norm.{i}.weight" for i in range(num_aux)}
    else:
        names |= {f"midlayer.{p}" for p in layer + ["input_layernorm.weight"]}
    nbf = (cfg.get("eagle_config") or {}).get("norm_before_fc", cfg.get("norm_before_fc", False))
    if version >= NORM_BEFORE_FC_SINCE and nbf:
        names.add("input_norm.weight")
    return names


def _rename(name: str, version: tuple) -> str:
    if version >= LAYERS_RENAME_SINCE:
        for old, new in (("midlayer", "layers.0"), ("aux_norm_low", "fc_norm.0"), ("aux_norm_mid", "fc_norm.1"),
                         ("aux_norm_high", "fc_norm.2")):
            name = name.replace(old, new)
    return name


def _flags(cfg: dict, version: tuple) -> dict[str, FlagView]:
    new, nbf_ok = version >= LAYERS_RENAME_SINCE, version >= NORM_BEFORE_FC_SINCE
    nested = cfg.get("eagle_config") or {}
    out = {}
    for f in NORM_FLAGS:
        written = nested.get(f) if f == "norm_before_fc" and f in nested else cfg.get(f)
        where = ("eagle_config." + f if f == "norm_before_fc" and f in nested else f) if written is not None else None
        read = {"norm_before_residual": False, "norm_before_fc": nbf_ok, "fc_norm": new, "norm_output": new}[f]
        effective = bool(written) if read else False
        out[f] = FlagView(written=written, where=where, engine_default=False if read else None,
                          effective=effective, supported=not (written and not read))
    return out


def native_name(param: str) -> str:
    """An SGLang parameter name -> eaglewire's name for the same tensor."""
    name = param.removeprefix("model.").replace("midlayer.", "layers.0.")
    if name == "input_norm.weight":
        return "fc_input_norm.weight"
    return re.sub(r"^layers\.([1-9]\d*)\.hidden_norm\.", r"layers.\1.input_layernorm.", name)


def engine_view(dd: DraftDir, version: str | None, model_type: str | None, num_layers: int | None) -> EngineView:
    v = parse_version(version)
    cfg, problems = dd.config, []
    arch = (cfg.get("architectures") or [None])[0]
    recognised = arch == ARCH
    if not recognised:
        problems.append(f"architectures is {cfg.get('architectures')!r}: SGLang loads EAGLE-3 drafts as {ARCH}")
    ids = dd.ids("nested")
    ignored = {k: v_ for k, v_ in (("eagle_aux_hidden_state_layer_ids (top level)", dd.ids("top")),) if v_ is not None}
    conv = convention_for(model_type, version) if model_type else None
    captured = None
    if num_layers is not None:
        try:
            captured = list(sglang_default_taps(num_layers) if ids is None else
                            CONVENTIONS[conv or "sglang"].from_ids(ids, num_layers))
        except TapError as e:
            problems.append(f"eagle_config.{IDS_KEY} {ids}: {e}")
    # llama_eagle3.py:148-153 (0.5.12 on): num_aux_hidden_states if set, else the nested ids' count, else 3
    num_aux = 3
    if v >= LAYERS_RENAME_SINCE:
        num_aux = int_field(cfg, "num_aux_hidden_states") or (len(ids) if ids else 3)
    params = _params(cfg, num_aux, v)
    kept, dropped = {}, []
    for name in sorted(dd.names):
        if name.endswith("d2t") or name.endswith("t2d"):
            (kept.__setitem__(name, "hot_token_id") if "d2t" in name else dropped.append(name))
            continue
        new = _rename(name, v)
        if new in params:
            kept[name] = "model." + new if new != "lm_head.weight" else new
        else:
            dropped.append(name)
    seen = {_rename(n, v) for n in dd.names}
    missing = sorted((set(REQUIRED) - dd.names) | {p for p in params - seen if p != "embed_tokens.weight"})
    fc = dd.tensors.get("fc.weight")
    hidden = cfg.get("hidden_size")
    target_hidden = cfg.get("target_hidden_size", hidden)
    if fc is not None and target_hidden and fc.shape[1] != target_hidden * num_aux:
        problems.append(f"fc.weight is {fc.shape[1]} wide but SGLang builds fc for {num_aux} taps x {target_hidden}")
    return EngineView(engine=NAME, engine_version=".".join(map(str, v[:3])), path=str(dd.path), architecture=arch,
                      recognised=recognised, ids=ids, ids_where=f"eagle_config.{IDS_KEY}" if ids is not None else None,
                      ids_ignored=ignored, default_used=ids is None, convention=conv if ids is not None else None,
                      captured_taps=captured, num_aux_expected=num_aux,
                      fc_in_features=int(fc.shape[1]) if fc is not None else None, target_hidden_size=target_hidden,
                      weights_kept=kept, weights_dropped=dropped, weights_missing=missing,
                      draft_vocab_size=cfg.get("draft_vocab_size"),
                      # null only: absent, SGLang fails to build the draft (doctor/static.py LM_HEAD_REPLACED)
                      lm_head_from_target=("draft_vocab_size" in cfg and cfg["draft_vocab_size"] is None
                                           and not cfg.get("tie_word_embeddings")),
                      embedding_replaced=target_hidden == hidden, norm_flags=_flags(cfg, v), problems=problems)


# --- reading a SGLang directory as SGLang would run it --------------------------------------------

def read(dd: DraftDir, *, model_type: str | None, num_layers: int, vocab_size: int | None,
         version: str | None) -> Reading:
    view = engine_view(dd, version, model_type, num_layers)
    where = str(dd.path / "config.json")
    check_flag_values(dd.config, where)
    bad = [f for f, fv in view.norm_flags.items() if not fv.supported]
    if not view.recognised or view.weights_missing or bad or view.captured_taps is None:
        raise UsageError(f"{dd.path}: SGLang {view.engine_version} would not run this draft as written: "
                         + "; ".join(view.problems + [f"missing weights {view.weights_missing}"] * bool(view.weights_missing)
                                     + [f"unsupported flags {bad}"] * bool(bad)))
    tensors = {}
    for stored, param in view.weights_kept.items():
        if param == "hot_token_id":
            tensors["d2t"] = dd.tensors[stored]
            continue
        tensors[native_name(param)] = dd.tensors[stored]
    if "t2d" in dd.tensors:
        tensors["t2d"] = dd.tensors["t2d"]
    vocab, draft_vocab = vocab_sizes(dd.config, tensors, where, vocab_size)
    notes = complete_vocab(tensors, vocab, draft_vocab, where)
    flags = {f: fv.effective for f, fv in view.norm_flags.items()}
    config = DraftConfig(**draft_fields_from_hf(dd.config, where), vocab_size=vocab, draft_vocab_size=draft_vocab,
                         target_hidden_size=view.target_hidden_size, num_taps=view.num_aux_expected,
                         sliding_window=window_from_hf(dd.config, where), **flags)
    contract = TapContract(num_layers, tuple(view.captured_taps))
    if view.default_used:
        notes.append(f"no eagle_config.{IDS_KEY}: SGLang captures its default taps {list(contract.taps)}")
    return Reading(source=NAME, convention=view.convention or "sglang-default", config=config, tensors=tensors,
                   contract=contract, ids=view.ids, ids_where=view.ids_where, notes=tuple(notes),
                   carried=carried_of(dd.config))
