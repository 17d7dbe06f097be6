"""Training metrics: per-TTT-step counts, the acceptance-length estimate, the JSONL log and its plot.

Counts are kept as one (K, len(FIELDS)) float64 tensor on the training device and summed across
batches (and ranks), so nothing waits on the host until a log line is written.

For TTT step k (k = 1..K in reports) at draft position t:
- loss positions: where the step's loss is taken (see ttt.py);
- metric positions m_k: the token the step predicts is an assistant token;
- correct_k: the draft's argmax, mapped to a target id, equals the target's argmax;
- accuracy_k = #(m_k & correct_k) / #m_k;
- conditional accuracy_k = #(m_k & prefix_k & correct_k) / #(m_k & prefix_k), prefix_k = every
  step j < k of the same chain was a metric position and correct;
- estimated acceptance length = 1 + sum_k prod_{j<=k} cond_acc_j (the bonus token included, as
  SGLang and vLLM report it: tokens per verification step of a greedy chain of K).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from .. import files

FIELDS = ("loss_sum", "loss_positions", "positions", "correct", "cond_positions", "cond_correct")
F = {name: i for i, name in enumerate(FIELDS)}


def zeros(ttt_steps: int, device) -> torch.Tensor:
    return torch.zeros(ttt_steps, len(FIELDS), dtype=torch.float64, device=device)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def summarize(counts: torch.Tensor) -> dict:
    """Per-step loss, accuracy and conditional accuracy, and the acceptance-length estimate."""
    c = counts.detach().to("cpu", torch.float64).tolist()
    loss = [_ratio(row[F["loss_sum"]], row[F["loss_positions"]]) for row in c]
    acc = [_ratio(row[F["correct"]], row[F["positions"]]) for row in c]
    cond = [_ratio(row[F["cond_correct"]], row[F["cond_positions"]]) for row in c]
    length, run = 1.0, 1.0
    for p in cond:
        run *= p or 0.0  # a step never reached (no surviving prefix) accepts nothing
        length += run
    return {"loss": loss, "acc": acc, "cond_acc": cond, "acceptance_length": length,
            "positions": int(c[0][F["positions"]]) if c else 0,  # metric positions of step 1
            "loss_positions": int(c[0][F["loss_positions"]]) if c else 0}


def rounded(x, digits: int = 5):
    """JSON-friendly rounding of nested floats (None stays None)."""
    if isinstance(x, float):
        return round(x, digits) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v, digits) for v in x]
    return x


class JsonlLog:
    """Append-only JSONL log; on resume, lines past the resumed step are dropped (they are redone)."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = Path(path)
        keep = []
        if resume_step is not None and self.path.exists():
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and _step_of(line) is not None and _step_of(line) <= resume_step]
        files.atomic_write(self.path, "".join(line + "\n" for line in keep))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rounded(record), sort_keys=True) + "\n")


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line cut by a kill: dropped


def read_log(path: Path) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def plot_curves(log_path: Path, png_path: Path) -> Path:
    """Training loss, held-out accuracy per TTT step, and estimated acceptance length against steps."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    records = read_log(log_path)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
    ax.set(title="training loss (weighted sum over TTT steps)", xlabel="step", yscale="log")
    ax = axes[1]
    if evals:
        steps = [r["step"] for r in evals]
        for k in range(len(evals[-1]["acc"])):
            ax.plot(steps, [r["acc"][k] if r["acc"][k] is not None else float("nan") for r in evals],
                    marker=".", label=f"k={k + 1}")
        ax.legend(fontsize=7, ncol=2)
    ax.set(title="held-out accuracy per TTT step", xlabel="step", ylim=(0, 1))
    ax = axes[2]
    if evals:
        ax.plot([r["step"] for r in evals], [r["acceptance_length"] for r in evals], marker="o")
    ax.set(title="estimated acceptance length (chain, greedy)", xlabel="step")
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    try:
        with files.atomic_path(png_path) as tmp:
            fig.savefig(tmp, dpi=90, format="png")
    finally:
        plt.close(fig)
    return png_path


def print_summary(checkpoint, m: dict, file=None) -> None:
    """The end-of-training table: held-out accuracy per TTT step, acceptance length, throughput."""
    file = file or sys.stdout
    h = m.get("heldout") or {}
    acc, cond = h.get("acc") or [], h.get("cond_acc") or []
    fmt = lambda xs: " ".join("  -  " if x is None else f"{x:.3f}" for x in xs)  # noqa: E731
    print(f"checkpoint  {checkpoint}", file=file)
    print(f"held-out    k = {' '.join(f'{k + 1:>5}' for k in range(len(acc)))}", file=file)
    print(f"accuracy        {fmt(acc)}", file=file)
    print(f"conditional     {fmt(cond)}", file=file)
    if h.get("acceptance_length") is not None:
        print(f"estimated acceptance length {h['acceptance_length']:.2f} on held-out replies of the training data "
              f"(greedy chain of {len(acc)}, bonus token included); `eaglewire bench --suite mt-bench` measures the "
              "decoder on prompts from elsewhere", file=file)
    if m.get("tokens_per_s"):
        gpus = m.get("world_size") or 1
        per_gpu = f" on each of {gpus} GPUs" if gpus > 1 else ""
        mfu = f", MFU {100 * m['mfu']:.1f}% of {m['peak_tflops']:.0f} TFLOP/s{per_gpu}" if m.get("mfu") else ""
        print(f"throughput  {m['tokens_per_s']:.0f} training tokens/s{mfu} "
              f"({m['flops_per_token'] / 1e9:.3g} GFLOP/token)", file=file)
    if m.get("setup_seconds") is not None:
        print(f"setup       {m['setup_seconds']:.0f} s before the first step (loading the target and data, encoding, "
              "regeneration)", file=file)
    if m.get("stopped_early"):
        print(f"stopped early: {m['stopped_early']}", file=file)
