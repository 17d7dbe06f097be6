"""Regeneration's decode step (data/batchgen.py), timed with each spelling of its attention, on the real target.

    python benchmarks/regen_step.py --target qwen2.5-coder-1.5b --rows 512,1024,2048 --attention matmul,sdpa \
        --json regen_step.json

A regeneration batch is many left-padded rows stepped together in one CUDA graph. Its one-row attention is
spelt as two matmuls (attention.matmul_attention, which reads each K head in fp32) unless
attention.SDPA_MIN_HEADS sends it to scaled_dot_product_attention. Each arm builds its own BatchGenerator over
the same prompts, prefills them, and times `--steps` greedy steps (after `--warmup`). The table gives ms a
step, reply tokens/s (rows / step time) and, against the first arm, the share of greedy tokens that agree
(bf16 rounds differently in each spelling, so a few rows may part ways after a near tie).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from eaglewire import targets
from eaglewire.bench.report import machine_info
from eaglewire.bench.run import timed
from eaglewire.data import batchgen
from eaglewire.errors import UsageError
from eaglewire.runtime import attention

ARMS = {"matmul": None, "sdpa": 0}  # attention.SDPA_MIN_HEADS for each arm


def prompts(rows: int, width: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, width) token ids left-padded to lengths spread over width/4 .. width, and each row's pad."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    lengths = torch.linspace(max(1, width // 4), width, rows).round().long()
    return ids, width - lengths


def time_arm(model, arm: str, rows: int, width: int, steps: int, warmup: int, device: torch.device) -> dict:
    attention.SDPA_MIN_HEADS = ARMS[arm]
    try:
        ids, pad = prompts(rows, width, model.config.vocab_size)
        ids, pad = ids.to(device), pad.to(device)
        gen = batchgen.BatchGenerator(model, rows, width, warmup + steps, cuda_graphs=device.type == "cuda")
        out = [gen.prefill(ids, pad).argmax(-1)]

        def advance(start: int, stop: int) -> None:
            for t in range(start, stop):
                out.append(gen.step(out[-1], t).argmax(-1))
        advance(0, warmup)
        _, seconds = timed(lambda: advance(warmup, warmup + steps), device)
    finally:
        attention.SDPA_MIN_HEADS = None
    ms = 1e3 * seconds / steps
    return {"arm": arm, "rows": rows, "width": width, "steps": steps, "ms_per_step": ms,
            "tokens_per_s": rows * steps / seconds, "tokens": torch.stack(out, 1).cpu()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=targets.DEFAULT_TARGET)
    p.add_argument("--rows", default="1024", help="comma-separated batch sizes (rows stepped together)")
    p.add_argument("--width", type=int, default=256, help="prompt width (columns, left-padded)")
    p.add_argument("--steps", type=int, default=64, help="timed steps")
    p.add_argument("--warmup", type=int, default=4, help="steps before timing (the first captures the graph)")
    p.add_argument("--attention", default="matmul,sdpa", help=f"arms, in order: {', '.join(ARMS)}")
    p.add_argument("--device", default=None)
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)
    try:
        arms = a.attention.split(",")
        if not arms or not set(arms) <= set(ARMS):
            raise UsageError(f"--attention {a.attention}: choose from {', '.join(ARMS)}")
        try:
            sizes = [int(x) for x in a.rows.split(",")]
        except ValueError:
            sizes = [0]
        if min(sizes) < 1 or min(a.width, a.steps) < 1 or a.warmup < 1:
            raise UsageError("--rows (each), --width, --steps and --warmup must be positive integers")
        t = targets.load_target(a.target, device=a.device)
        if not batchgen.supports(t.model):
            raise UsageError(f"--target {a.target}: regeneration's batched step runs {sorted(batchgen.SUPPORTED)} "
                             "targets with grouped K/V heads")
    except UsageError as e:
        print(f"regen_step: error: {e}", file=sys.stderr)
        return 2
    device = next(t.model.parameters()).device
    results = []
    print(f"{'rows':>6} {'arm':<8}{'ms/step':>10}{'tok/s':>11}{'agree':>8}")
    for rows in sizes:
        first = None
        for arm in arms:
            r = time_arm(t.model, arm, rows, a.width, a.steps, a.warmup, device)
            tokens = r.pop("tokens")
            first = tokens if first is None else first
            r["agree_with_first_arm"] = float((tokens == first).float().mean())
            results.append(r)
            print(f"{rows:>6} {arm:<8}{r['ms_per_step']:>10.2f}{r['tokens_per_s']:>11.0f}"
                  f"{r['agree_with_first_arm']:>8.3f}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": machine_info(device), "target": a.target,
                                            "dtype": str(next(t.model.parameters()).dtype), "settings": vars(a),
                                            "results": results}, indent=2) + "\n")
        print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
