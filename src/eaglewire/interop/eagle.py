"""SafeAILab/EAGLE reference EAGLE-3 drafts: reading only.

Rules from SafeAILab/EAGLE:
- eagle/model/cnets.py `Model`: `midlayer` (the first layer, residual = raw fc output), `fc` over
  3 taps (target_hidden_size if set), `norm`, `lm_head` over draft_vocab_size, buffers `d2t`/`t2d`;
  the embedding is loaded from the base model (`load_emb`); lm_head reads norm(hidden).
- eagle/model/modeling_llama_kv.py: the taps are hard-coded, the INPUT of layers 2, N//2 and N-3
  (taps.CONVENTIONS["eagle"]); the config carries no layer ids.
- eagle/traineagle3/config.json: a LlamaForCausalLM config plus draft_vocab_size; weights in
  model.safetensors or pytorch_model.bin (eagle/model/ea_model.py).
"""

from __future__ import annotations

import re

from ..draft import DraftConfig
from ..errors import UsageError
from ..taps import default_taps
from .common import DraftDir, Reading, complete_vocab, draft_fields_from_hf, taps_from_ids, vocab_sizes

NAME = "eagle"


def read(dd: DraftDir, *, num_layers: int, vocab_size: int | None) -> Reading:
    cfg, where = dd.config, str(dd.path / "config.json")
    tensors = {re.sub(r"^midlayer\.", "layers.0.", k): v for k, v in dd.tensors.items()}
    unknown = sorted(k for k in tensors if not re.match(r"(layers\.0\.|fc\.|norm\.|lm_head\.|embed_tokens\.|d2t$|t2d$)", k))
    if unknown:
        raise UsageError(f"{dd.path}: weights the EAGLE reference draft does not have: {unknown}")
    if "fc.weight" not in tensors:
        raise UsageError(f"{dd.path}: no fc.weight: an EAGLE-1/2 draft, not EAGLE-3")
    vocab, draft_vocab = vocab_sizes(cfg, tensors, where, vocab_size)
    notes = complete_vocab(tensors, vocab, draft_vocab, where)
    hidden = cfg.get("hidden_size")
    target_hidden = cfg.get("target_hidden_size") or hidden
    fields = draft_fields_from_hf(cfg, where)
    fields["num_layers"] = 1  # cnets.py builds one midlayer whatever num_hidden_layers says
    contract = taps_from_ids(None, NAME, num_layers, default_taps(num_layers))
    notes.append(f"taps hard-coded by the EAGLE reference (inputs of layers 2, N//2, N-3): {list(contract.taps)}")
    config = DraftConfig(**fields, vocab_size=vocab, draft_vocab_size=draft_vocab, target_hidden_size=target_hidden,
                         num_taps=tensors["fc.weight"].shape[1] // target_hidden)
    return Reading(source=NAME, convention="fixed", config=config, tensors=tensors, contract=contract, ids=None,
                   ids_where=None, notes=tuple(notes))
