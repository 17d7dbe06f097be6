"""vLLM's EAGLE-3 formats: the speculators format (`Eagle3Speculator`) and the plain one.

Rules read from public source:
- vllm/transformers_utils/configs/speculators/algos.py `update_eagle3`: a speculators config is
  turned into the draft's HF config from `transformer_layer_config` (model_type llama or qwen3
  only). It carries draft_vocab_size, target_hidden_size, the four norm flags and the TOP-LEVEL
  eagle_aux_hidden_state_layer_ids. Of the flags, norm_before_residual defaults to TRUE when absent,
  the others to False.
- vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py `get_eagle3_aux_layers_from_config`: ids
  are read only from the top level (`hf_config.eagle_aux_hidden_state_layer_ids`); absent, the
  target's default (2, N//2, N-3) is used. Id j is tap j (taps.CONVENTIONS["vllm"]).
- vllm/model_executor/models/llama_eagle3.py: `midlayer.` is renamed `layers.0.`; `d2t` becomes
  draft_id_to_target_id, `t2d` is skipped; other unknown names raise; fc is `target_hidden_size * 3`
  wide; a plain (non-speculators) config's norm_before_residual is read with getattr(.., False).
- vllm-project/speculators src/speculators/models/eagle3/{config,core}.py: the library's own
  Eagle3SpeculatorConfig defaults every norm flag to False; weights `layers.N.*`, `fc.weight`,
  `input_norm.weight` (norm_before_fc), `fc_norm.{i}.weight`, `norm.weight`, `lm_head.weight`,
  `embed_tokens.weight`, `d2t`, `t2d`; fc is num_taps * hidden_size wide.
"""

from __future__ import annotations

from ..draft import DraftConfig, Eagle3Draft
from ..errors import TapError, UsageError
from ..taps import CONVENTIONS, TapContract, default_taps
from .common import (AS_WRITTEN_KEYS, IDS_KEY, NORM_FLAGS, PROVENANCE_KEY, DraftDir, Reading, as_written,
                     check_flag_values, complete_vocab, draft_fields_from_hf, hf_fields, int_field, provenance,
                     vocab_sizes, window_from_hf)
from .engine_view import EngineView, FlagView

NAME = "vllm"
SPECULATORS = "speculators"
SPEC_ARCH = "Eagle3Speculator"
PLAIN_ARCHS = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")  # vLLM's model registry names
VLLM_FC_TAPS = 3  # fc's width in taps where the config says nothing else (_fc_taps)
# The target architectures vLLM 0.26.0 registers (model_executor/models/registry.py's text-generation and multimodal
# tables) whose class is not SupportsEagle3: vLLM refuses an EAGLE-3 draft on them at start-up ("Model does not support
# EAGLE3 interface", v1/worker/gpu_model_runner.py:5428-5432). An unregistered architecture runs on vLLM's
# Transformers backend, which supports EAGLE-3. `python benchmarks/eagle3_targets.py vllm SITE` lists them.
NO_EAGLE3 = frozenset({
    "AXK1ForCausalLM", "ArcticForCausalLM", "AriaForConditionalGeneration",
    "AudioFlamingo3ForConditionalGeneration", "BagelForConditionalGeneration", "BailingMoeForCausalLM",
    "BailingMoeV2ForCausalLM", "BailingMoeV2_5ForCausalLM", "BeeForConditionalGeneration",
    "Blip2ForConditionalGeneration", "BloomForCausalLM", "ChameleonForConditionalGeneration",
    "ChatGLMForConditionalGeneration", "ChatGLMModel", "Cheers", "CheersForConditionalGeneration",
    "Cohere2ForCausalLM", "Cohere2MoeForCausalLM", "Cohere2VisionForConditionalGeneration",
    "CohereAsrForConditionalGeneration", "CohereForCausalLM", "Cosmos3EdgeForConditionalGeneration",
    "DbrxForCausalLM", "DeciLMForCausalLM", "DeepseekOCR2ForCausalLM", "DeepseekOCRForCausalLM",
    "DeepseekVLV2ForCausalLM", "DiffusionGemmaForBlockDiffusion", "DotsOCRForCausalLM",
    "Eagle2_5_VLForConditionalGeneration", "Ernie4_5_MoeForCausalLM", "Ernie4_5_VLMoeForConditionalGeneration",
    "Exaone4ForCausalLM", "ExaoneForCausalLM", "ExaoneMoEForCausalLM", "FalconForCausalLM", "FalconH1ForCausalLM",
    "FalconMambaForCausalLM", "FireRedASR2ForConditionalGeneration", "FireRedLIDForConditionalGeneration",
    "FlexOlmoForCausalLM", "FunASRForConditionalGeneration", "FunAudioChatForConditionalGeneration",
    "GLM4VForCausalLM", "GPT2LMHeadModel", "GPTJForCausalLM", "GPTNeoXForCausalLM", "Gemma2ForCausalLM",
    "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma3nForCausalLM", "Gemma3nForConditionalGeneration",
    "GemmaForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM",
    "Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration", "GlmAsrForConditionalGeneration",
    "GlmOcrForConditionalGeneration", "Granite4VisionForConditionalGeneration", "GraniteForCausalLM",
    "GraniteMoeForCausalLM", "GraniteMoeHybridForCausalLM", "GraniteMoeSharedForCausalLM",
    "GraniteSpeechForConditionalGeneration", "GraniteSpeechPlusForConditionalGeneration", "H2OVLChatModel",
    "HCXVisionForCausalLM", "HCXVisionV2ForCausalLM", "HYV3ForCausalLM", "HfMoondream", "HrmTextForCausalLM",
    "HyperCLOVAXForCausalLM", "IQuestLoopCoderForCausalLM", "Idefics3ForConditionalGeneration",
    "InklingForCausalLM", "InklingForConditionalGeneration", "InternLM2ForCausalLM",
    "InternS1ForConditionalGeneration", "InternVLChatModel", "InternVLForConditionalGeneration",
    "IsaacForConditionalGeneration", "Jais2ForCausalLM", "JambaForCausalLM", "KananaVForConditionalGeneration",
    "KeyeForConditionalGeneration", "KeyeVL1_5ForConditionalGeneration", "KimiLinearForCausalLM",
    "KimiVLForConditionalGeneration", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm2VlForConditionalGeneration",
    "Llama_Nemotron_Nano_VL", "LlavaNextForConditionalGeneration", "LlavaNextVideoForConditionalGeneration",
    "LlavaOnevision2ForConditionalGeneration", "LlavaOnevisionForConditionalGeneration", "LongcatFlashForCausalLM",
    "LongcatFlashNgramForCausalLM", "MPTForCausalLM", "Mamba2ForCausalLM", "MambaForCausalLM", "MiDashengLMModel",
    "MiMoV2OmniForCausalLM", "MiniCPMO", "MiniCPMV", "MiniCPMV4_6ForConditionalGeneration", "MixtralForCausalLM",
    "Molmo2ForConditionalGeneration", "MolmoForCausalLM", "Moondream3ForCausalLM", "MoonshotKimiaForCausalLM",
    "MossAudioModel", "MossTranscribeDiarizeForConditionalGeneration", "MptForCausalLM", "NVLM_D",
    "NemotronForCausalLM", "NemotronH_Nano_Omni_Reasoning_V3", "NemotronH_Nano_VL_V2",
    "NemotronH_Super_Omni_Reasoning_V3", "NemotronParseForConditionalGeneration", "OPTForCausalLM",
    "Olmo3ForCausalLM", "OlmoHybridForCausalLM", "OlmoeForCausalLM", "OpenPanguVLForConditionalGeneration",
    "OpenVLAForActionPrediction", "OrionForCausalLM", "OuroForCausalLM", "Ovis", "Ovis2_5", "Ovis2_6ForCausalLM",
    "Ovis2_6_MoeForCausalLM", "PaddleOCRVLForConditionalGeneration", "PaliGemmaForConditionalGeneration",
    "PanguEmbeddedForCausalLM", "PanguProMoEV2ForCausalLM", "PanguUltraMoEForCausalLM", "Param2MoEForCausalLM",
    "Phi3VForCausalLM", "Phi4ForCausalLMV", "Phi4MMForCausalLM", "PhiForCausalLM", "PhiMoEForCausalLM",
    "Plamo2ForCausalLM", "Plamo3ForCausalLM", "QianfanOCRForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration", "Qwen2MoeForCausalLM", "Qwen2VLForConditionalGeneration",
    "Qwen2_5OmniForConditionalGeneration", "Qwen2_5OmniModel", "Qwen3ASRForConditionalGeneration",
    "Qwen3ASRRealtimeGeneration", "Qwen3OmniMoeForConditionalGeneration", "RForConditionalGeneration",
    "RWForCausalLM", "Rnj1ForCausalLM", "SarvamMLAForCausalLM", "SarvamMoEForCausalLM", "SeedOssForCausalLM",
    "SkyworkR1VChatModel", "SmolVLMForConditionalGeneration", "SolarForCausalLM", "StableLMEpochForCausalLM",
    "StableLmForCausalLM", "Step3TextForCausalLM", "Step3VLForConditionalGeneration", "Step3p5ForCausalLM",
    "Step3p7ForConditionalGeneration", "StepVLForConditionalGeneration", "UltravoxModel", "UnlimitedOCRForCausalLM",
    "VoxtralForConditionalGeneration", "VoxtralRealtimeGeneration", "WhisperForConditionalGeneration",
    "Zamba2ForCausalLM"})
# speculators.models.eagle3 config defaults vs vLLM's update_eagle3 defaults for absent flags.
SPECULATORS_DEFAULTS = dict.fromkeys(NORM_FLAGS, False)
VLLM_SPECULATORS_DEFAULTS = {**SPECULATORS_DEFAULTS, "norm_before_residual": True}
CARRIED = "speculators-config"  # Reading.carried["format"] of a speculators-format import


def target_fault(architecture: str | None) -> str | None:
    """Why vLLM 0.26.0 cannot serve an EAGLE-3 draft for a target of this architecture, or None."""
    if architecture in NO_EAGLE3:
        return (f"vLLM 0.26.0 runs {architecture} without EAGLE-3 (its class is not SupportsEagle3): it refuses the "
                "draft at start-up (v1/worker/gpu_model_runner.py:5428-5432)")
    return None


def is_speculators(cfg: dict) -> bool:
    return cfg.get("speculators_model_type") == "eagle3"


# --- export ---------------------------------------------------------------------------------------

def export(model: Eagle3Draft, contract: TapContract, target: dict, fmt: str, num_speculative_tokens: int,
           verifier: str | None, carried: dict | None = None):
    """-> (config dict, tensors, ids, convention, notes) for --format vllm or speculators. Writes nothing.

    carried: Reading.carried of the draft's import: its layer config's rope/window keys as written, and its verifier
    (used where --target-path does not name one)."""
    c, notes, carried = model.config, [], carried or {}
    if fmt == SPECULATORS and c.target_hidden_size != c.hidden_size:
        raise UsageError(f"the speculators library builds fc over num_taps x hidden_size ({c.hidden_size}); this "
                         f"draft reads taps of width {c.target_hidden_size}: export with --format vllm")
    try:
        ids = CONVENTIONS["vllm"].to_ids(contract.taps, contract.num_layers)
    except TapError as e:
        raise UsageError(f"vLLM cannot capture these taps: {e}") from None
    fault = target_fault(target.get("architecture"))
    if fault:
        notes.append(f"{fault} (read from its source; other releases not read)")
    if contract.num_layers in contract.taps:
        notes.append("taps include the last layer's output: vLLM captures it only from PR #36063 on "
                     "(EagleModelMixin), DeepSeek-family targets from PR #46973 on")
    layer = hf_fields(c)
    layer.pop("target_hidden_size", None)
    if carried.get("format") == CARRIED:
        layer = as_written(layer, carried.get("layer"), c, "the imported draft's layer config")
    layer["architectures"] = ["LlamaForCausalLM"]
    if len(contract.taps) != VLLM_FC_TAPS:
        # vLLM builds fc from the layer config's num_aux_hidden_states (_fc_taps), else for 3 taps
        layer["num_aux_hidden_states"] = len(contract.taps)
        notes.append(f"{len(contract.taps)} taps: transformer_layer_config.num_aux_hidden_states sizes vLLM's fc "
                     "(vLLM 0.26.0 llama_eagle3.py:176-182); a vLLM that does not read it builds fc for 3 taps")
    old = carried.get("verifier") if carried.get("format") == CARRIED else None
    old = old if isinstance(old, dict) else {}
    verifier_path = verifier or old.get("name_or_path")
    archs = [target["architecture"]] if target.get("architecture") else list(old.get("architectures") or [])
    if verifier_path is None:
        # speculators model.py load_verifier_weights: no name_or_path, no embedding/lm_head from the verifier;
        # its from_pretrained then fails on an export without embed_tokens (offline).
        notes.append("speculators_config.verifier.name_or_path is null: pass --target-path so speculators' "
                     "Eagle3DraftModel.from_pretrained can load the verifier's weights")
    cfg = {"architectures": [SPEC_ARCH], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
           "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": _target_hidden(c, carried),
           # Every flag written: vLLM assumes norm_before_residual=True when absent, speculators False.
           **{f: getattr(c, f) for f in NORM_FLAGS},
           IDS_KEY: ids, "embed_requires_grad": False,
           "speculators_config": {
               "algorithm": "eagle3",
               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                     "verifier_accept_k": 1, "accept_tolerance": 0.0}],
               "default_proposal_method": "greedy",
               "verifier": {"name_or_path": verifier_path, "architectures": archs}},
           PROVENANCE_KEY: provenance(fmt, "vllm", contract, target, None, c)}
    tensors = {("input_norm.weight" if k == "fc_input_norm.weight" else k): v.detach().cpu().contiguous()
               for k, v in model.state_dict().items()}
    return cfg, tensors, ids, "vllm", notes


def _target_hidden(c: DraftConfig, carried: dict) -> int | None:
    # speculators writes null for "= hidden_size" (models/eagle3/config.py default); kept so where it still holds
    if carried.get("format") == CARRIED and "target_hidden_size" in (carried.get("top") or {}) \
            and carried["top"]["target_hidden_size"] is None and c.target_hidden_size == c.hidden_size:
        return None
    return c.target_hidden_size


# --- what vLLM (or the speculators library) reads -------------------------------------------------

def _layer_cfg(cfg: dict) -> dict:
    return cfg.get("transformer_layer_config") or {} if is_speculators(cfg) else cfg


def _fc_taps(cfg: dict, layer: dict) -> int:
    """The taps vLLM 0.26.0 sizes the draft's fc for. A speculators config becomes its transformer_layer_config plus
    the top-level ids (transformers_utils/configs/speculators/base.py:61-65, algos.py:49-52); a plain one is read
    whole. Llama layers (llama_eagle3.py:176-182): num_aux_hidden_states, else the nested ids' count, else 3. Qwen3
    layers (qwen3_eagle3.py:200-207): num_aux_layers, num_aux_hidden_states, else the top-level or nested ids'
    count, else 3."""
    nested = (layer.get("eagle_config") or {}).get(IDS_KEY) if isinstance(layer.get("eagle_config"), dict) else None
    if is_speculators(cfg) and layer.get("model_type") == "qwen3":
        n = int_field(layer, "num_aux_layers") or int_field(layer, "num_aux_hidden_states")
        listed = cfg.get(IDS_KEY) or nested  # the top-level ids, which a plain config's layer is
    else:
        n, listed = int_field(layer, "num_aux_hidden_states"), nested
    return n or (len(listed) if isinstance(listed, list) and listed else VLLM_FC_TAPS)


def _params(layer: dict, flags: dict, num_aux: int) -> set[str]:
    n = int_field(layer, "num_hidden_layers") or 1
    per = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
           "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight",
           "input_layernorm.weight"]
    names = {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "layers.0.hidden_norm.weight"}
    names |= {f"layers.{i}.{p}" for i in range(n) for p in per}
    if flags["norm_before_fc"]:
        names.add("input_norm.weight")
    if flags["fc_norm"]:
        names |= {f"fc_norm.{i}.weight" for i in range(num_aux)}
    return names


def engine_view(dd: DraftDir, engine: str, num_layers: int | None) -> EngineView:
    """engine: 'vllm' (the serving engine) or 'speculators' (the library's own loader)."""
    cfg, problems = dd.config, []
    spec = is_speculators(cfg)
    arch = (cfg.get("architectures") or [None])[0]
    layer = _layer_cfg(cfg)
    if engine == SPECULATORS:
        recognised = spec
    else:
        recognised = (spec and layer.get("model_type", "llama") in ("llama", "qwen3")) or arch in PLAIN_ARCHS
    if not recognised:
        problems.append(f"architectures {cfg.get('architectures')!r}: {engine} does not load this as an EAGLE-3 draft")
    ids = dd.ids("top")
    ignored = {f"eagle_config.{IDS_KEY}": dd.ids("nested")} if dd.ids("nested") is not None else {}
    captured = None
    if num_layers is not None:
        try:
            captured = list(default_taps(num_layers) if ids is None else CONVENTIONS["vllm"].from_ids(ids, num_layers))
        except TapError as e:
            problems.append(f"{IDS_KEY} {ids}: {e}")
    defaults = (VLLM_SPECULATORS_DEFAULTS if engine == NAME else SPECULATORS_DEFAULTS) if spec else SPECULATORS_DEFAULTS
    flags = {}
    for f in NORM_FLAGS:
        written = cfg.get(f)
        flags[f] = FlagView(written=written, where=f if written is not None else None, engine_default=defaults[f],
                            effective=bool(defaults[f] if written is None else written), supported=True)
    num_aux = _fc_taps(cfg, layer) if engine == NAME else (len(ids) if ids else 3)
    params = _params(layer, {f: v.effective for f, v in flags.items()}, num_aux)
    kept, dropped = {}, []
    for name in sorted(dd.names):
        new = name.replace("midlayer.", "layers.0.") if engine == NAME else name
        if new == "t2d":
            (kept.__setitem__(name, "t2d") if engine == SPECULATORS else dropped.append(name))
        elif new == "d2t":
            kept[name] = "draft_id_to_target_id" if engine == NAME else "d2t"
        elif new in params:
            kept[name] = new
        else:
            dropped.append(name)
            if engine == NAME:
                problems.append(f"weight {name!r}: vLLM's loader raises on names it does not know")
    missing = sorted(p for p in params - {n.replace("midlayer.", "layers.0.") for n in dd.names}
                     if p != "embed_tokens.weight")
    fc = dd.tensors.get("fc.weight")
    hidden = layer.get("hidden_size")
    target_hidden = cfg.get("target_hidden_size") or layer.get("target_hidden_size") or hidden
    if engine == SPECULATORS:
        target_hidden = hidden  # the library's fc is num_taps * hidden_size
    if fc is not None and target_hidden and fc.shape[1] != target_hidden * num_aux:
        problems.append(f"fc.weight is {fc.shape[1]} wide but {engine} builds fc for {num_aux} taps x {target_hidden}")
    dvs = cfg.get("draft_vocab_size")
    return EngineView(engine=engine, engine_version="latest", path=str(dd.path), architecture=arch,
                      recognised=recognised, ids=ids, ids_where=IDS_KEY if ids is not None else None,
                      ids_ignored=ignored, default_used=ids is None, convention="vllm", captured_taps=captured,
                      num_aux_expected=num_aux, fc_in_features=int(fc.shape[1]) if fc is not None else None,
                      target_hidden_size=target_hidden, weights_kept=kept, weights_dropped=dropped,
                      weights_missing=missing, draft_vocab_size=dvs, lm_head_from_target=False,
                      embedding_replaced="embed_tokens.weight" not in dd.names, norm_flags=flags, problems=problems)


def read(dd: DraftDir, *, engine: str, num_layers: int, vocab_size: int | None) -> Reading:
    """The draft `engine` ('vllm' or 'speculators') would run from this directory."""
    view = engine_view(dd, engine, num_layers)
    where = str(dd.path / "config.json")
    check_flag_values(dd.config, where)
    if not view.recognised or view.weights_missing or view.captured_taps is None or view.problems:
        raise UsageError(f"{dd.path}: {engine} would not run this draft as written: "
                         + "; ".join(view.problems + [f"missing weights {view.weights_missing}"] * bool(view.weights_missing)))
    tensors = {}
    for stored, param in view.weights_kept.items():
        name = {"draft_id_to_target_id": "d2t", "input_norm.weight": "fc_input_norm.weight"}.get(param, param)
        tensors[name] = dd.tensors[stored]
    layer = _layer_cfg(dd.config)
    vocab, draft_vocab = vocab_sizes({**layer, **{k: dd.config[k] for k in ("draft_vocab_size",) if k in dd.config}},
                                     tensors, where, vocab_size)
    notes = complete_vocab(tensors, vocab, draft_vocab, where)
    flags = {f: fv.effective for f, fv in view.norm_flags.items()}
    implicit = [f"{f}={fv.effective} ({engine}'s default)" for f, fv in view.norm_flags.items() if fv.written is None]
    if implicit:
        notes.append("norm flags absent, engine defaults apply: " + ", ".join(implicit))
    layer_where = f"{where}: transformer_layer_config" if is_speculators(dd.config) else where
    window = window_from_hf(layer, layer_where)
    if window is None and layer.get("sliding_window") and layer.get("layer_types") is None:
        notes.append(f"sliding_window={layer['sliding_window']} without layer_types: {engine} reads the window "
                     "through layer_types only, so the draft attends to every position")
    config = DraftConfig(**draft_fields_from_hf(layer, layer_where), vocab_size=vocab, draft_vocab_size=draft_vocab,
                         target_hidden_size=view.target_hidden_size, num_taps=len(view.captured_taps),
                         sliding_window=window, **flags)
    carried = {}
    if is_speculators(dd.config):
        verifier = (dd.config.get("speculators_config") or {}).get("verifier")
        carried = {"format": CARRIED, "layer": {k: layer[k] for k in AS_WRITTEN_KEYS if k in layer},
                   "top": {k: dd.config[k] for k in ("target_hidden_size",) if k in dd.config},
                   "verifier": ({k: verifier.get(k) for k in ("name_or_path", "architectures")}
                                if isinstance(verifier, dict) else None)}
    if view.default_used:
        notes.append(f"no top-level {IDS_KEY}: {engine} uses its default taps {view.captured_taps}")
    return Reading(source=engine, convention="vllm", config=config, tensors=tensors,
                   contract=TapContract(num_layers, tuple(view.captured_taps)), ids=view.ids, ids_where=view.ids_where,
                   notes=tuple(notes), carried=carried)

