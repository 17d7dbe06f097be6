"""How well a draft predicts the target on prompts from different sources: teacher-forced TTT
metrics (as training reports them) on the target's own greedy replies, beside the acceptance a
chain decode of the same replies measures.

    python benchmarks/draft_by_source.py --draft CKPT --prompts 8 --new 128 --json out.json

Sources: MT-bench (evenly spaced), ShareGPT human turns that follow a gpt opening (records the
recipes never train on), prompts the target writes itself (`datagen.self_prompts`), and, with
--trained FILE (a recipe's regenerated.jsonl[.gz]), replies the draft was trained on. A held-out
split of the training conversations can share prompts with them; these sources cannot.

Each source is also split by the target's confidence at the predicted position (its top-1 probability):
a draft cannot call the target's greedy choice where the target itself nearly ties, so the share of such
positions bounds what any draft accepts on a source, and acc@1 within each band says where a draft loses.
The share of positions where the target's top-1 lies outside the draft's vocabulary (draft_vocab_size) is what
the vocabulary alone costs. Prints the tables and writes the same numbers as JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import torch

from eaglewire import __version__, prompts, recipes, targets
from eaglewire.capture import capture, locate
from eaglewire.checkpoint import load_draft
from eaglewire.data import datagen
from eaglewire.data.suites import encode_prompt, load_suite
from eaglewire.decode.decoder import SpecConfig, SpecDecoder
from eaglewire.train import metrics
from eaglewire.train.ttt import TTTModel, TTTSpec, target_side


def unseen_sharegpt(n: int) -> list[list[dict]]:
    """Human turns that follow a gpt opening: `prompts.first_turns` skips those records."""
    src = recipes.sharegpt_file()
    out = []
    for _, rec in prompts.iter_records(prompts.read_text(src), src, []):
        turns = [] if isinstance(rec, prompts.Skip) else rec.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "gpt" and turns[1].get("from") == "human" \
                and 20 < len(turns[1].get("value", "")) < 600:
            out.append([{"role": "user", "content": turns[1]["value"]}])
    step = max(1, len(out) // n)
    return out[step // 2::step][:n]


def trained_on(path: Path, n: int) -> list[tuple[list[dict], str]]:
    """(first user turn, the stored reply) of n evenly spaced regenerated conversations."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        convs = [json.loads(line)["messages"] for line in f]
    step = max(1, len(convs) // n)
    picked = []
    for c in convs[step // 2::step][:n]:
        user = next(i for i, m in enumerate(c) if m["role"] == "user")
        picked.append((c[:user + 1], c[user + 1]["content"]))
    return picked


BANDS = (0.9, 0.5, 0.0)  # lower edges of the target's top-1 probability bands, high to low


@torch.no_grad()
def step_one_by_confidence(draft, head, seq, mask, taps, final_hidden) -> torch.Tensor:
    """(len(BANDS), 3): per band of the target's top-1 probability, [positions, step-1 correct, the target's top-1
    outside the draft's vocabulary (no draft can call it)], over the positions TTT step 1 scores (the predicted
    token x_{t+2} is a reply token)."""
    T = seq.shape[1]
    logits_t = head(final_hidden.to(head.weight.dtype)).float()  # (1, T, V): row t predicts x_{t+1}
    conf, top = logits_t.softmax(-1).max(-1)
    hidden = draft.fuse(taps)
    ids = torch.nn.functional.pad(seq, (0, 1))
    pos = torch.arange(T, device=seq.device)[None]
    logits, _ = draft(ids[:, 1:1 + T], hidden, pos, cache=draft.new_cache(1, None, dtype=hidden.dtype,
                                                                            device=hidden.device))
    guess = draft.draft_to_target(logits.argmax(-1))[:, :T - 2]  # row t predicts x_{t+2}, t + 2 < T
    correct, c, m = guess == top[:, 1:T - 1], conf[:, 1:T - 1], mask[:, 2:]
    outside = ~draft.t2d[top[:, 1:T - 1]]
    out, upper = torch.zeros(len(BANDS), 3, dtype=torch.float64), 1.01
    for i, low in enumerate(BANDS):
        band = m & (c >= low) & (c < upper)
        out[i] = torch.tensor([band.sum().item(), (band & correct).sum().item(), (band & outside).sum().item()])
        upper = low
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=targets.DEFAULT_TARGET)
    p.add_argument("--draft", required=True, metavar="CKPT")
    p.add_argument("--prompts", type=int, default=8, help="prompts per source")
    p.add_argument("--new", type=int, default=128, help="reply tokens per prompt")
    p.add_argument("--chain", type=int, default=7, help="TTT steps and chain length")
    p.add_argument("--trained", type=Path, default=None, metavar="FILE", help="a recipe's regenerated.jsonl[.gz]")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)

    t = targets.load_target(a.target, device=a.device)
    draft, meta = load_draft(a.draft)
    dec = SpecDecoder(t, draft, meta, shape=SpecConfig.for_device(next(t.model.parameters()).device, K=a.chain))
    stack = locate(t.model)
    ttt = TTTModel(draft, TTTSpec(a.chain, 0.8, "soft-ce")).eval()
    ids_d = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device))
    eos = targets.eos_ids(t)

    torch.manual_seed(a.seed)
    written = datagen.self_prompts(t, 3 * a.prompts, datagen.GenConfig(
        max_new_tokens=96, temperature=1.0, batch_size=3 * a.prompts))
    sources = {"mt-bench": [(m, None) for m in load_suite("mt-bench", a.prompts).conversations],
               "sharegpt-unseen": [(m, None) for m in unseen_sharegpt(a.prompts)],
               "self-written": [([{"role": "user", "content": w}], None) for w in written[:a.prompts]]}
    if a.trained:
        sources["trained-on"] = trained_on(a.trained, a.prompts)

    rows = {}
    for name, items in sources.items():
        total, tokens, steps = metrics.zeros(a.chain, "cpu"), 0, 0
        bands = torch.zeros(len(BANDS), 3, dtype=torch.float64)
        for msgs, reply in items:
            prompt = encode_prompt(t.tokenizer, msgs).reshape(-1)
            if reply is None:  # the target's own greedy reply, decoded with the draft (acceptance measured)
                r = dec.generate(prompt, a.new, eos_ids=eos)
                new, tokens, steps = r.tokens, tokens + len(r.tokens), steps + r.num_steps
            else:  # the stored reply the draft was trained on
                new = t.tokenizer(reply, add_special_tokens=False)["input_ids"][:a.new]
            seq = torch.cat([prompt.cpu(), torch.tensor(new, dtype=torch.long)])[None].to(t.device)
            mask = torch.zeros_like(seq, dtype=torch.bool)
            mask[0, prompt.numel():] = True
            with torch.no_grad():
                cap = capture(t.model, seq, meta.contract, final_norm=True, stack=stack)
                probs, top, inv = target_side(stack.lm_head, cap.final_hidden, draft.t2d, ids_d, 8)
                _, counts = ttt(seq, mask, cap.taps, probs, top, inv, denom=1.0)
            total += counts.cpu()
            bands += step_one_by_confidence(draft, stack.lm_head, seq, mask, cap.taps, cap.final_hidden)
        s = metrics.summarize(total)
        n, ok, outside = bands.sum(0).tolist()
        assert abs(ok / max(n, 1) - s["acc"][0]) < 1e-6, (ok / max(n, 1), s["acc"][0])  # the same positions as TTT's
        rows[name] = {"prompts": len(items), "acc": s["acc"], "estimated_acceptance_length": s["acceptance_length"],
                      "decoded_acceptance_length": tokens / steps if steps else None,
                      "top1_outside_draft_vocab": outside / max(n, 1),
                      "by_target_confidence": [{"top1_prob_from": low, "share": n / max(bands[:, 0].sum().item(), 1),
                                                "acc1": ok / n if n else None}
                                               for low, (n, ok, _) in zip(BANDS, bands.tolist())]}

    print(f"draft quality by prompt source: {a.draft}, {a.prompts} prompts each, {a.new} reply tokens, "
          f"{str(next(t.model.parameters()).dtype).split('.')[-1]} on {t.device}")
    print(f"{'source':<18}{'acc@1':>7}{'acc@2':>7}{'acc@3':>7}{'est. AL':>9}{'decoded AL':>12}"
          f"{'top-1 not in vocab':>20}")
    for name, r in rows.items():
        dal = f"{r['decoded_acceptance_length']:.2f}" if r["decoded_acceptance_length"] else "-"
        print(f"{name:<18}{r['acc'][0]:>7.3f}{r['acc'][1]:>7.3f}{r['acc'][2]:>7.3f}"
              f"{r['estimated_acceptance_length']:>9.2f}{dal:>12}{r['top1_outside_draft_vocab']:>20.3f}")
    print("\nstep-1 accuracy by the target's top-1 probability at the predicted position (share of positions, acc@1)")
    edges = [f">= {lo}" if i == 0 else f"{lo}-{BANDS[i - 1]}" for i, lo in enumerate(BANDS)]
    print(f"{'source':<18}" + "".join(f"{e:>18}" for e in edges))
    for name, r in rows.items():
        cells = [f"{b['share']:.2f}, {b['acc1']:.3f}" if b["acc1"] is not None else f"{b['share']:.2f}, -"
                 for b in r["by_target_confidence"]]
        print(f"{name:<18}" + "".join(f"{c:>18}" for c in cells))
    if a.json:
        out = {"eaglewire": __version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
               "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}, "rows": rows}
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
