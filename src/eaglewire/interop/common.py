"""What every format adapter shares: reading a draft directory, the HF-style config fields, the
`Reading` a format's reader produces, building the draft from it, and the logits comparison.

A format adapter never re-derives a tap index rule: ids go through `eaglewire.taps.CONVENTIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import files
from ..checkpoint import draft_from_tensors
from ..draft import DraftConfig, Eagle3Draft
from ..errors import EaglewireError, UsageError
from ..taps import CONVENTIONS, TapContract
from ..vocab import t2d_from_d2t, validate_vocab

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
SERVE = "SERVE.md"
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
# Every export records what it wrote, so our own importer never has to guess a convention.
PROVENANCE_KEY = "eaglewire"
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types values
# Layer-config keys an engine reads that DraftConfig does not hold in the source's own words: an import keeps them
# as written (Reading.carried) and an export to the same format writes them back where they still describe the draft.
AS_WRITTEN_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "layer_types", "use_sliding_window",
                   "sliding_window")


@dataclass(frozen=True, kw_only=True)
class DraftDir:
    """A draft directory as found on disk: config.json and every tensor, names as stored."""

    path: Path
    config: dict
    tensors: dict[str, torch.Tensor]
    weights_file: str

    @property
    def names(self) -> set[str]:
        return set(self.tensors)

    def ids(self, where: str) -> list[int] | None:
        """Layer ids at 'top' (config top level) or 'nested' (config.eagle_config); None if absent."""
        holder = self.config if where == "top" else (self.config.get("eagle_config") or {})
        ids = holder.get(IDS_KEY) if isinstance(holder, dict) else None
        if ids is None:
            return None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise UsageError(f"{self.path / CONFIG}: {'' if where == 'top' else 'eagle_config.'}{IDS_KEY} must be a "
                             f"list of integers, got {ids!r}")
        return ids


def int_field(cfg: dict, key: str) -> int | None:
    """An integer field as the engines read it; another type is the doctor's CONFIG_TYPE finding, not a crash in a
    reader."""
    v = cfg.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def read_dir(path) -> DraftDir:
    """config.json plus weights (model.safetensors, sharded safetensors, or pytorch_model.bin)."""
    root = Path(path)
    if not root.is_dir():
        raise UsageError(f"{root}: not a directory")
    cfile = root / CONFIG
    if not cfile.is_file():
        raise UsageError(f"{root}: no {CONFIG}; not a draft directory")
    config = files.read_json(cfile, fix="fetch or export the draft again")
    if not isinstance(config, dict):
        raise UsageError(f"{cfile}: expected a JSON object")
    found = sorted(root.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for f in found:
        tensors.update(files.read_safetensors(f, fix="fetch or export the draft again"))
    weights = ", ".join(f.name for f in found)
    if not found and (root / "pytorch_model.bin").is_file():
        # SafeAILab/EAGLE releases ship pickled weights; weights_only refuses anything but tensors.
        try:
            tensors = torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:
            raise UsageError(f"{root / 'pytorch_model.bin'}: not a plain tensor file ({e})") from None
        weights = "pytorch_model.bin"
    if not tensors:
        raise UsageError(f"{root}: no weights (*.safetensors or pytorch_model.bin)")
    return DraftDir(path=root, config=config, tensors=tensors, weights_file=weights)


@dataclass(frozen=True, kw_only=True)
class Reading:
    """One interpretation of a foreign directory: a native draft config, tensors under native names,
    the taps and how they were found. A reader produces one Reading per plausible convention."""

    source: str
    convention: str  # a key of taps.CONVENTIONS, or "fixed" where the source hard-codes its taps
    config: DraftConfig
    tensors: dict[str, torch.Tensor]
    contract: TapContract
    ids: list[int] | None  # as stored; None: absent, the source's default taps apply
    ids_where: str | None
    target: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    # What the source wrote that an engine reads and DraftConfig holds only in eaglewire's words (the layer config's
    # rope/window keys, the verifier): {"format", "layer", "verifier"}. Kept in the imported checkpoint for export.
    carried: dict = field(default_factory=dict)

    def key(self) -> tuple:
        """What must agree between two readings for the choice of source not to matter."""
        return (self.contract.taps, tuple(getattr(self.config, f) for f in NORM_FLAGS))


def taps_from_ids(ids: list[int] | None, convention: str, num_layers: int,
                  default_taps: tuple[int, ...]) -> TapContract:
    if ids is None:
        return TapContract(num_layers, default_taps)
    return TapContract(num_layers, CONVENTIONS[convention].from_ids(ids, num_layers))


def draft_fields_from_hf(cfg: dict, where: str) -> dict:
    """DraftConfig fields from a LlamaConfig-style dict (the layout every EAGLE-3 format uses)."""
    def need(key):
        if key not in cfg or cfg[key] is None:
            raise UsageError(f"{where}: missing {key!r}")
        return cfg[key]

    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    # as transformers 5's LlamaConfig, which both engines build the draft with: rope_parameters' theta first
    theta = (rope.get("rope_theta") if isinstance(rope, dict) else None) or cfg.get("rope_theta") or 10000.0
    scaling = dict(rope) if isinstance(rope, dict) and rope else None
    if scaling is not None:
        scaling.pop("rope_theta", None)
        if (scaling.get("rope_type") or scaling.get("type") or "default") == "default":
            scaling = None
    heads = need("num_attention_heads")
    return dict(hidden_size=need("hidden_size"), intermediate_size=need("intermediate_size"),
                num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim"), num_layers=cfg.get("num_hidden_layers") or 1,
                max_position_embeddings=cfg.get("max_position_embeddings") or 4096, rope_theta=theta,
                rope_scaling=scaling, rms_norm_eps=cfg.get("rms_norm_eps") or 1e-6,
                hidden_act=cfg.get("hidden_act") or "silu")


def window_from_hf(cfg: dict, where: str) -> int | None:
    """The sliding window a LlamaConfig-style layer config gives its layers, as vLLM and speculators read it: only
    through layer_types (vllm model_executor/models/llama.py:182-201: a "sliding_attention" layer gets
    config.sliding_window; speculators models/eagle3/core.py:97-105 the same); use_sliding_window is not read."""
    types = cfg.get("layer_types")
    if types is None:
        return None
    n = cfg.get("num_hidden_layers") or 1
    if not isinstance(types, list) or len(types) < n or not set(types) <= {SLIDING, FULL}:
        raise UsageError(f"{where}: layer_types must list {SLIDING!r} or {FULL!r} for each of the {n} draft "
                         f"layer(s), got {types!r}")
    kinds = set(types[:n])
    if kinds == {FULL}:
        return None
    if kinds != {SLIDING}:
        raise UsageError(f"{where}: layer_types {types[:n]} mixes sliding and full attention; eaglewire drafts apply "
                         "one window to every layer: import a draft whose layers all slide or none do")
    w = cfg.get("sliding_window")
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        raise UsageError(f"{where}: layer_types says {SLIDING} but sliding_window is {w!r}: set it to the window "
                         "the draft was trained with (speculators' default is 2048)")
    return w


def window_fields(c: DraftConfig) -> dict:
    """The layer-config keys of a draft's window, as speculators' scripts/train.py writes them."""
    if c.sliding_window is None:
        return {}
    return {"sliding_window": c.sliding_window, "layer_types": [SLIDING] * c.num_layers, "use_sliding_window": True}


def as_written(layer: dict, written: dict | None, c: DraftConfig, where: str) -> dict:
    """`layer` (hf_fields) with the rope/window keys as the source wrote them (Reading.carried["layer"]), where
    they still read back as this draft's config; else `layer` unchanged (the draft changed since its import)."""
    if not written:
        return layer
    out = {k: v for k, v in layer.items() if k not in AS_WRITTEN_KEYS or k in written} | dict(written)
    try:
        mine = {k: getattr(c, k) for k in ("rope_theta", "rope_scaling")}
        theirs = DraftConfig(**{**c.to_dict(), **{k: draft_fields_from_hf(out, where)[k] for k in mine}})
        same = ({k: getattr(theirs, k) for k in mine} == mine and window_from_hf(out, where) == c.sliding_window)
    except UsageError:
        same = False
    return out if same else layer


def hf_fields(c: DraftConfig) -> dict:
    """A LlamaConfig-style dict for a draft: what SGLang, vLLM and speculators build the layer from."""
    d = {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
         "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
         "head_dim": c.head_dim, "num_hidden_layers": c.num_layers, "vocab_size": c.vocab_size,
         "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
         "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None, "rms_norm_eps": c.rms_norm_eps,
         "hidden_act": c.hidden_act, "attention_bias": False, "mlp_bias": False,
         # tie_word_embeddings=True makes SGLang use embed_tokens as lm_head (llama_eagle3.py __init__).
         "tie_word_embeddings": False, **window_fields(c)}
    if c.target_hidden_size != c.hidden_size:
        d["target_hidden_size"] = c.target_hidden_size
    return d


def check_flag_values(cfg: dict, where: str) -> None:
    for f in NORM_FLAGS:
        if f in cfg and not isinstance(cfg[f], bool):
            raise UsageError(f"{where}: {f} must be true or false, got {cfg[f]!r}")


def vocab_sizes(cfg: dict, tensors: dict, where: str, target_vocab: int | None) -> tuple[int, int]:
    """(target vocab, draft vocab) from config, t2d and lm_head, cross-checked."""
    head = tensors.get("lm_head.weight")
    draft_vocab = cfg.get("draft_vocab_size") or (head.shape[0] if head is not None else None)
    vocab = tensors["t2d"].numel() if "t2d" in tensors else (cfg.get("vocab_size") or target_vocab)
    if vocab is None or draft_vocab is None:
        raise UsageError(f"{where}: cannot tell the target vocabulary and draft vocabulary sizes "
                         "(no t2d, vocab_size, draft_vocab_size or lm_head.weight); pass --target")
    if head is not None and head.shape[0] != draft_vocab:
        raise UsageError(f"{where}: lm_head.weight has {head.shape[0]} rows but draft_vocab_size is {draft_vocab}")
    return int(vocab), int(draft_vocab)


def complete_vocab(tensors: dict, vocab: int, draft_vocab: int, where: str) -> list[str]:
    """Fill d2t/t2d the source left out; returns notes. Without d2t the draft vocabulary must be the target's."""
    notes = []
    if "d2t" not in tensors:
        if draft_vocab != vocab:
            raise UsageError(f"{where}: no d2t but draft vocabulary {draft_vocab} != target vocabulary {vocab}: "
                             "the draft-to-target token map is missing")
        tensors["d2t"] = torch.zeros(vocab, dtype=torch.long)
        notes.append("no d2t: the draft vocabulary is the full target vocabulary (identity map)")
    tensors["d2t"] = tensors["d2t"].long()
    if "t2d" not in tensors:
        tensors["t2d"] = t2d_from_d2t(tensors["d2t"], vocab)
        notes.append("no t2d: rebuilt from d2t (vocab.t2d_from_d2t)")
    tensors["t2d"] = tensors["t2d"].bool()
    validate_vocab(tensors["d2t"], tensors["t2d"], vocab, where=f"{where}: d2t/t2d")
    return notes


def build_draft(reading: Reading, embedding: torch.Tensor | None = None) -> Eagle3Draft:
    """An Eagle3Draft holding exactly the reading's tensors; the embedding comes from the target if absent."""
    tensors = dict(reading.tensors)
    if "embed_tokens.weight" not in tensors:
        if embedding is None:
            raise UsageError(f"{reading.source} draft has no embed_tokens.weight (engines take the target's): "
                             "pass --target so the target's embedding can be copied in")
        tensors["embed_tokens.weight"] = embedding.detach().to("cpu", torch.float32)
    dtype = tensors["fc.weight"].dtype  # one dtype for the whole draft, the fc's (sources mix them)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
    # d2t/t2d: each reader has validated (or, for the doctor, deliberately kept) them
    return draft_from_tensors(reading.config, tensors, where=f"{reading.source} draft", config_name="its config",
                              check_vocab=False)


def provenance(fmt: str, convention: str, contract: TapContract, target: dict, engine_version: str | None,
               config: DraftConfig) -> dict:
    from .. import __version__

    return {"format": fmt, "convention": convention, "engine_version": engine_version,
            "eaglewire_version": __version__, "taps": contract.to_dict(), "target": target,
            "draft": config.to_dict()}


def probe_logits(model: Eagle3Draft, seed: int = 0, T: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and hidden of two draft steps (a prefill, then a TTT-style step over its own output)."""
    from ..draft import ttt_mask

    c = model.config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, c.vocab_size, (1, T), generator=g)
    taps = torch.randn(1, T, c.fc_in_features, generator=g).to(model.fc.weight.dtype)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        cache = model.new_cache(1)
        logits0, h = model(ids, model.fuse(taps), pos, cache=cache)
        logits1, _ = model(ids.roll(-1, 1), h, pos + 1, cache=cache, attn_mask=ttt_mask(T, 1))
    return logits0, logits1


def assert_same_draft(a: Eagle3Draft, b: Eagle3Draft, what: str) -> None:
    """Any difference in config, buffers or draft logits is an error (the same tensors give the same floats)."""
    if a.config != b.config:
        diff = {k: (v, getattr(b.config, k)) for k, v in a.config.to_dict().items() if getattr(b.config, k) != v}
        raise EaglewireError(f"{what}: the reloaded draft's config differs: {diff}")
    for name in ("d2t", "t2d"):
        if not torch.equal(getattr(a, name), getattr(b, name)):
            raise EaglewireError(f"{what}: the reloaded draft's {name} differs")
    for x, y in zip(probe_logits(a), probe_logits(b)):
        if not torch.equal(x, y):
            raise EaglewireError(f"{what}: draft logits differ after reloading (max |diff| "
                                 f"{(x.float() - y.float()).abs().max().item():.3g})")
