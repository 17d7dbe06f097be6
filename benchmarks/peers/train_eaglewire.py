"""eaglewire's trainer with `recipe full`'s training settings, on the shared capture, for a budget of seconds.

    python benchmarks/peers/train_eaglewire.py --target T --data SHARDS --out CKPT --seconds S --json OUT
        [--device cuda] [--set FIELD=VALUE ...]

The recipe trains online (the target captures taps during training); here it reads the same precomputed
features the peers read, so the three trainers differ only in their code and settings. `--set` changes a
training field (as `recipe --set` does), for the aligned and ablation rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from eaglewire import targets
from eaglewire.recipes import RECIPES
from eaglewire.train.config import TrainConfig
from eaglewire.train.trainer import train


def settings(seconds: float, device: str, overrides: dict) -> TrainConfig:
    # num_workers: the recipe's 0 is for online training, where nothing is read from disk
    # The budget runs from the first step, as the peers' do (peer_speculators.train): compilation and set-up apart
    base = {**RECIPES["full"].train.to_dict(), "num_workers": None, "time_budget_s": seconds, "device": device,
            "budget_from": "first-step"}
    return TrainConfig.from_dict({**base, **overrides})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    over = TrainConfig.overrides(a.set)
    t0 = time.perf_counter()
    cfg = settings(a.seconds, a.device, over)
    tgt = targets.load_target(a.target, device=a.device)
    result = train(cfg, tgt, a.data, out=a.out, progress=False)
    m = result.metrics
    wall = time.perf_counter() - t0
    # train_s as the peers count it: the budget's wall time, its evaluations and saves in it; step_s without them
    tokens = round(m["tokens_per_s"] * m["train_seconds"]) if m.get("tokens_per_s") else None
    out = {"checkpoint": str(result.checkpoint), "steps": m["steps"], "train_s": m["budget_seconds"],
           "step_s": m["train_seconds"], "startup_s": round(wall - m["budget_seconds"], 1), "wall_s": round(wall, 1),
           "tokens": tokens, "tokens_per_s": tokens / m["budget_seconds"] if tokens else None, "heldout": m.get("heldout"),
           # what ended it: the budget's clock, or the plan's last pass with time to spare
           "stopped": "clock" if m.get("stopped_early") else "passes",
           "settings": {k: v for k, v in cfg.to_dict().items()
                        if k in ("lr", "min_lr_ratio", "batch_tokens", "ttt_steps", "ttt_decay", "loss",
                                 "draft_vocab_size", "max_len", "warmup_steps", "betas", "weight_decay",
                                 "clip_grad", "epochs", "eval_fraction", "optimizer", "schedule", "head",
                                 "draft_overrides")}}
    Path(a.json).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("steps", "train_s", "tokens_per_s")}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
