"""`DraftConfig`: the shape and flags of an EAGLE-3 draft (frozen, validated on construction), and how one is
made for a target (`DraftConfig.for_target`). The draft itself is draft.py."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import partial

import torch.nn.functional as F

from .errors import UsageError
from .targets import text_config

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
                "relu": F.relu}
# RoPE scalings implemented below, with the keys each needs (transformers modeling_rope_utils.py names).
_ROPE_SCALINGS = {"linear": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """Shape and behaviour of an EAGLE-3 draft. None fields are derived in __post_init__.

    Norm flags: each has ONE meaning here; the defaults (all False) are the EAGLE-3 reference
    and SGLang behaviour. Projects that use the same names differently are noted; exporters write
    every flag explicitly in each engine's words.

    norm_before_residual: layer 0's residual is hidden_norm(h) instead of the raw fused h.
        The speculators project (models/eagle3/model_definitions.py) and vLLM (llama_eagle3.py, read with
        getattr(.., False)) mean the same; the speculators trainer defaults it to True
        (train/config/schema.py), its config class to False; SGLang hard-codes False.
    norm_before_fc: ONE RMSNorm over the whole concatenated fc input (n*Ht wide) before fc
        (weight `fc_input_norm.weight`; speculators calls it `input_norm`, "gpt-oss style", and its
        trainer defaults it to True for eagle3).
    fc_norm: one RMSNorm PER TAP (Ht wide each) before the concatenation enters fc (EAGLE 3.1;
        weights `fc_norm.{i}.weight`, as in speculators, SpecForge and vLLM). Excludes norm_before_fc
        (speculators models/eagle3/config.py refuses both).
    norm_output: the hidden state handed to the next draft step (`forward`'s second output) is the
        POST-final-norm state, and lm_head reads it directly; when False it is the pre-norm layer
        output and lm_head reads norm(h). Either way the final norm precedes lm_head. This is the
        speculators / vLLM EAGLE 3.1 meaning (speculators trainer default True). SpecForge's
        `norm_output` means something else: whether the final norm precedes lm_head at all
        (llama3_eagle.py compute_logits, default True) - always true here.
    sliding_window: None (full causal attention) or W: every draft layer's query at position p sees
        only keys at positions > p - W (transformers' and vLLM's meaning: vllm
        model_executor/models/llama.py:182-201 gives a "sliding_attention" layer config.sliding_window).
        The speculators project trains its draft layer with W = 2048 by default.
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int  # the target's vocabulary: rows of embed_tokens
    num_key_value_heads: int | None = None  # None: = num_attention_heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    target_hidden_size: int | None = None  # None: = hidden_size
    num_taps: int = 3
    num_layers: int = 1
    draft_vocab_size: int | None = None  # None: = vocab_size (no vocabulary reduction)
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    sliding_window: int | None = None

    def __post_init__(self):
        def bad(field, why):
            raise UsageError(f"draft config: {field} {why}, got {getattr(self, field)!r}")

        for name, default in (("num_key_value_heads", self.num_attention_heads),
                              ("target_hidden_size", self.hidden_size), ("draft_vocab_size", self.vocab_size)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if self.head_dim is None and isinstance(self.hidden_size, int) and isinstance(self.num_attention_heads, int):
            if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads == 0:
                object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for f in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "num_key_value_heads",
                  "head_dim", "target_hidden_size", "num_taps", "num_layers", "draft_vocab_size",
                  "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f, "must be a positive integer" + (" (or set head_dim: hidden_size is not a multiple of "
                                                       "num_attention_heads)" if f == "head_dim" else ""))
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            bad("sliding_window", "must be null (full attention) or a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_key_value_heads", f"must divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            bad("head_dim", "must be even (RoPE rotates pairs)")
        if self.draft_vocab_size > self.vocab_size:
            bad("draft_vocab_size", f"must be <= vocab_size={self.vocab_size}")
        for f in ("rope_theta", "rms_norm_eps"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                bad(f, "must be a positive number")
            object.__setattr__(self, f, float(v))
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACTIVATIONS:
            bad("hidden_act", f"must be one of {sorted(ACTIVATIONS)}")
        for f in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
            if not isinstance(getattr(self, f), bool):
                bad(f, "must be true or false")
        if self.norm_before_fc and self.fc_norm:
            raise UsageError("draft config: norm_before_fc (one norm over all taps) and fc_norm (one norm per tap) "
                             "exclude each other; set one of them")
        object.__setattr__(self, "rope_scaling", _check_rope_scaling(self.rope_scaling))

    def __hash__(self):  # rope_scaling is a dict: hash the JSON form
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    @property
    def fc_in_features(self) -> int:
        return self.num_taps * self.target_hidden_size

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        if not isinstance(d, dict):
            raise UsageError(f"draft config must be a JSON object, got {type(d).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise UsageError(f"draft config: unknown field(s) {unknown}; known fields are {sorted(fields)}")
        missing = sorted(n for n, f in fields.items() if n not in d and f.default is dataclasses.MISSING)
        if missing:
            raise UsageError(f"draft config: missing field(s) {missing}")
        return cls(**d)

    @classmethod
    def for_target(cls, target_config, num_taps: int, draft_vocab_size: int | None, **overrides) -> "DraftConfig":
        """A draft shaped like the target (dims, heads, RoPE, eps, vocab); `overrides` win.

        Overriding hidden_size or num_attention_heads without head_dim re-derives head_dim.
        """
        cfg = text_config(target_config)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise UsageError(f"draft config: unknown override(s) {unknown}; known fields are {sorted(fields)}")
        theta, scaling = _target_rope(cfg)
        if unsupported_rope(target_config):
            scaling = None  # a new draft is trained and served with its own RoPE
        kw = dict(hidden_size=cfg.hidden_size, target_hidden_size=cfg.hidden_size,
                  # GPT-2 names it n_inner, and None there means 4 x hidden
                  intermediate_size=getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None)
                  or 4 * cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                  num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
                  head_dim=getattr(cfg, "head_dim", None), vocab_size=cfg.vocab_size,
                  max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096), rope_theta=theta,
                  rope_scaling=scaling, rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
                  hidden_act=getattr(cfg, "hidden_act", "silu"), num_taps=num_taps,
                  draft_vocab_size=draft_vocab_size)
        if {"hidden_size", "num_attention_heads"} & set(overrides) and "head_dim" not in overrides:
            kw["head_dim"] = None
        kw.update(overrides)
        return cls(**kw)


def _check_rope_scaling(rs) -> dict | None:
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise UsageError(f"draft config: rope_scaling must be null or an object, got {rs!r}")
    kind = rs.get("rope_type") or rs.get("type") or "default"  # "type": the pre-4.45 transformers key
    rs = {k: v for k, v in rs.items() if k not in ("type", "rope_theta")} | {"rope_type": kind}
    if rs.get("partial_rotary_factor", 1.0) != 1.0:
        raise UsageError(f"draft config: rope_scaling partial_rotary_factor={rs['partial_rotary_factor']} is not "
                         "supported by the eaglewire draft (it rotates the whole head)")
    if kind == "default":
        return None
    if kind not in _ROPE_SCALINGS:
        raise UsageError(f"draft config: rope_scaling type {kind!r} is not supported by the eaglewire draft "
                         f"(supported: {sorted(_ROPE_SCALINGS)}); pass rope_scaling=None to train without it")
    missing = [k for k in _ROPE_SCALINGS[kind] if not isinstance(rs.get(k), (int, float))]
    if missing:
        raise UsageError(f"draft config: rope_scaling of type {kind!r} needs numeric {missing}, got {rs!r}")
    return rs


def unsupported_rope(target_config) -> str | None:
    """The target's RoPE scaling type when the draft does not implement it (yarn, dynamic, ...), else None. A new
    draft need not share the target's scaling: it is trained and served with its own."""
    scaling = _target_rope(text_config(target_config))[1] or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return None if kind == "default" or kind in _ROPE_SCALINGS else kind


def _target_rope(cfg) -> tuple[float, dict | None]:
    # transformers 5 keeps theta and scaling together in `rope_parameters`; older configs have
    # `rope_theta` plus `rope_scaling`.
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(cfg, "rope_theta", None) or 10000.0
    return float(theta), (params or None)
