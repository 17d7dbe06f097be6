"""Fixtures for the doctor tests and docs/DOCTOR.md: a tiny target whose next token is a function of
one specific tap of the PREVIOUS position, and a draft built (not trained) to read exactly that tap.

The target (8 layers, hidden 32, vocab 128): layers 0..6 are per-token (no attention output) with
strong MLPs, so every tap is a different function of the current token; layer 7 is a pure
previous-token head (constant q/k biases whose RoPE phase peaks at distance 1, v = identity,
o = 40 x identity), so the last state at position t+1 is dominated by norm(tap 7 at position t).
Hence the target's argmax at t+1 = argmax lm_head(norm(tap 7 at t)), and a draft whose fc copies
tap 7 into its residual (layer contributions zeroed, the target's lm_head) predicts it exactly,
while tap 6 or tap 8 give a different function: the probe can tell the wirings apart.

Run as a script to write the fixtures of docs/DOCTOR.md:  python tests/doctor_fixtures.py OUTDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from eaglewire.capture import locate
from eaglewire.checkpoint import save_draft, tap_stats
from eaglewire.draft import DraftConfig, Eagle3Draft
from eaglewire.targets import Target, fingerprint
from eaglewire.taps import TapContract

KEY_TAP = 7  # the tap the draft reads, in its LAST fc slot
TAPS = (2, 4, KEY_TAP)
GAIN = 40.0  # the previous-token head's output scale: dominates the current token's own state
THETA = 10000.0


def probe_target(seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=8, attention_bias=True,
                         max_position_embeddings=256, rope_theta=THETA, tie_word_embeddings=False)
    m = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for i, layer in enumerate(m.model.layers):
            a = layer.self_attn
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                lin.bias.zero_()
            if i < 7:  # per-token layers: no attention output, a strong MLP
                a.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.mul_(30.0)
            else:
                _previous_token_head(a, cfg)
                layer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.mul_(30.0)  # a peaked target distribution
    return m


def _previous_token_head(attn, cfg) -> None:
    """q.k after RoPE = a^2 sum_f cos(theta_f (d - 1)) for distance d: the previous token wins."""
    hd, nh = cfg.head_dim, cfg.num_attention_heads
    inv = 1.0 / (THETA ** (torch.arange(0, hd, 2).float() / hd))  # (hd/2,)
    a = 12.0
    q = torch.cat([torch.full((hd // 2,), a), torch.zeros(hd // 2)])  # HF rotate_half pairs (f, f + hd/2)
    k = torch.cat([a * torch.cos(inv), a * torch.sin(inv)])
    attn.q_proj.weight.zero_()
    attn.k_proj.weight.zero_()
    attn.q_proj.bias.copy_(q.repeat(nh))
    attn.k_proj.bias.copy_(k.repeat(nh))
    attn.v_proj.weight.copy_(torch.eye(cfg.hidden_size))
    attn.o_proj.weight.copy_(GAIN * torch.eye(cfg.hidden_size))


def probe_draft(target, taps=TAPS, key_slot: int | None = None) -> Eagle3Draft:
    """A draft whose fc copies one tap slot (default: the last) into its residual and adds nothing else."""
    key_slot = len(taps) - 1 if key_slot is None else key_slot
    cfg = DraftConfig.for_target(target.config, num_taps=len(taps), draft_vocab_size=None)
    d = Eagle3Draft(cfg).eval()
    H = cfg.hidden_size
    with torch.no_grad():
        d.load_target_embedding(locate(target).embed.weight)
        d.fc.weight.zero_()
        d.fc.weight[:, key_slot * H:(key_slot + 1) * H] = torch.eye(H)
        d.layers[0].self_attn.o_proj.weight.zero_()
        d.layers[0].mlp.down_proj.weight.zero_()
        d.lm_head.weight.copy_(target.lm_head.weight)
    return d


def as_target(model) -> Target:
    return Target(spec="probe-target", model=model, tokenizer=None, fingerprint=fingerprint(model))


def records(model, draft, taps=TAPS) -> tuple[dict, dict]:
    """(metrics, tap_stats) as the trainer would record them, measured on other sequences than the probe's."""
    from eaglewire.doctor import probe as P

    from eaglewire.doctor import probe_inputs

    t = as_target(model)
    seqs = probe_inputs.sequences(t, 8, seed=123).seqs
    states = [probe_inputs.capture_states(model, ids) for ids, _ in seqs]
    r, _ = P.measure(draft, seqs, states, P.Wiring(tuple(taps), "trained"), 3)
    stats = tap_stats(torch.cat([torch.cat([st[k] for k in taps], -1) for st in states]), len(taps))
    return {"heldout": {"acc": [r["acc1"]]}}, stats


def save_probe_checkpoint(path, model=None, taps=TAPS) -> Path:
    model = model if model is not None else probe_target()
    draft = probe_draft(model, taps)
    m, stats = records(model, draft, taps)
    return save_draft(draft, path, contract=TapContract(8, tuple(taps)), target_fingerprint=fingerprint(model),
                      metrics=m, tap_stats=stats)


def char_tokenizer():
    """A 128-token character-level fast tokenizer (ASCII), so the probe target loads like any HF model."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(128)}
    tok = Tokenizer(WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="?", eos_token="\x03", pad_token="\x00")


def save_target_dir(path, model=None) -> Path:
    model = model if model is not None else probe_target()
    path = Path(path)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def main(out: str) -> None:
    """Fixtures for docs/DOCTOR.md: OUT/target (HF dir) and OUT/draft (native checkpoint)."""
    out = Path(out)
    model = probe_target()
    save_target_dir(out / "target", model)
    save_probe_checkpoint(out / "draft", model)
    print(f"wrote {out / 'target'} and {out / 'draft'} (taps {list(TAPS)})")


if __name__ == "__main__":
    main(sys.argv[1])
