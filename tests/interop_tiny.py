"""Tiny drafts and targets for the interop tests: hidden 32, draft vocab 64, target vocab 128."""

import torch

from eaglewire.checkpoint import save_draft
from eaglewire.draft import DraftConfig, Eagle3Draft
from eaglewire.taps import TapContract

LLAMA = {"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 8, "hidden_size": 32,
         "vocab_size": 128}
DEEPSEEK = {"architecture": "DeepseekV3ForCausalLM", "model_type": "deepseek_v3", "num_layers": 61,
            "hidden_size": 32, "vocab_size": 128}


def tiny_draft(seed: int = 0, num_taps: int = 3, **flags) -> Eagle3Draft:
    """A draft with random (not default) weights everywhere, incl. norms, and a scattered draft vocabulary."""
    torch.manual_seed(seed)
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=128, draft_vocab_size=64, num_taps=num_taps,
                      max_position_embeddings=256, **flags)
    m = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    keep = torch.randperm(128)[:64].sort().values
    t2d = torch.zeros(128, dtype=torch.bool)
    t2d[keep] = True
    m.set_vocab(keep - torch.arange(64), t2d)
    return m.eval()


def save_tiny(path, taps=(2, 4, 5), target=LLAMA, **kw):
    m = tiny_draft(num_taps=len(taps), **kw)
    save_draft(m, path, contract=TapContract(target["num_layers"], tuple(taps)), target_fingerprint=dict(target))
    return m


def draft_steps(m: Eagle3Draft, taps: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor):
    """Logits of two TTT steps the way speculators' forward runs them (teacher-forced ids shifted left)."""
    from eaglewire.draft import ttt_mask

    T = ids.shape[1]
    with torch.no_grad():
        cache = m.new_cache(1)
        l0, h = m(ids, m.fuse(taps), pos, cache=cache)
        ids1 = torch.cat([ids[:, 1:], torch.zeros(1, 1, dtype=torch.long)], dim=1)
        l1, _ = m(ids1, h, pos + 1, cache=cache, attn_mask=ttt_mask(T, 1))
    return l0, l1
