"""The tap contract: which residual-stream states an EAGLE-3 draft reads, in every engine's words.

Canonical definition, used everywhere inside eaglewire:

    tap k = the residual stream ENTERING decoder layer k, for k in 0..N (N decoder layers).
    tap 0 is the embedding output; tap N is the last layer's output BEFORE the final norm.

Every engine and trainer numbers these states differently (see docs/CONVENTIONS.md section 1).
Each convention below is an exact two-way translation between taps and that convention's ids; a
tap a convention cannot express raises TapError saying so, rather than silently shifting it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .errors import TapError


def default_taps(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default taps {2, N//2, N-3} (SafeAILab/EAGLE, SpecForge, vLLM and SGLang agree)."""
    if num_layers < 7:  # below 7 layers, 2, N//2 and N-3 collide
        raise TapError(f"the default taps (2, N//2, N-3) need at least 7 layers; this target has {num_layers}: "
                       "pass --taps explicitly")
    return (2, num_layers // 2, num_layers - 3)


def parse_taps(spec: str | None) -> tuple[int, ...] | None:
    """A --taps string: comma-separated canonical taps ("2, 15,27"); None or "default" -> None (the
    default, which needs the target's layer count). Every command's --taps goes through here."""
    if spec is None or spec == "default":
        return None
    try:
        return tuple(int(s) for s in spec.split(",") if s.strip())
    except ValueError:
        raise TapError(f"--taps must be comma-separated integers (canonical taps), got {spec!r}") from None


@dataclass(frozen=True)
class TapContract:
    """The taps a draft reads, for a target with `num_layers` decoder layers, low to high.

    The draft's fc input is the concatenation of these taps in this order.
    """

    num_layers: int
    taps: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "taps", tuple(int(t) for t in self.taps))
        if self.num_layers < 1:
            raise TapError(f"num_layers must be >= 1, got {self.num_layers}")
        if not self.taps:
            raise TapError("a tap contract needs at least one tap")
        bad = [t for t in self.taps if not 0 <= t <= self.num_layers]
        if bad:
            raise TapError(f"taps {bad} out of range: a target with {self.num_layers} layers has taps "
                           f"0..{self.num_layers} (0 = embedding, {self.num_layers} = last layer before the final norm)")
        if list(self.taps) != sorted(set(self.taps)):
            raise TapError(f"taps must be distinct and increasing (the fc input order), got {list(self.taps)}")

    @classmethod
    def default(cls, num_layers: int) -> "TapContract":
        return cls(num_layers, default_taps(num_layers))

    @classmethod
    def parse(cls, num_layers: int, spec: str | Sequence[int] | None) -> "TapContract":
        """Taps from a CLI string ("2,15,27" or "default") or a sequence; None means the default."""
        taps = parse_taps(spec) if spec is None or isinstance(spec, str) else tuple(spec)
        return cls.default(num_layers) if taps is None else cls(num_layers, taps)

    def ids(self, convention: str) -> list[int]:
        return CONVENTIONS[convention].to_ids(self.taps, self.num_layers)

    def to_dict(self) -> dict:
        """The contract as stored in every artefact: canonical taps plus each convention's ids."""
        words = {}
        for name, conv in CONVENTIONS.items():
            try:
                words[name] = conv.to_ids(self.taps, self.num_layers)
            except TapError as e:
                words[name] = f"unsupported: {e}"
        return {
            "definition": "tap k = residual stream entering decoder layer k; 0 = embedding output, "
                          "N = last layer output before the final norm",
            "num_layers": self.num_layers,
            "taps": list(self.taps),
            "in_conventions": words,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "TapContract":
        try:
            return cls(int(d["num_layers"]), tuple(d["taps"]))
        except (KeyError, TypeError) as e:
            raise TapError(f"tap contract is missing field {e}: expected 'num_layers' and 'taps'") from None


@dataclass(frozen=True)
class Convention:
    """One project's numbering of taps. `offset` is tap - id; ids outside [lo, hi] taps are refused."""

    name: str
    meaning: str
    where: str  # the config key or place the ids live
    source: str  # the file the rule was read from
    offset: int
    lowest_tap: Callable[[int], int]
    highest_tap: Callable[[int], int]
    why_not: str = ""

    def _check(self, taps: Sequence[int], num_layers: int) -> None:
        lo, hi = self.lowest_tap(num_layers), self.highest_tap(num_layers)
        bad = [t for t in taps if not lo <= t <= hi]
        if bad:
            raise TapError(f"{self.name} cannot express taps {bad} (it reaches taps {lo}..{hi} of a "
                           f"{num_layers}-layer target){': ' + self.why_not if self.why_not else ''}")

    def to_ids(self, taps: Sequence[int], num_layers: int) -> list[int]:
        self._check(taps, num_layers)
        return [t - self.offset for t in taps]

    def from_ids(self, ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
        taps = tuple(int(i) + self.offset for i in ids)
        self._check(taps, num_layers)
        return taps


@dataclass(frozen=True)
class FirstIdHeuristic(Convention):
    """SGLang's deepseek_v2 family since PR #25454: +1 only when the first id is 1, else as-is.

    The tap list beginning at tap 1 cannot be written at all: ids [1, ...] mean taps [2, ...]. Ids [0, ...]
    mean tap 0, the embedding (_SGLANG_DEEPSEEK_WHY). Every other list is written as-is.
    """

    def to_ids(self, taps: Sequence[int], num_layers: int) -> list[int]:
        self._check(taps, num_layers)
        if taps[0] == 1:
            raise TapError(f"{self.name} cannot express a tap list starting at tap 1: ids [1, ...] are read "
                           "as taps [2, ...] by its first-id heuristic")
        return list(taps)

    def from_ids(self, ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
        taps = tuple(i + 1 for i in ids) if ids and ids[0] == 1 else tuple(ids)
        self._check(taps, num_layers)
        return taps


@dataclass(frozen=True)
class MaxIdSwitch(Convention):
    """SGLang's gpt_oss (0.5.17): ids whose largest is N are taps as they are, any other list is +1. Written
    +1 always (tap N as id N - 1), the form that every release of the rule reads alike."""

    def to_ids(self, taps: Sequence[int], num_layers: int) -> list[int]:
        self._check(taps, num_layers)
        return [t - 1 for t in taps]

    def from_ids(self, ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
        taps = tuple(ids) if ids and max(ids) == num_layers else tuple(int(i) + 1 for i in ids)
        self._check(taps, num_layers)
        return taps


def _n(n: int) -> int:
    return n


def _n_minus_1(n: int) -> int:
    return n - 1


def _zero(n: int) -> int:
    return 0


def _one(n: int) -> int:
    return 1


def _two(n: int) -> int:
    return 2


# SGLang 0.5.17 models/llama.py:434-437 captures `hidden_states + residual` at the start of layer i for i in
# layers_to_capture, which :885-897 sets to `[val + 1 for val in layer_ids]` (no ids: [2, N//2, N-3] as they are).
# i = 0 (id -1) adds None in llama.py; qwen2.py:411-415 keeps the embedding tensor itself there, which the in-place
# add-RMSNorm (layers/layernorm.py:484-485) then overwrites on CUDA. i = N (id N-1) is never reached.
_SGLANG_WHY = ("SGLang captures `hidden_states + residual` at the start of layer loop iteration id+1: "
               "the embedding (residual is None at layer 0) and the output of the last layer are never captured")

# SGLang 0.5.17's deepseek_v2 captures through LayerCommunicator instead (deepseek_v2.py:2825-2826 hands layer i the
# accumulator when i is in layers_to_capture). prepare_attn_and_capture_last_layer_outputs (layers/communicator.py:
# 505-535) appends the residual after prepare_attn, which at layer 0 makes the embedding the residual
# (communicator.py:619-620): layer 0 captures the embedding, tap 0. Nothing is captured after the loop
# (deepseek_v2.py:2888-2890), so the last layer's output is never captured.
_SGLANG_DEEPSEEK_WHY = ("SGLang's deepseek_v2 captures the residual stream as a layer starts (the embedding at layer 0), "
                        "and never the output of the last layer")

# SGLang 0.5.17's glm4_moe_lite reads the ids by deepseek_v2's first-id heuristic (glm4_moe_lite.py:1013-1028) but
# captures as llama does (:814, :838-840): residual is None at layer 0, so id 0 crashes, and ids [1, ...] mean [2, ...].
_SGLANG_GLM_LITE_WHY = ("SGLang's glm4_moe_lite captures `hidden_states + residual` as a layer starts (residual is "
                        "None at layer 0, a crash) and reads ids [1, ...] as taps [2, ...]: taps 0 and 1 cannot be "
                        "written")

# SGLang 0.5.17's gpt_oss captures boundaries (gpt_oss.py:723-741): boundary i + 1 after layer i, so the last layer's
# output is boundary N. Its setter (:1328-1343) keeps the ids as they are when their largest is N, else adds 1.
# Boundary 0 is the embedding tensor that layer 0 makes its residual, and the in-place add-RMSNorm overwrites it.
_SGLANG_GPT_OSS_WHY = ("SGLang's gpt_oss hands over boundary 0 as the embedding tensor its first layer then "
                       "updates in place")

# SGLang 0.5.17's qwen2_moe, qwen3_moe, qwen3_next and minimax_m2 capture through LayerCommunicator as a layer starts
# (qwen2_moe.py:891-894, 946-953; layers/communicator.py:505-535, a clone), with llama's +1 (qwen2_moe.py:1203-1218,
# qwen3_moe.py:1073-1087, qwen3_next.py:1263-1277, minimax_m2.py:1254-1267): id -1 is layer 0's, the embedding. Id
# N - 1 names no layer (qwen2_moe, qwen3_moe, qwen3_next: an IndexError at start-up).
_SGLANG_COMMUNICATOR_WHY = ("SGLang captures the residual stream as a layer starts (id -1: the embedding) and never "
                            "the output of the last layer")

# vLLM 0.26.0, models/interfaces.py `_maybe_add_hidden_state`: at id 0 (residual still None) it keeps the embedding
# tensor itself, not a sum; llama.py's first layer then makes that tensor its residual. Eager, fused_add_rms_norm's
# in-place kernel (platforms/cuda.py:692-694) updates it layer after layer: served eager with id 0, a SmolLM2 draft
# accepted 1.08 where the draft fed the last layer's output in that slot replays at 1.07 (`serve-check --wirings`).
# Compiled, the tensor is donated to the norm (compilation/passes/ir/inplace_functionalization.py:21-31): its contents
# are not defined afterwards. DeepSeek family (deepseek_v2.py:1430, 1468-1469): the sum with None fails instead.
# HF model_types vLLM 0.26.0 runs through models/deepseek_v2.py (registry.py: DeepseekV2/V3/V32ForCausalLM; Kimi-K2
# is DeepseekV3ForCausalLM): id 0 adds a residual still None there (deepseek_v2.py:1430, :1468-1469), so it fails.
VLLM_ID0_FAILS = frozenset(("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2"))
_VLLM_ID0 = ("vLLM (0.26.0) feeds the draft at id 0 not the embedding but the tensor its first layer takes as the "
             "residual, which the add-RMSNorm updates in place (eager: the last layer's output, measured; compiled: "
             "undefined); on a DeepSeek-family target it fails instead, adding a residual that is still None")

CONVENTIONS: dict[str, Convention] = {c.name: c for c in [
    Convention("hf", "index into HF output_hidden_states (hs[N] is post-norm, so tap N has no index)",
               "model(..., output_hidden_states=True).hidden_states[id]", "transformers modeling_*.py",
               0, _zero, _n_minus_1, "hidden_states[N] is after the final norm, not tap N"),
    Convention("vllm", "id j = tap j, captured as hidden_states + residual before layer j (N needs "
               "EagleModelMixin, vLLM PR #36063; DeepSeek family PR #46973)",
               "config.json top-level eagle_aux_hidden_state_layer_ids",
               "vllm/model_executor/models/llama.py, interfaces.py, deepseek_v2.py", 0, _one, _n, _VLLM_ID0),
    Convention("vllm-legacy", "id j = tap j, vLLM before EagleModelMixin: layers 1..N-1 only",
               "config.json top-level eagle_aux_hidden_state_layer_ids",
               "vllm/model_executor/models/llama.py (before PR #36063)", 0, _one, _n_minus_1,
               "this vLLM captures only before layers 1..N-1; upgrade vLLM for the embedding or last layer"),
    Convention("speculators", "id j = tap j (the vLLM convention); trainer flag --target-layer-ids",
               "config.json top-level eagle_aux_hidden_state_layer_ids",
               "vllm-project/speculators eagle3 config", 0, _zero, _n),
    Convention("sglang", "id j = tap j+1 (llama/qwen models add +1: `[val + 1 for val in layer_ids]`)",
               "config.json eagle_config.eagle_aux_hidden_state_layer_ids (nested)",
               "sglang/srt/models/llama.py:885-897 set_eagle3_layers_to_capture (0.5.17)", 1, _one, _n_minus_1,
               _SGLANG_WHY),
    Convention("sglang-deepseek-legacy", "DeepSeek family before PR #25454: id j = tap j+1, unconditionally",
               "config.json eagle_config.eagle_aux_hidden_state_layer_ids (nested)",
               "sglang/srt/models/deepseek_v2.py (before PR #25454)", 1, _one, _n_minus_1, _SGLANG_WHY),
    FirstIdHeuristic("sglang-deepseek", "DeepSeek family since PR #25454: id j = tap j+1 if ids[0] == 1, "
                     "else tap j", "config.json eagle_config.eagle_aux_hidden_state_layer_ids (nested)",
                     "sglang/srt/models/deepseek_v2.py:3134-3149 set_eagle3_layers_to_capture, :2825-2826 and "
                     "layers/communicator.py:505-535, 619-620 the capture (0.5.17)", 0, _zero, _n_minus_1,
                     _SGLANG_DEEPSEEK_WHY),
    FirstIdHeuristic("sglang-glm4-moe-lite", "glm4_moe_lite since PR #25454: id j = tap j+1 if ids[0] == 1, else "
                     "tap j; taps from 2", "config.json eagle_config.eagle_aux_hidden_state_layer_ids (nested)",
                     "sglang/srt/models/glm4_moe_lite.py:1013-1028 set_eagle3_layers_to_capture, :814 and "
                     ":838-840 the capture (0.5.17)", 0, _two, _n_minus_1, _SGLANG_GLM_LITE_WHY),
    MaxIdSwitch("sglang-gpt-oss", "gpt_oss: id j = tap j+1, or tap j for every id when the largest is N; taps 1..N",
                "config.json eagle_config.eagle_aux_hidden_state_layer_ids (nested)",
                "sglang/srt/models/gpt_oss.py:1328-1343 set_eagle3_layers_to_capture, :723-741 the capture "
                "(0.5.17)", 1, _one, _n, _SGLANG_GPT_OSS_WHY),
    Convention("sglang-communicator", "id j = tap j+1, captured by LayerCommunicator (id -1: the embedding)",
               "config.json eagle_config.eagle_aux_hidden_state_layer_ids (nested)",
               "sglang/srt/models/qwen2_moe.py:891-894, 1203-1218, qwen3_moe.py:1073-1087, qwen3_next.py:1263-1277, "
               "minimax_m2.py:1254-1267; layers/communicator.py:505-535 the capture (0.5.17)", 1, _zero,
               _n_minus_1, _SGLANG_COMMUNICATOR_WHY),
    Convention("specforge", "id j = 0-based OUTPUT of layer j = tap j+1 (also ModelOpt, TRT-LLM)",
               "eagle_aux_hidden_state_layer_ids in the draft/run config",
               "SpecForge specforge/modeling/target, ModelOpt eagle config", 1, _one, _n,
               "the embedding is no layer's output"),
    Convention("eagle", "id j = input of layer j = tap j (SafeAILab/EAGLE, hard-coded in modeling code)",
               "hard-coded in eagle/model/modeling_*_kv.py", "SafeAILab/EAGLE eagle/model/modeling_llama_kv.py",
               0, _zero, _n_minus_1, "the reference captures layer inputs only"),
]}

# SGLang's rule for each target family (HF model_type): (first release, convention), newest first. Each was read in
# 0.5.17's sglang/srt/models/ (the setter and the capture loop); a rule holds from 0.5.17 unless an older release
# was read too (PR #25454, in 0.5.13). A family not listed follows llama.py's rule (llama, qwen2, qwen3, mistral,
# phi3, llama4, glm4_moe, ...). deepseek_v32 and glm_moe_dsa run deepseek_v2.py's class (glm4_moe.py:1461).
SGLANG_HEURISTIC_SINCE = (0, 5, 13)  # deepseek_v2's first-id heuristic, PR #25454
_DEEPSEEK = ((SGLANG_HEURISTIC_SINCE, "sglang-deepseek"), ((0,), "sglang-deepseek-legacy"))
_COMMUNICATOR = (((0, 5, 17), "sglang-communicator"), ((0,), "sglang"))
SGLANG_FAMILIES: dict[str, tuple[tuple[tuple[int, ...], str], ...]] = {
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25", "glm_moe_dsa"), _DEEPSEEK),
    "glm4_moe_lite": ((SGLANG_HEURISTIC_SINCE, "sglang-glm4-moe-lite"), ((0,), "sglang-deepseek-legacy")),
    "gpt_oss": (((0, 5, 17), "sglang-gpt-oss"), ((0,), "sglang")),
    **dict.fromkeys(("qwen2_moe", "qwen3_moe", "qwen3_next", "mellum", "minimax_m2"), _COMMUNICATOR),
}


def sglang_eras(model_type: str | None) -> tuple[tuple[tuple[int, ...], str], ...]:
    """A family's SGLang rules, newest first: ((first release, convention), ...)."""
    return SGLANG_FAMILIES.get(model_type or "llama", (((0,), "sglang"),))


def sglang_releases(picked, eras=None) -> str:
    """The releases of the eras picked, in words: '0.5.13 and newer', 'before 0.5.13', '0.5.13 up to 0.5.17'."""
    eras = eras or picked
    parts = []
    for since, conv in picked:
        i = eras.index((since, conv))
        until = eras[i - 1][0] if i > 0 else None
        lo = ".".join(map(str, since)) if since != (0,) else None
        hi = ".".join(map(str, until)) if until else None
        parts.append("every release" if lo is None and hi is None else f"{lo} and newer" if hi is None
                     else f"before {hi}" if lo is None else f"{lo} up to {hi}")
    return ", ".join(parts)


def sglang_convention(model_type: str | None, version: tuple[int, ...] | None = None) -> str:
    """The SGLang convention for a target's HF model_type in a release (None: the newest rules)."""
    eras = sglang_eras(model_type)
    return eras[0][1] if version is None else next(conv for since, conv in eras if version >= since)


def sglang_default_taps(num_layers: int) -> tuple[int, ...]:
    """Taps SGLang captures when the ids are ABSENT (or unreadable: the bare except of 0.5.17's
    model_runner_components/spec_aux_hidden_state.py:80-94): [2, N//2, N-3] used WITHOUT the +1 (models/llama.py:
    889-892; sglang #23569)."""
    return (2, num_layers // 2, num_layers - 3)
