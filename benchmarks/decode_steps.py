"""Where a decode round's time goes: the whole round (host clock) against the GPU time of the CUDA
graphs it replays, for plain decoding, a greedy chain and an EAGLE-2 tree, on the same prompt.

    python benchmarks/decode_steps.py --target smollm2-135m --draft CKPT --json out.json
    python benchmarks/decode_steps.py --random-draft --json out.json      # any target, no checkpoint
    python benchmarks/decode_steps.py --draft CKPT --modes chain --autotune target,none   # an A/B in one process

"graphs ms" is each graph's GPU time (timed alone) times its replays in a decode round (the prefill's
left out); "host ms" is the rest of the round. A round that costs far more than its replays is bound
by host work between them (input copies, tree bookkeeping, the acceptance sync); one that costs about
its replays is bound by the kernels inside them (then fuse: --compile). On a CPU there are no graphs:
only the round is timed. Prints a table and writes the same numbers as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eaglewire import __version__, targets
from eaglewire.checkpoint import load_draft, save_draft
from eaglewire.decode import tree
from eaglewire.decode.decoder import SpecConfig, SpecDecoder
from eaglewire.decode.draft_runner import DraftRunner
from eaglewire.decode.speedups import Speedups
from eaglewire.draft import DraftConfig, Eagle3Draft
from eaglewire.errors import UsageError
from eaglewire.runtime import attention
from eaglewire.runtime.runners import TargetRunner
from eaglewire.runtime.sampling import SamplingParams
from eaglewire.taps import TapContract


def random_draft(target, out: Path):
    """An untrained draft shaped for the target: the timing of a round does not depend on its weights
    (acceptance does: rounds then accept ~nothing, so the extend is a single row)."""
    contract = TapContract.default(target.num_layers)
    draft = Eagle3Draft(DraftConfig.for_target(target.model.config, len(contract.taps),
                                               min(32000, target.config.vocab_size)))
    save_draft(draft, out, contract=contract, target_fingerprint=target.fingerprint)
    return load_draft(out)


def decoder_args(p: argparse.ArgumentParser, new: int, new_help: str) -> None:
    """What both round benchmarks (this one and round_kernels.py) take: target, draft, device, prompt, shapes."""
    p.add_argument("--target", default=targets.DEFAULT_TARGET)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--draft", metavar="CKPT")
    src.add_argument("--random-draft", action="store_true", help="an untrained draft shaped for the target")
    p.add_argument("--device", default=None)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=new, help=new_help)
    p.add_argument("--chain", type=int, default=7)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--budget", type=int, default=63)


def load_pair(a, device: torch.device):
    """(target, draft, meta, prompt ids, {mode name: SpecDecoder shape, None for plain}) from decoder_args."""
    t = targets.load_target(a.target, device=device)
    with tempfile.TemporaryDirectory() as tmp:
        draft, meta = random_draft(t, Path(tmp) / "d") if a.random_draft else load_draft(a.draft)
    ids = torch.randint(0, t.config.vocab_size, (a.prompt_len,), generator=torch.Generator().manual_seed(0))
    shapes = {"plain": None, f"chain K={a.chain}": dict(mode="chain", K=a.chain),
              f"tree d={a.depth} k={a.topk} b={a.budget}": dict(mode="tree", depth=a.depth, topk=a.topk,
                                                                 budget=a.budget)}
    return t, draft, meta, ids, shapes


def graph_ms(st, iters: int = 50) -> float:
    """GPU milliseconds of one replay of a static function's graph (CUDA events around each replay).
    Its input buffers are put back after every replay: some graphs move their own positions on (the
    greedy plain step, rounds.py's rounds), and unchecked they would write past the cache."""
    saved = {k: t.clone() for k, t in st.inputs.items()}
    total = 0.0
    for i in range(iters + 1):  # the first replay warms up
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        st.run()
        b.record()
        for k, t in saved.items():
            st.inputs[k].copy_(t)
        torch.cuda.synchronize()
        total += a.elapsed_time(b) if i else 0.0
    return total / iters


def replays(runner) -> dict[str, object]:
    """The runner's captured static functions by key (empty without CUDA graphs)."""
    return {str(k): st for k, st in runner._static.items() if st.outputs is not None}


def replays_per_round(runners, run) -> tuple[dict[str, float], object]:
    """Call run() (one generation) counting each captured graph's replays outside the target's
    prefill: {graph: replays per decode round} (the draft's extends split by size, a tree's branch
    moves as often as they happen), and run()'s result."""
    counts, saved, prefilling = {}, [], []

    def counted(name, replay):
        def run_counted():
            counts[name] += not prefilling
            return replay()
        return run_counted

    def flagged(prefill):
        def run_prefill(*args, **kw):
            prefilling.append(1)
            try:
                return prefill(*args, **kw)
            finally:
                prefilling.pop()
        return run_prefill

    for r in runners:
        for key, st in r._static.items():
            if st.outputs is not None:
                name = f"{type(r).__name__}{key}"
                counts[name] = 0
                saved.append((st, st.run))
                st.run = counted(name, st.run)
        if isinstance(r, TargetRunner):
            r.prefill = flagged(r.prefill)
    try:
        res = run()
    finally:
        for st, replay in saved:
            st.run = replay
        for r in runners:
            r.__dict__.pop("prefill", None)
    return {k: c / res.num_steps for k, c in counts.items() if c}, res


CHOICES = {"target": (True, False), "none": (False, False), "all": (True, True)}  # autotune (target's, draft's)


ATTENTION = {"default": None, "grouped": True, "sdpa": False, "matmul": True}  # Speedups(grouped_attention=...)
MATMUL_ROWS = 64  # --attention matmul: grouped, with verifies of up to this many rows spelt as matmuls too
# speculation, greedy or sampled: rounds.py's rounds (as shipped: the next batch queued before a read-back), or the same
# without that overlap (each batch read back before the next is queued)
ROUNDS = ("on", "batched")


# the tree's selections: as shipped (orders by ranking, top-k by groups: tree.RANK_SORT_MAX, tree.TOPK_GROUP) or
# aten's sort and top-k as they are
TREE_SELECT = {"ours": (tree.RANK_SORT_MAX, tree.TOPK_GROUP), "aten": (0, 0)}


@contextlib.contextmanager
def shipped_as(arm: dict):
    """The module constants an arm sets (attention.MATMUL_MAX_ROWS, tree.RANK_SORT_MAX, tree.TOPK_GROUP) set so
    meanwhile: they are read when a function is traced (compiled), at each call eager."""
    names = {"rows": (attention, "MATMUL_MAX_ROWS"), "rank": (tree, "RANK_SORT_MAX"), "group": (tree, "TOPK_GROUP")}
    shipped = {k: getattr(*names[k]) for k in arm}
    try:
        for k, v in arm.items():
            setattr(*names[k], v)
        yield
    finally:
        for k, v in shipped.items():
            setattr(*names[k], v)


def generation(dec: SpecDecoder, ids: torch.Tensor, new: int, plain: bool, sampling: SamplingParams):
    """One generation, plain or speculative; sampled ones with seed 0: every arm gets the same draws, so the same
    tokens where the arms' arithmetic agrees (fp32); in bf16 compiled arms round differently and drift apart."""
    run = dec.generate_plain if plain else dec.generate
    return run(ids, new, sampling, seed=None if sampling.greedy else 0)


def warmed(make, choice: str, attn: str, rounds: str, select: str, ids: torch.Tensor, new: int, plain: bool,
           sampling: SamplingParams) -> SpecDecoder:
    """A decoder built and warmed up (every size this prompt meets compiled and captured) under one
    autotuning choice (runners bind it when they create their compiled functions, during the warm-up),
    one attention and one way of selecting the tree's nodes."""
    shipped = TargetRunner.autotune, DraftRunner.autotune
    TargetRunner.autotune, DraftRunner.autotune = CHOICES[choice]
    rank, group = TREE_SELECT[select]
    arm = {"rows": MATMUL_ROWS if attn == "matmul" else attention.MATMUL_MAX_ROWS, "rank": rank, "group": group}
    try:
        with shipped_as(arm):
            dec = make(grouped_attention=ATTENTION[attn])
            dec.bench_arm = arm  # measure() runs it so again
            if not plain:  # rounds are the speculative decoder's: a plain one has none to switch
                dec.rounds_overlap = dec.rounds_overlap and rounds == "on"
            generation(dec, ids, new, plain, sampling)
    finally:
        TargetRunner.autotune, DraftRunner.autotune = shipped
    return dec


def measure(decs: dict[str, SpecDecoder], ids: torch.Tensor, new: int, repeats: int, plain: bool,
            sampling: SamplingParams) -> dict:
    """Each warmed decoder timed `repeats` times, in turn (a drift of the machine hits every arm alike)."""
    results = {k: [] for k in decs}
    for _ in range(repeats):
        for k, dec in decs.items():
            with shipped_as(dec.bench_arm):
                results[k].append(generation(dec, ids, new, plain, sampling))
    rows = {}
    for k, dec in decs.items():
        best = min(results[k], key=lambda r: r.timings["step_ms"])
        row = {"round_ms": best.timings["step_ms"], "tokens_per_s": best.timings["decode_tokens_per_s"],
               "acceptance_length": None if plain else best.acceptance_length,
               "round_ms_median": statistics.median(r.timings["step_ms"] for r in results[k])}
        if dec.device.type == "cuda":
            runners = [dec.plain] if plain else [dec.drafter, dec.verifier]
            with shipped_as(dec.bench_arm):
                per_round, _ = replays_per_round(runners, lambda: generation(dec, ids, new, plain, sampling))
            graphs = {f"{type(r).__name__}{key}": st for r in runners for key, st in replays(r).items()}
            row["graphs"] = {key: graph_ms(st) for key, st in graphs.items() if key in per_round}
            row["replays_per_round"] = per_round
            row["graphs_ms_per_round"] = sum(row["graphs"][key] * n for key, n in per_round.items())
        rows[k] = row
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    decoder_args(p, 128, "new tokens per timed generation")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="eager forwards inside the graphs")
    p.add_argument("--no-fuse-projections", action="store_true", help="q/k/v and gate/up apart (default: fused "
                   "for targets up to 1B parameters)")
    p.add_argument("--autotune", default="target", metavar="CHOICES",
                   help="whose compiled single-row forwards autotune their matmuls on CUDA: target (as the decoder "
                   "ships), none, all; a comma-separated list times each choice in turn, in this process")
    p.add_argument("--attention", default="default", metavar="CHOICES",
                   help="the target's and draft's attention: default (as the decoder ships: grouped on CUDA), sdpa "
                   "(transformers' own, K/V repeated per query head), grouped (K/V heads read in place, "
                   "attention.py) or matmul (grouped, with verifies of up to 64 rows spelt as matmuls too); a "
                   "comma-separated list times each in turn")
    p.add_argument("--rounds", default="on", metavar="CHOICES",
                   help="chains and trees, greedy or sampled: on (as shipped: rounds that never wait for the host, "
                   "rounds.py, the next batch queued before a read-back) or batched (without that overlap: each "
                   "batch read back before the next is queued); on,batched times each in turn")
    p.add_argument("--tree-select", default="ours", metavar="CHOICES",
                   help="how a tree's round orders scores and takes the draft's top-k: ours (as shipped: ranking, "
                   "top-k by groups, on CUDA) or aten (its sort and top-k); ours,aten times each in turn")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); above: sampled rounds "
                   "(seed 0 in every arm)")
    p.add_argument("--modes", default="plain,chain,tree", help="which of plain, chain, tree to time")
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)

    choices = a.autotune.split(",")
    if not set(choices) <= set(CHOICES):
        p.error(f"--autotune {a.autotune}: choose from {', '.join(CHOICES)}")
    attns = a.attention.split(",")
    if not set(attns) <= set(ATTENTION):
        p.error(f"--attention {a.attention}: choose from {', '.join(ATTENTION)}")
    rounds = a.rounds.split(",")
    if not set(rounds) <= set(ROUNDS):
        p.error(f"--rounds {a.rounds}: choose from {', '.join(ROUNDS)}")
    selects = a.tree_select.split(",")
    if not set(selects) <= set(TREE_SELECT):
        p.error(f"--tree-select {a.tree_select}: choose from {', '.join(TREE_SELECT)}")
    try:
        sampling = SamplingParams(temperature=a.temperature)
    except UsageError as e:
        p.error(str(e))
    arms = [(c, at, r, ts) for c in choices for at in attns for r in rounds for ts in selects]
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t, draft, meta, ids, shapes = load_pair(a, device)
    dtype = next(t.model.parameters()).dtype
    cuda = device.type == "cuda"
    common = dict(cuda_graphs=cuda, compile=cuda and not a.no_compile,
                  fuse_projections=False if a.no_fuse_projections else None)
    rows, modes = {}, set(a.modes.split(","))
    for name, shape in shapes.items():
        if name.split()[0] not in modes:
            continue
        def make(shape=shape, **kw):
            return SpecDecoder(t, None if shape is None else draft, None if shape is None else meta,
                               shape=SpecConfig.for_device(device, **(shape or {})), speedups=Speedups(**common, **kw))
        decs = {"/".join((c, at) + ((f"rounds {r}",) if len(rounds) > 1 else ())
                         + ((f"select {ts}",) if len(selects) > 1 else ())):
                warmed(make, c, at, r, ts, ids, a.new, shape is None, sampling) for c, at, r, ts in arms}
        for arm, row in measure(decs, ids, a.new, a.repeats, shape is None, sampling).items():
            rows[name if len(arms) == 1 else f"{name} [{arm}]"] = row
        dec = next(iter(decs.values()))

    print(f"decode rounds: {a.target} {str(dtype).split('.')[-1]} on "
          f"{torch.cuda.get_device_name(device) if cuda else platform.processor() or 'cpu'}, compile={common['compile']}, "
          f"autotune={a.autotune}, attention={a.attention}, fused projections={dec.applied.fuse_projections}, "
          f"T={a.temperature}")
    w = max(24, max(map(len, rows), default=0) + 2)
    print(f"{'mode':<{w}}{'round ms':>10}{'graphs ms':>11}{'host ms':>9}{'tok/s':>9}{'accept':>8}")
    for name, r in rows.items():
        g = r.get("graphs_ms_per_round")  # each graph's GPU time, times its replays a round
        host = r["round_ms"] - g if g is not None else None
        acc = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        print(f"{name:<{w}}{r['round_ms']:>10.3f}{(f'{g:.3f}' if g is not None else '-'):>11}"
              f"{(f'{host:.3f}' if host is not None else '-'):>9}{r['tokens_per_s']:>9.1f}{acc:>8}")
    if a.json:
        out = {"eaglewire": __version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "target": a.target,
               "device": str(device), "dtype": str(dtype), "torch": torch.__version__, "settings": vars(a),
               "rows": rows}
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
