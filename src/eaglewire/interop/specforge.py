"""SpecForge draft directories (`LlamaForCausalLMEagle3`, `midlayer.*` names): reading only.

Rules from sgl-project/SpecForge:
- specforge/modeling/draft/llama3_eagle.py: `midlayer` (the first layer), `fc` over 3 taps of
  target_hidden_size, optional `fc_norm.{i}` per-tap norms, `norm`, `lm_head`, buffers `d2t`/`t2d`.
  The residual is the raw fc output. `norm_output` (default True) means only "the final norm precedes
  lm_head" (compute_logits), and the state fed to the next step is the pre-norm layer output.
- specforge/algorithms/model_providers.py `resolve_eagle_capture_layers`: ids from the run, else
  the nested eagle_config, else [1, N//2 - 1, N - 4]; an id is the 0-based OUTPUT of layer j
  (taps.CONVENTIONS["specforge"], the same as ModelOpt and TensorRT-LLM).
- specforge/export/to_sglang.py: the exported directory drops the embedding (the engine takes
  the target's) and must hold fc.weight, norm.weight, lm_head.weight, t2d and d2t.
"""

from __future__ import annotations

import re

from ..draft import DraftConfig
from ..errors import UsageError
from ..taps import default_taps
from . import sglang
from .common import (DraftDir, Reading, check_flag_values, complete_vocab, draft_fields_from_hf, taps_from_ids,
                     vocab_sizes)

NAME = "specforge"
ARCH = "LlamaForCausalLMEagle3"
_LEGACY_FC_NORM = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}


def native_name(name: str) -> str:
    name = re.sub(r"^midlayer\.", "layers.0.", name)
    for old, new in _LEGACY_FC_NORM.items():
        name = name.replace(old, new)
    return name


def read(dd: DraftDir, *, num_layers: int, vocab_size: int | None) -> Reading:
    cfg, where = dd.config, str(dd.path / "config.json")
    check_flag_values(cfg, where)
    if cfg.get("norm_output") is False:
        raise UsageError(f"{where}: norm_output=false means SpecForge's lm_head reads the UN-normed hidden state "
                         "(llama3_eagle.py compute_logits); eaglewire drafts always norm before lm_head")
    if cfg.get("norm_before_fc") or cfg.get("norm_before_residual"):
        raise UsageError(f"{where}: SpecForge's llama3_eagle.py has no norm_before_fc / norm_before_residual; "
                         "this directory is not a SpecForge draft: pass --source")
    tensors = {native_name(k): v for k, v in dd.tensors.items()}
    unknown = sorted(k for k in tensors if not re.match(r"(layers\.\d+\.|fc\.|fc_norm\.\d+\.|norm\.|lm_head\.|"
                                                        r"embed_tokens\.|d2t$|t2d$)", k))
    if unknown:
        raise UsageError(f"{dd.path}: weights SpecForge's draft does not have: {unknown}")
    vocab, draft_vocab = vocab_sizes(cfg, tensors, where, vocab_size)
    notes = complete_vocab(tensors, vocab, draft_vocab, where)
    fc = tensors.get("fc.weight")
    if fc is None:
        raise UsageError(f"{dd.path}: no fc.weight")
    hidden = cfg.get("hidden_size")
    target_hidden = cfg.get("target_hidden_size") or hidden
    nested, top = dd.ids("nested"), dd.ids("top")
    ids, ids_where = (nested, "eagle_config.eagle_aux_hidden_state_layer_ids") if nested is not None else \
        ((top, "eagle_aux_hidden_state_layer_ids") if top is not None else (None, None))
    contract = taps_from_ids(ids, NAME, num_layers, default_taps(num_layers))
    if ids is None:
        notes.append(f"no layer ids: SpecForge's default [1, N//2-1, N-4] = taps {list(contract.taps)}")
    config = DraftConfig(**draft_fields_from_hf(cfg, where), vocab_size=vocab, draft_vocab_size=draft_vocab,
                         target_hidden_size=target_hidden, num_taps=fc.shape[1] // target_hidden,
                         fc_norm=bool(cfg.get("fc_norm") or cfg.get("use_aux_norm")))
    return Reading(source=NAME, convention=NAME, config=config, tensors=tensors, contract=contract, ids=ids,
                   ids_where=ids_where, notes=tuple(notes), carried=sglang.carried_of(cfg))
