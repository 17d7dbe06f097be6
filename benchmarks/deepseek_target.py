"""A small DeepSeek-V3-style target, built on the machine: MLA attention, MoE layers after a few dense ones, as
Kimi-K2.5 (which SGLang runs as DeepseekV2ForCausalLM's family) has them. Random weights, SmolLM2's tokenizer.

    python benchmarks/deepseek_target.py --out DIR [--layers 12] [--dense 3] [--hidden 1024] [--seed 0] [--lens]

The seed incident's draft was for this family, and SGLang reads its tap ids by its own rule
(models/deepseek_v2.py, the first-id heuristic since 0.5.13). Nothing large is staged: the weights are drawn
here from a seed. A random target can show a wiring fault only if its taps differ in what they say about its
next token. `--lens` measures that: for each tap, how often the target's own head on that tap's hidden state
picks the token the whole model picks, over the model's greedy replies. On a 512-wide copy (12 layers, CPU)
that was 29% at tap 9, 23% at tap 8, 4% at tap 2 and 0% for the embedding: a draft fed tap 8 for tap 9 loses
some of its signal, one fed the embedding for tap 2 little. What a served draft loses is the engine's measure.

The config is transformers' own DeepseekV3Config, with the keys DeepSeek-V3's config.json carries that SGLang's
gate and MoE read and transformers does not declare (topk_method, scoring_func, seq_aux, aux_loss_alpha,
moe_layer_freq, ep_size). The expert layout keeps DeepSeek-V3's ratios at a smaller width: 64 routed
experts in 8 groups, 4 groups and 8 experts a token, one shared expert; MLA keeps V3's head layout (a
512-wide latent KV, 64 rotary and 128 plain dims a head, a 128-wide value), the shapes SGLang's MLA
kernels are built for.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

# What DeepSeek-V3's config.json holds beyond transformers' DeepseekV3Config fields, with V3's values.
V3_EXTRA = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "seq_aux": True, "aux_loss_alpha": 0.001,
            "moe_layer_freq": 1, "ep_size": 1}


def config(*, layers: int, dense: int, hidden: int, heads: int, vocab_size: int, bos: int, eos: int,
           experts: int = 64, groups: int = 8, topk_group: int = 4, per_token: int = 8, kv_lora_rank: int = 512,
           q_lora_rank: int | None = 384, rope_dim: int = 64, nope_dim: int = 128, v_dim: int = 128,
           moe_width: int | None = None, max_positions: int = 4096):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=4 * hidden,
        moe_intermediate_size=moe_width or hidden // 4, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=experts, routed_scaling_factor=2.5,
        kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank, qk_rope_head_dim=rope_dim, qk_nope_head_dim=nope_dim,
        v_head_dim=v_dim, n_group=groups, topk_group=topk_group, num_experts_per_tok=per_token,
        first_k_dense_replace=dense, norm_topk_prob=True, max_position_embeddings=max_positions,
        rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False,
        **V3_EXTRA)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


def build(out: Path, tokenizer_dir: Path, *, seed: int = 0, dtype: str = "bfloat16", **shape) -> Path:
    """Write a random DeepSeek-V3-style model and `tokenizer_dir`'s tokenizer into `out` (a new directory)."""
    import torch
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    out = Path(out)
    if out.exists():
        raise SystemExit(f"--out {out}: exists; choose a new directory")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = config(vocab_size=len(tok), bos=tok.bos_token_id, eos=tok.eos_token_id, **shape)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)  # whole, or not at all
    return out


def lens(model_dir: Path, device: str = "cpu", new_tokens: int = 64) -> list[float]:
    """Per tap j (0 = the embedding, N = the last layer's output): the share of the model's greedy reply tokens,
    over the doctor probe's first 8 built-in prompts, where argmax(lm_head(norm(hidden_states[j]))) is the
    model's own."""
    import torch

    from eaglewire import targets
    from eaglewire.doctor.probe_inputs import sequences

    t = targets.load_target(str(model_dir), dtype=torch.float32, device=device)
    model, agree, total = t.model, None, 0
    for ids, mask in sequences(t, 8, new_tokens=new_tokens).seqs:
        at = mask[1:].nonzero().squeeze(1).to(t.device)  # the positions that chose the reply's tokens
        with torch.no_grad():
            o = model(ids[None].to(t.device), output_hidden_states=True)
            final = o.logits[0, at].argmax(-1)
            hs = o.hidden_states  # transformers: the last is already normed
            picks = [model.lm_head(model.model.norm(h[0, at])).argmax(-1) for h in hs[:-1]] + [final]
        hits = torch.stack([(p == final).sum() for p in picks]).double()
        agree = hits if agree is None else agree + hits
        total += final.numel()
    return (agree / total).tolist()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default="smollm2-135m", help="a registry target or model directory to take the "
                   "tokenizer (and chat template) from")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dense", type=int, default=3, help="dense layers before the MoE ones (DeepSeek-V3: 3)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lens", action="store_true", help="then print, per tap, how often the target's head on it "
                   "picks the model's own next token")
    a = p.parse_args(argv)
    for name in ("layers", "hidden", "heads"):
        if getattr(a, name) < 1:
            p.error(f"--{name} {getattr(a, name)}: must be >= 1")
    if not 0 <= a.dense < a.layers:
        p.error(f"--dense {a.dense}: must be in [0, --layers)")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from eaglewire import targets

    out = build(Path(a.out), targets.resolve(a.tokenizer), seed=a.seed, layers=a.layers, dense=a.dense,
                hidden=a.hidden, heads=a.heads)
    print(f"DeepSeek-V3-style target: {a.layers} layers ({a.dense} dense), hidden {a.hidden}: {out}")
    if a.lens:
        import torch

        shares = lens(out, "cuda" if torch.cuda.is_available() else "cpu")
        print("tap   its argmax is the model's (greedy replies to 8 probe prompts)")
        for j, share in enumerate(shares):
            print(f"{j:>3}   {share:.3f}" + ("   (the embedding)" if j == 0 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
