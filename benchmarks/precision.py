"""Where bf16 loses acceptance: the draft's greedy chain replayed on one fixed text, each part in fp32 or bf16.

`bench --dtype bf16` against `--dtype fp32` compares two different texts: wherever the bf16 target's argmax
flips at a near-tie, the two decoders write different continuations from there on, and acceptance on one
text says little about acceptance on the other (a reply that falls into a loop is accepted at 5 tokens a
round). Here the text is fixed: the fp32 target's greedy continuation of each prompt. Every configuration is
replayed on those same tokens with the doctor's chain (doctor/chain.py: a round at every position, walked as
the decoder walks it), so the differences are the precision's alone, paired by prompt with a bootstrap
interval (doctor/paired.py). What each row changes against the fp32 reference:

    draft weights bf16-rounded   the saved weights rounded to bf16, fp32 arithmetic (what a bf16 copy holds)
    draft in bf16                the draft's arithmetic in bf16 (norms, attention, fc, lm_head)
    taps from bf16 target        the taps the bf16 target computes, the fp32 target's argmax as the verdict
    bf16 target                  the bf16 target's taps and its own argmax (what a bf16 decoder verifies)
    all bf16                     target and draft in bf16: what `bench --dtype bf16` runs, on the fixed text
    all bf16, the speed-ups      the same through the decoder's fused projections and grouped attention
                                 (decode/speedups.py; compile and CUDA graphs are not replayed here)

`--text bf16` replays the same rows on the bf16 target's own greedy text instead (one batched generate).
`--text decoder` replays them on the text our speculative decoder writes in bf16 with the device's defaults
(compiled, CUDA graphs on a GPU): exactly what `bench --dtype bf16` scores, and a row more, the decoder's own
count of what it accepted there (`--decoder` picks one of its paths instead: eager, the device-side rounds, or those
compiled). On that text the bf16 rows take the decoder's verdicts (the text's next token:
what its verify chose), so "all bf16, the speed-ups" and "the decoder, as it ran" differ only where the replay
does not reproduce the decoder. Run with two texts, the fp32 reference on each separates what the text changes
(fp32 on one text against fp32 on the other) from what the precision changes (the rows on one text); the JSON
keeps every row's tokens and rounds per prompt for that paired comparison. (On another dtype's text, the ~1% of
positions where a target's argmax is not the text's next token are scored against that argmax, as a verify
would.)

    python benchmarks/precision.py --draft CKPT [--target T] [--suite mt-bench] [--max-prompts 20]
        [--new-tokens 256] [--chain 7] [--text fp32|bf16|decoder [--decoder bench|eager|rounds|compiled]] [--json OUT]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from eaglewire import checkpoint, targets
from eaglewire.bench.run import BenchConfig
from eaglewire.decode import speedups
from eaglewire.decode.decoder import SpecConfig, SpecDecoder
from eaglewire.doctor import paired, probe
from eaglewire.doctor.probe_inputs import capture_states, chosen


def rounded(draft):
    """The draft with its weights rounded to bf16 and kept in fp32."""
    d = copy.deepcopy(draft)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return d


def flips(states32: list[dict], states16: list[dict], seqs) -> dict:
    """Continuation positions where the bf16 target's argmax is not the fp32 target's."""
    n = k = 0
    for a, b, (_, mask) in zip(states32, states16, seqs):
        m = mask.clone()
        m[:-1] = mask[1:] & mask[:-1]  # the position predicts a continuation token
        m[-1] = False
        n += int(m.sum())
        k += int((a["top"] != b["top"])[m].sum())
    return {"positions": n, "flipped": k, "share": k / n if n else None}


DECODERS = {  # --decoder: what changes from the speed-ups `bench` gives the decoder on the device
    "bench": {},
    "eager": dict(compile=False, cuda_graphs=False),
    "rounds": dict(compile=False, cuda_graphs=False, static_shapes=True),  # the device-side rounds, uncompiled
    "compiled": dict(compile=True, cuda_graphs=False),
}


def decoder_writer(target, draft, meta, suite: str, chain: int, rounds: list, how: str = "bench"):
    """Continuations written by our speculative decoder (greedy, a chain); `how` (DECODERS): as `bench` runs it
    (compiled with CUDA graphs on a GPU, eager on a CPU) or one path of it. Each prompt's accepted-per-round goes
    to `rounds`."""
    device = next(target.model.parameters()).device
    ups = dataclasses.replace(BenchConfig(suite=suite, device=device.type).speedups_for(device), **DECODERS[how])
    dec = SpecDecoder(target, copy.deepcopy(draft), meta, shape=SpecConfig.for_device(device, "chain", K=chain),
                      speedups=ups)
    eos = targets.eos_ids(target)

    def write(prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
        out = []
        for ids in prompt_ids:
            res = dec.generate(torch.tensor([ids], device=device), new_tokens, eos_ids=eos)
            rounds.append(list(res.accepted_per_step))
            out.append(list(res.tokens))
        return out

    return write


def as_ran(rounds: list[list[int]], chain: int) -> tuple[dict, paired.PerPrompt]:
    """The decoder's own count, in the replay's terms (acc@1 is per round here, so it is not shown)."""
    f = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    tokens, n = [sum(r) + len(r) for r in rounds], [len(r) for r in rounds]
    total = max(sum(n), 1)
    summary = {"acceptance_length": sum(tokens) / total, "acc1": None,
               "accepted_per_pos": [sum(a > k for r in rounds for a in r) / total for k in range(chain)]}
    return summary, paired.PerPrompt(f(tokens), f(n), f([sum(a > 0 for a in r) for r in rounds]), f(n))


def with_verdicts_of(states: list[dict], seqs) -> list[dict]:
    """The states with the text's next token as the target's verdict (what the decoder that wrote it verified)."""
    out = []
    for st, (ids, _) in zip(states, seqs):
        top = st["top"].clone()
        top[:-1] = ids[1:]
        out.append({**st, "top": top})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True)
    p.add_argument("--target", default=targets.DEFAULT_TARGET)
    p.add_argument("--suite", default="mt-bench")
    p.add_argument("--max-prompts", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--chain", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--text", choices=["fp32", "bf16", "decoder"], default="fp32",
                   help="whose greedy continuation is replayed: the fp32 target's (default), the bf16 target's, or "
                        "our bf16 speculative decoder's (what `bench --dtype bf16` scores)")
    p.add_argument("--decoder", choices=list(DECODERS), default="bench",
                   help="--text decoder: the decoder as `bench` runs it (default), or eager, its device-side rounds "
                        "(static shapes), or those compiled")
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()

    t32 = targets.load_target(a.target, dtype=torch.float32, device=a.device)
    t16 = targets.load_target(a.target, dtype=torch.bfloat16, device=a.device)
    d16, meta = checkpoint.load_draft(a.draft, device=a.device, dtype=torch.bfloat16)
    ran: list[list[int]] = []  # --text decoder: the decoder's accepted tokens per round, prompt by prompt
    writer = decoder_writer(t16, d16, meta, a.suite, a.chain, ran, a.decoder) if a.text == "decoder" else None
    seqs = chosen(t32 if a.text == "fp32" else t16, a.max_prompts, suite=a.suite, new_tokens=a.new_tokens,
                  writer=writer)
    say(f"precision: {len(seqs.seqs)} {a.text} greedy continuations of {seqs.source} "
        f"({time.perf_counter() - t0:.0f} s)")
    s32 = [capture_states(t32.model, ids) for ids, _ in seqs.seqs]
    t32 = None
    s16 = [capture_states(t16.model, ids) for ids, _ in seqs.seqs]
    fast = speedups.Speedups(fuse_projections=True, grouped_attention=True, prepack=False)
    model16, fast16, _ = speedups.apply(t16.model, d16, fast)
    sfast = [capture_states(model16, ids) for ids, _ in seqs.seqs]
    t16 = model16 = None
    if a.text == "decoder":
        assert len(ran) == len(seqs.seqs)  # suite prompts are all bare: the decoder wrote every one, in order
        s16, sfast = with_verdicts_of(s16, seqs.seqs), with_verdicts_of(sfast, seqs.seqs)
    say(f"precision: taps captured in fp32 and bf16 ({time.perf_counter() - t0:.0f} s)")

    d32, _ = checkpoint.load_draft(a.draft, device=a.device, dtype=torch.float32)
    wiring = probe.Wiring(tuple(meta.contract.taps), "the draft's taps")
    mixed = [{**x, "top": y["top"]} for x, y in zip(s16, s32)]  # bf16 taps, the fp32 verdict
    rows = [("fp32 reference", d32, s32), ("draft weights bf16-rounded", rounded(d32), s32),
            ("draft in bf16", d16, s32), ("taps from bf16 target", d32, mixed), ("bf16 target", d32, s16),
            ("all bf16", d16, s16), ("all bf16, the speed-ups", fast16, sfast)]
    out, per = [], []
    for name, draft, states in rows:
        summary, pp = probe.measure(draft, seqs.seqs, states, wiring, a.chain)
        out.append({"config": name, **{k: summary[k] for k in ("acceptance_length", "acc1", "accepted_per_pos")},
                    "per_prompt": {"tokens": pp.tokens.tolist(), "rounds": pp.rounds.tolist()}})
        per.append(pp)
        say(f"precision: {name} {summary['acceptance_length']:.3f} ({time.perf_counter() - t0:.0f} s)")
    if ran:
        summary, pp = as_ran(ran, a.chain)
        out.append({"config": "the decoder, as it ran", **summary,
                    "per_prompt": {"tokens": pp.tokens.tolist(), "rounds": pp.rounds.tolist()}})
        per.append(pp)
    for row, d in zip(out[1:], paired.compare(per[0], per[1:])):
        row["vs_fp32"] = d.to_dict()
    r = {"target": a.target, "draft": a.draft, "suite": seqs.source, "prompts": len(seqs.seqs),
         "new_tokens": a.new_tokens, "chain": a.chain, "device": a.device, "text": a.text,
         "decoder": a.decoder if a.text == "decoder" else None,
         "argmax_flips": flips(s32, s16, seqs.seqs), "rows": out, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    print(render(r))
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2) + "\n")
    return 0


def render(r: dict) -> str:
    f = r["argmax_flips"]
    text = "our bf16 speculative decoder's text" if r["text"] == "decoder" else f"the {r['text']} target's greedy text"
    lines = [f"{r['target']}: the draft's chain of {r['chain']} replayed on {text} "
             f"({r['prompts']} prompts of {r['suite']}, {r['new_tokens']} tokens each, on {r['device']})",
             f"{'configuration':<30}{'accept-len':>11}{'acc@1':>8}{'vs fp32':>9}  paired 95% interval",]
    for row in r["rows"]:
        d = row.get("vs_fp32")
        diff = f"{d['acceptance_length']:>+9.3f}  [{d['acceptance_length_ci'][0]:+.3f}, " \
               f"{d['acceptance_length_ci'][1]:+.3f}]" if d else f"{'':>9}"
        acc1 = f"{row['acc1']:>8.3f}" if row["acc1"] is not None else f"{'-':>8}"
        lines.append(f"{row['config']:<30}{row['acceptance_length']:>11.3f}{acc1}{diff}")
    lines.append(f"the bf16 target's argmax differs from the fp32 target's at {f['flipped']} of {f['positions']} "
                 f"positions of the text")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
