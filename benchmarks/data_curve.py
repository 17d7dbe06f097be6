"""Acceptance length against the data a draft trained on: where more data stops paying.

    python benchmarks/data_curve.py --target T (--data DATAGEN_DIR | --replies FILE [FILE ...]) --out DIR
        [--fractions 0.0625,0.125,0.25,0.5,1] [--suites mt-bench,humaneval] [--prompts 80] [--new-tokens 256]
        [--chain 7] [--device cuda] [--set FIELD=VALUE ...]

Each point is a fresh draft trained on the first share of one dataset's training split: an `eaglewire datagen`
directory (--data: the taps read from disk), or conversation files with their replies (--replies: online, the
target computes the taps as each point trains, nothing on disk; e.g. the regenerated.jsonl of `eaglewire recipe
full --mode replies`, whose replies are the target's own). Offline data takes a few KB a token on disk (3.4 KB
for SmolLM2's taps in bf16), so a curve over tens of millions of tokens runs online. The replies are encoded once
and every point trains on that encoding; a rerun loads the target to count their tokens again. All points use
`recipe full`'s training settings, the same number of passes (`--set epochs=N`, default 1) and no time budget.
The shares are nested: a larger point's samples hold a smaller point's. The held-out split is taken before the
cut, so every point holds out the same samples. The draft's vocabulary is counted over its own samples only. So
a point answers one question: what does a draft trained on this much data accept?

Each draft is measured two ways:
- the trainer's held-out estimate: acceptance length from its per-step accuracies over its TTT steps, on
  held-out replies of the same dataset;
- acceptance length in eaglewire's decoder on each suite: its greedy chain of --chain replayed over the target's
  own greedy text of the suite's prompts (benchmarks/peers/measure.py). The texts are written once per run and
  every point is scored on the same tokens, so the points are paired by prompt.

How to read it. The x axis is reply tokens seen: the assistant tokens of the samples used (the trainer's loss
positions), times the passes. It is on a log scale, so equal steps right are equal factors of data. Bars are 95%
intervals over prompts. Where a line flattens, more data of this kind stops paying at these passes. In curve.json,
`vs_largest` gives each point's difference from the largest point, paired by prompt, with a simultaneous 95%
interval. An interval that holds 0 means that point is not measurably worse. A flat line says nothing about more
passes, or about other data. The prefixes follow the data's order: data written from prompts sorted by source or
length gives prefixes that differ in kind as well as in size.

DIR/points/F.json holds each point, written once the point is measured; a rerun skips it. DIR/drafts/F/ holds its
draft. DIR/curve.json and DIR/curve.png hold all points, and the table is printed. A finished draft whose point
was not written is measured again, not trained again. An --out made with other settings is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: `peers` as a package

import torch  # noqa: E402

from eaglewire import checkpoint, files, stats, targets  # noqa: E402
from eaglewire.data import shards  # noqa: E402
from eaglewire.data.suites import SUITES  # noqa: E402
from eaglewire.doctor import paired  # noqa: E402
from eaglewire.errors import EaglewireError, UsageError  # noqa: E402
from eaglewire.parallel import Dist  # noqa: E402
from eaglewire.recipes import RECIPES  # noqa: E402
from eaglewire.taps import TapContract  # noqa: E402
from eaglewire.train import data as train_data  # noqa: E402
from eaglewire.train import state as train_state  # noqa: E402
from eaglewire.train.config import TrainConfig  # noqa: E402
from eaglewire.train.trainer import RUNTIME_FIELDS, train  # noqa: E402

from peers import measure  # noqa: E402

FRACTIONS = "0.0625,0.125,0.25,0.5,1"
SETTINGS = "settings.json"  # what the points in --out were made with
# Fields the script decides: equal passes (not steps), no clock, and the cut of each point
FIXED = {"steps": "the points compare equal passes: set epochs", "time_budget_s": "the points train without a clock",
         "max_train_samples": "each point sets it from --fractions",
         "regen": "the points train on the replies as given: regenerate them once (`recipe --mode replies`)"}
REPLY_TOKENS = ("assistant tokens of the training samples used, from index 2 on and within max_len: the positions "
                "the trainer's loss counts (train_data's loss_tokens, offline or online alike)")


def say(msg: str) -> None:
    print(f"data_curve: {msg}", file=sys.stderr, flush=True)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, as every other bad input here
        raise UsageError(message)


def parse(argv=None) -> argparse.Namespace:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", metavar="DATAGEN_DIR", help="an `eaglewire datagen` directory")
    src.add_argument("--replies", nargs="+", metavar="FILE",
                     help="conversation files with replies, trained on online (pooled, repeats dropped)")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--fractions", default=FRACTIONS,
                   help=f"shares of the training split, increasing (default {FRACTIONS})")
    p.add_argument("--suites", default="mt-bench,humaneval", help="suite names or prompt FILEs, comma-separated")
    p.add_argument("--prompts", type=int, default=80, help="prompts per suite")
    p.add_argument("--new-tokens", type=int, default=256, help="the target's greedy reply per prompt")
    p.add_argument("--chain", type=int, default=7, help="draft tokens per round in the replay")
    p.add_argument("--device", default="cuda")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a training field (recipe --set)")
    a = p.parse_args(argv)
    a.fractions = _fractions(a.fractions)
    a.suites = [s for s in a.suites.split(",") if s]
    if not a.suites:
        raise UsageError("--suites: give at least one suite name or prompt FILE")
    for s in a.suites:
        if s not in SUITES and not Path(s).expanduser().is_file():
            raise UsageError(f"--suites {s}: not a suite ({', '.join(SUITES)}) and no such prompt file")
    for name in ("prompts", "new_tokens", "chain"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(a, name)}: must be >= 1")
    if a.data is not None and not Path(a.data).is_dir():
        raise UsageError(f"--data {a.data}: no such directory (make one with `eaglewire datagen`)")
    for f in a.replies or []:
        if not Path(f).is_file():
            raise UsageError(f"--replies {f}: no such file (write one with `eaglewire recipe full --mode replies`)")
    return a


def _fractions(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--fractions {text}: numbers separated by commas, e.g. {FRACTIONS}") from None
    bad = [f for f in out if not 0 < f <= 1]
    if not out or bad:
        raise UsageError(f"--fractions {text}: each must be in (0, 1] (a share of the training split), "
                         f"e.g. {FRACTIONS}")
    if any(b <= a for a, b in zip(out, out[1:])):
        raise UsageError(f"--fractions {text}: must increase, each once, e.g. {FRACTIONS}")
    return out


def key(fraction: float) -> str:
    return f"{fraction:g}"


def settings(a) -> TrainConfig:
    over = TrainConfig.overrides(a.set)
    for name, why in FIXED.items():
        if name in over:
            raise UsageError(f"--set {name}: {why}")
    # num_workers: the recipe's 0 is for online training, where nothing is read from disk
    base = {**RECIPES["full"].train.to_dict(), "num_workers": 0 if a.replies else None, "device": a.device,
            "epochs": 1, "time_budget_s": None}
    cfg = TrainConfig.from_dict({**base, **over})
    if cfg.eval_fraction == 0:
        raise UsageError("--set eval_fraction=0: the curve needs a held-out split; give a share in (0, 1)")
    return cfg


@dataclasses.dataclass
class Plan:
    """The split, and each point's samples and counts, known before anything trains."""

    samples: int  # in the dataset
    train: list[int]  # the training split's indices, in the data's order
    heldout: int  # samples held out (every point the same)
    points: dict  # key -> {"fraction", "train_samples", "reply_tokens", "tokens", "reply_tokens_seen", "steps"}


@dataclasses.dataclass
class Source:
    """What every point trains on: a datagen directory, or a corpus encoded once from reply files."""

    data: object  # what train() takes
    contract: TapContract
    index: tuple  # per sample: lengths, loss tokens, content keys (train_data's)


def source(a, cfg: TrainConfig, target) -> Source:
    if a.data is not None:
        manifest = shards.read_manifest(a.data)
        contract = TapContract.from_dict(manifest["contract"])
        return Source(a.data, contract, train_data.index_offline(a.data, cfg.max_len))
    n = target.num_layers
    # the trainer's own choice of taps for online data
    contract = TapContract(n, cfg.taps) if cfg.taps is not None else TapContract.default(n)
    say(f"encoding the replies of {len(a.replies)} file(s) ...")
    try:
        corpus = train_data.build_online(target, a.replies, contract, cfg.max_len, None, Dist.setup("cpu"))
    except UsageError as e:  # prompts.py speaks in `train`'s flags; here the files came as --replies
        raise UsageError(str(e).replace("--prompts ", "--replies ", 1).replace(
            "pass --regen to have the target write the replies",
            "write them with `eaglewire recipe full --mode replies`")) from None
    return Source(corpus, contract, (corpus.lengths, corpus.loss_tokens, corpus.keys))


def data_hash(a) -> str:
    """The data's identity before anything loads: the datagen manifest's hash, or the reply files' bytes."""
    if a.data is not None:
        return shards.manifest_hash(shards.read_manifest(a.data))
    joined = " ".join(files.file_digest(f) for f in a.replies)
    return "replies:" + hashlib.sha256(joined.encode()).hexdigest()[:16]


def plan(src: Source, fractions: list[float], cfg: TrainConfig) -> Plan:
    lengths, loss_tokens, keys = src.index
    train_idx, eval_idx = train_data.split(keys, cfg.eval_fraction, cfg.seed)
    points, last = {}, 0
    for f in fractions:
        n = max(1, math.floor(f * len(train_idx) + 0.5))
        if n == last:
            raise UsageError(f"--fractions {key(f)} gives {n} training samples of {len(train_idx)}, as the share "
                             "before it does: use fewer or larger fractions, or more data")
        last = n
        used = train_idx[:n]
        # The trainer's own batch plan on one process: the reply tokens its passes take, and its steps
        sched = train_data.Schedule(used, lengths, cfg.seed, cfg.batch_tokens, cfg.batch_size, cfg.grad_accum)
        try:
            total = sched.total_steps(cfg.epochs, None)
        except UsageError as e:
            raise UsageError(f"--fractions {key(f)}: {e}") from None
        seen = sum(loss_tokens[i] for _, _, group in sched.steps(0, total) for mb in group for i in mb)
        points[key(f)] = {"fraction": f, "train_samples": n, "reply_tokens": sum(loss_tokens[i] for i in used),
                          "tokens": sum(lengths[i] for i in used), "reply_tokens_seen": seen, "steps": total}
    return Plan(len(keys), train_idx, len(eval_idx), points)


def identity(a, cfg: TrainConfig, data: str) -> dict:
    """What the points in --out must share with this run (not where they ran, nor which fractions)."""
    train_cfg = {k: v for k, v in cfg.to_dict().items() if k not in RUNTIME_FIELDS and k != "max_train_samples"}
    return {"data": data, "train": train_cfg, "suites": a.suites, "prompts": a.prompts,
            "new_tokens": a.new_tokens, "chain": a.chain}


def check_out(root: Path, want: dict) -> None:
    """Refuse an --out that holds another run's points, or anything else; touches nothing."""
    if not root.exists():
        return
    if not root.is_dir():
        raise UsageError(f"--out {root}: exists and is not a directory")
    if not (root / SETTINGS).is_file():
        if any(root.iterdir()):
            raise UsageError(f"--out {root}: holds files that are not a data curve's: choose a new or empty directory")
        return
    have = files.read_json(root / SETTINGS, fix="delete it, or choose another --out")
    flags = {"data": "--data/--replies", "suites": "--suites", "prompts": "--prompts", "new_tokens": "--new-tokens",
             "chain": "--chain"}
    diffs = [f"{flags[k]}: {have.get(k)} there, {want[k]} here" for k in flags if have.get(k) != want[k]]
    old = have.get("train") or {}
    diffs += [f"--set {k}: {old.get(k)} there, {v} here" for k, v in want["train"].items() if old.get(k) != v]
    if diffs:
        raise UsageError(f"--out {root} holds a curve made with other settings ({'; '.join(diffs)}): pass the same, "
                         "or choose another --out")


# ---- one point ------------------------------------------------------------------------------------

def finished(out: Path) -> bool:
    names = {p.name for p in out.iterdir()} if out.is_dir() else set()
    return checkpoint.CONFIG in names and not names & {train_state.RESUME, train_state.RESUME + ".old"}


def texts_of(a, tgt, contract: TapContract) -> list[measure.Text]:
    """Each suite's greedy text with the taps the drafts read, written and captured once by the target in fp32 (the
    reference the decoder checks, as benchmarks/peers/run.py stage_eval)."""
    out = []
    for s in a.suites:
        say(f"suite {s}: the target's greedy text of {a.prompts} prompts, {a.new_tokens} tokens each ...")
        text = measure.suite_text(tgt, s, a.prompts, a.new_tokens)
        keep = set(contract.taps) | {"top"}  # every other layer's states would only take memory
        text.states = [{k: v for k, v in st.items() if k in keep} for st in text.states]
        out.append(text)
    return out


def digest(text: measure.Text) -> str:
    h = hashlib.sha256()
    for ids, mask in text.seqs:
        h.update(ids.to(torch.int64).numpy().tobytes())
        h.update(mask.numpy().tobytes())
    return h.hexdigest()[:16]


def measure_point(draft_dir: Path, texts: list, chain: int, device) -> dict:
    draft, taps = measure.load(draft_dir, device)
    out = {}
    for text in texts:
        row, per = measure.replay(draft, taps, text, chain)
        ci = stats.ratio_interval(per.tokens, per.rounds)
        out[text.name] = {"prompts": len(text.seqs), "text": digest(text),
                          "acceptance_length": row["acceptance_length"], "interval": list(ci) if ci else None,
                          "acc1": row["acc1"], "accepted_per_pos": row["accepted_per_pos"],
                          "per_prompt": {f.name: getattr(per, f.name).tolist() for f in dataclasses.fields(per)}}
    return out


def run_point(a, cfg: TrainConfig, p: Plan, src: Source, i: int, fk: str, texts: list, target) -> dict:
    pt = p.points[fk]
    head = f"point {i}/{len(p.points)} ({fk})"
    out = Path(a.out) / "drafts" / fk
    wall = None
    if finished(out):
        say(f"{head}: its draft is already trained")
    else:
        say(f"{head}: training on {pt['train_samples']} of {len(p.train)} training samples, {pt['reply_tokens']:,} "
            f"reply tokens, {cfg.epochs} pass(es) ...")
        # a resume state is saved only under --set ckpt_every=N; a run killed before one starts afresh
        resume = any((out / n).exists() for n in (train_state.RESUME, train_state.RESUME + ".old"))
        t0 = time.perf_counter()
        train(dataclasses.replace(cfg, max_train_samples=pt["train_samples"]), target, src.data, out=out,
              resume=resume, progress=False)
        wall = time.perf_counter() - t0
    meta = checkpoint.load_meta(out)
    m, tr = meta.metrics or {}, meta.training or {}
    # the trainer's split and cut must be the ones counted here, or the reply tokens would not be its own
    used = (m.get("train_samples"), m.get("eval_samples"), tr.get("steps"))
    if used != (pt["train_samples"], p.heldout, pt["steps"]):
        raise EaglewireError(f"{out}: the trainer used {used[0]} training and {used[1]} held-out samples in {used[2]} "
                             f"steps, the plan {pt['train_samples']}, {p.heldout} and {pt['steps']}: delete {out} and "
                             "run again")
    say(f"{head}: measuring on {', '.join(a.suites)} ...")
    suites = measure_point(out, texts, a.chain, targets.pick_device(a.device))
    result = {**pt, "passes": cfg.epochs, "heldout_samples": p.heldout, "train_s": tr.get("train_seconds"),
              "setup_s": tr.get("setup_seconds"), "wall_s": wall, "device": device_name(a.device),
              "draft": f"drafts/{fk}", "heldout": m.get("heldout"), "suites": suites}
    files.write_json(Path(a.out) / "points" / f"{fk}.json", result)
    say(f"{head}: done: held-out estimate {(m.get('heldout') or {}).get('acceptance_length', float('nan')):.3f}, "
        + ", ".join(f"{label(s)} {r['acceptance_length']:.3f}" for s, r in suites.items()))
    return result


# ---- the curve -----------------------------------------------------------------------------------

def paired_against_largest(points: list[dict], suites: list[str]) -> None:
    """Each point's per-suite difference from the largest point, paired by prompt (measure.against); only points
    measured on the same text (a rerun on another device may write other greedy text)."""
    base = points[-1]
    for s in suites:
        b = base["suites"][s]
        others = {str(i): _per(pt["suites"][s]) for i, pt in enumerate(points[:-1])
                  if pt["suites"][s]["text"] == b["text"]}
        diffs = measure.against(_per(b), others)
        for i, pt in enumerate(points[:-1]):
            pt["suites"][s]["vs_largest"] = diffs.get(str(i))
        b["vs_largest"] = None


def _per(row: dict) -> paired.PerPrompt:
    return paired.PerPrompt(**{k: torch.tensor(v, dtype=torch.float64) for k, v in row["per_prompt"].items()})


def label(suite: str) -> str:
    return suite if suite in SUITES else Path(suite).name


def plot(curve: dict, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pts, meta = curve["points"], curve["meta"]
    x = [p["reply_tokens_seen"] for p in pts]
    fig = Figure(figsize=(11, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for s in meta["settings"]["suites"]:
        y = [p["suites"][s]["acceptance_length"] for p in pts]
        ci = [p["suites"][s]["interval"] or [v, v] for p, v in zip(pts, y)]
        ax.errorbar(x, y, yerr=[[v - c[0] for v, c in zip(y, ci)], [c[1] - v for v, c in zip(y, ci)]], marker="o",
                    capsize=3, label=f"{label(s)}, decoder (chain {meta['settings']['chain']})")
        bx.plot(x, [p["suites"][s]["acc1"] for p in pts], marker="o", label=label(s))
    held = [(p["heldout"] or {}) for p in pts]
    k = meta["settings"]["train"]["ttt_steps"]
    ax.plot(x, [h.get("acceptance_length") for h in held], "k--", marker="s",
            label=f"held-out estimate ({k} TTT steps)")
    bx.plot(x, [(h.get("acc") or [None])[0] for h in held], "k--", marker="s", label="held-out")
    passes = meta["settings"]["train"]["epochs"]
    for a_, ylabel in ((ax, "acceptance length"), (bx, "acc@1")):
        a_.set_xscale("log")
        a_.set_xticks(x, [f"{v:,}" for v in x], fontsize=7)  # the points' own counts, not powers of ten
        a_.minorticks_off()
        a_.set(xlabel=f"reply tokens seen in training ({passes} pass{'es' if passes > 1 else ''})", ylabel=ylabel)
        a_.grid(alpha=0.3)
        a_.legend(fontsize=7)
    ax.set_title(f"{Path(meta['target']).name}: acceptance against training data", fontsize=9)
    bx.set_title("first draft token accepted", fontsize=9)
    fig.tight_layout()
    with files.atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")


def table(curve: dict) -> str:
    suites = curve["meta"]["settings"]["suites"]
    f = lambda v, fmt=".3f": "-" if v is None else format(v, fmt)  # noqa: E731
    head = ["fraction", "samples", "reply tokens", "seen", "steps", "train s", "held-out acc@1", "held-out AL (est.)"]
    head += [f"{label(s)} {c}" for s in suites for c in ("AL [95%]", "acc@1", "vs largest [95%]")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in curve["points"]:
        h = p["heldout"] or {}
        cells = [f"{p['fraction']:g}", f"{p['train_samples']:,}", f"{p['reply_tokens']:,}",
                 f"{p['reply_tokens_seen']:,}", str(p["steps"]), f(p["train_s"], ".0f"),
                 f((h.get("acc") or [None])[0]), f(h.get("acceptance_length"))]
        for s in suites:
            r = p["suites"][s]
            ci = f" [{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]" if r["interval"] else ""
            vs = r.get("vs_largest")
            cells += [f"{r['acceptance_length']:.3f}{ci}", f(r["acc1"]),
                      f"{vs['difference']:+.3f} [{vs['interval'][0]:+.3f}, {vs['interval'][1]:+.3f}]" if vs else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") and torch.cuda.is_available() else "cpu"


def run(a) -> dict:
    cfg = settings(a)
    want = identity(a, cfg, data_hash(a))
    root = Path(a.out)
    check_out(root, want)
    # Online, the training target is loaded first: its tokenizer encodes the replies the plan counts
    target = targets.load_target(a.target, device=a.device) if a.replies else None
    src = source(a, cfg, target)
    p = plan(src, a.fractions, cfg)
    # Everything is checked: from here on the run writes
    root.mkdir(parents=True, exist_ok=True)
    if not (root / SETTINGS).is_file():
        files.write_json(root / SETTINGS, want)
    todo = [fk for fk in p.points if not (root / "points" / f"{fk}.json").is_file()]
    (root / "points").mkdir(exist_ok=True)
    say(f"{len(p.points)} points over {len(p.train)} training samples ({p.heldout} held out, the same for every "
        f"point); {len(p.points) - len(todo)} already measured")
    if todo:
        fp32 = target is not None and targets.dtype_of(None, target.device) == torch.float32
        ref = target if fp32 else targets.load_target(a.target, device=a.device, dtype=torch.float32)
        texts = texts_of(a, ref, src.contract)  # once: every point on the same tokens
        # Training loads the target in the device's own dtype (as `eaglewire train` does), once for all points
        if target is None and targets.dtype_of(None, ref.device) == torch.float32:
            target = ref
        del ref  # an fp32 copy of its own is freed before another loads
        if target is None and any(not finished(root / "drafts" / fk) for fk in todo):
            target = targets.load_target(a.target, device=a.device)
        for i, fk in enumerate(p.points, 1):
            if fk in todo:
                run_point(a, cfg, p, src, i, fk, texts, target)
            else:
                say(f"point {i}/{len(p.points)} ({fk}): already measured")
    points = [files.read_json(root / "points" / f"{fk}.json", fix=f"delete it to measure point {fk} again")
              for fk in p.points]
    paired_against_largest(points, a.suites)
    for pt in points:  # per-prompt tallies stay in points/
        for r in pt["suites"].values():
            r.pop("per_prompt", None)
    curve = {"meta": {"target": a.target, "date": time.strftime("%Y-%m-%d"), "device": device_name(a.device),
                      "data": {"mode": "online" if a.replies else "offline",
                               "source": [Path(f).name for f in a.replies] if a.replies else Path(a.data).name,
                               "hash": want["data"], "samples": p.samples,
                               "train_split": len(p.train), "heldout_split": p.heldout},
                      "reply_tokens": REPLY_TOKENS,
                      "settings": {"fractions": a.fractions, "suites": a.suites, "prompts": a.prompts,
                                   "new_tokens": a.new_tokens, "chain": a.chain,
                                   "train": {k: v for k, v in cfg.to_dict().items() if k != "max_train_samples"}}},
             "points": points}
    files.write_json(root / "curve.json", curve)
    plot(curve, root / "curve.png")
    print(table(curve), end="")
    say(f"wrote {root / 'curve.json'} and {root / 'curve.png'}")
    return curve


def main(argv=None) -> int:
    try:
        run(parse(argv))
    except EaglewireError as e:
        print(f"data_curve: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
