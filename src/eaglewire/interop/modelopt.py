"""NVIDIA Model-Optimizer (ModelOpt) EAGLE-3 exports: reading only.

Rules from NVIDIA/Model-Optimizer:
- modelopt/torch/export/plugins/hf_spec_export.py `EagleExporter`: `layers.N.*` names (no
  `midlayer`), `fc`, `norm`, optional `d2t` and `lm_head` (the base model's lm_head when the draft
  has none), NO t2d; config from hf_spec_configs.py `llama_eagle_template_config`
  (LlamaForCausalLMEagle3, nested eagle_config with eagle_aux_hidden_state_layer_ids,
  use_aux_hidden_state, use_input_layernorm_in_first_layer, use_last_layernorm, ...).
- modelopt/torch/speculative/plugins/hf_eagle.py: taps are captured by forward hooks on the
  OUTPUT of layer j (taps.CONVENTIONS["specforge"]); default_eagle_aux_layer_ids = [1, N//2-1, N-4].
- The draft vocabulary counts all tokens and keeps frequency order; only d2t is saved, so t2d is
  rebuilt with vocab.t2d_from_d2t.
"""

from __future__ import annotations

import re

from ..draft import DraftConfig
from ..errors import UsageError
from ..taps import default_taps
from .common import DraftDir, Reading, complete_vocab, draft_fields_from_hf, taps_from_ids, vocab_sizes

NAME = "modelopt"
MODELOPT_KEYS = ("use_input_layernorm_in_first_layer", "use_last_layernorm", "use_mtp_layernorm",
                 "parallel_draft_step")


def looks_like(cfg: dict, names: set[str]) -> bool:
    nested = cfg.get("eagle_config") or {}
    return isinstance(nested, dict) and any(k in nested for k in MODELOPT_KEYS) and "t2d" not in names


def read(dd: DraftDir, *, num_layers: int, vocab_size: int | None) -> Reading:
    cfg, where = dd.config, str(dd.path / "config.json")
    nested = cfg.get("eagle_config") or {}
    if "Eagle3DeepseekV2ForCausalLM" in (cfg.get("architectures") or []):
        raise UsageError(f"{where}: a Kimi-K2-style MLA draft layer; eaglewire drafts are Llama-style layers")
    if nested.get("use_aux_hidden_state") is False:
        raise UsageError(f"{where}: use_aux_hidden_state=false is an EAGLE-1/2 draft, not EAGLE-3")
    if "norm.weight" not in dd.tensors:
        raise UsageError(f"{where}: no norm.weight (use_last_layernorm=false): the lm_head reads an un-normed "
                         "state, which eaglewire drafts cannot express")
    tensors = dict(dd.tensors)
    unknown = sorted(k for k in tensors if not re.match(r"(layers\.\d+\.|fc\.|norm\.|lm_head\.|embed_tokens\.|d2t$)", k))
    if unknown:
        raise UsageError(f"{dd.path}: weights outside ModelOpt's EAGLE-3 export: {unknown}")
    vocab, draft_vocab = vocab_sizes(cfg, tensors, where, vocab_size)
    notes = complete_vocab(tensors, vocab, draft_vocab, where)
    ids = nested.get("eagle_aux_hidden_state_layer_ids") or None
    contract = taps_from_ids(ids, "specforge", num_layers, default_taps(num_layers))
    if ids is None:
        notes.append(f"no layer ids: ModelOpt's default [1, N//2-1, N-4] = taps {list(contract.taps)}")
    hidden = cfg.get("hidden_size")
    target_hidden = cfg.get("target_hidden_size") or hidden
    config = DraftConfig(**draft_fields_from_hf(cfg, where), vocab_size=vocab, draft_vocab_size=draft_vocab,
                         target_hidden_size=target_hidden, num_taps=tensors["fc.weight"].shape[1] // target_hidden)
    return Reading(source=NAME, convention="specforge", config=config, tensors=tensors, contract=contract, ids=ids,
                   ids_where="eagle_config.eagle_aux_hidden_state_layer_ids" if ids else None, notes=tuple(notes))
