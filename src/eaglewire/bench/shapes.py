"""`eaglewire bench --shapes chain:4,chain:7,tree:6x6x31,...`: one draft in several speculation shapes, on the
same prompts in one run.

Which shape is fastest depends on the target, the draft and the machine: a longer chain or a deeper tree
accepts more, but each level is one more draft step and a wider tree a larger verify. So it is measured,
as SGLang's `bench_speculative.py` sweeps steps, topk and draft tokens. HF `generate` (unless --no-hf) and our
decoder without a draft run first, in turn prompt by prompt. Then the draft runs in each shape, every shape with
its own warm-up. Each shape is timed in turn with our decoder without a draft again, so that each row's "x base"
compares runs made in the same minutes. Its "x hf" is that ratio times the first pass's base/hf (HF is slow to
time twice).
Each row names the shape in the engines' words (interop/serve.py's rules: SGLang counts the
verified root among its draft tokens; vLLM runs chains), and the report ends with the fastest and the
export command for it. Prints the table, writes JSON and a PNG of tokens/s against acceptance length.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import sys
from pathlib import Path

import torch

from ..errors import EaglewireError, UsageError
from ..interop.serve import SpecArgs
from .report import or_dash, write_json
from .run import (BenchConfig, acceptance, decoder_runner, describe, greedy_check, hf_runner, prepare, run_prompts,
                  shape_from, summarize, summarize_runs)

SHAPE = re.compile(r"chain:(\d+)|tree:(\d+)x(\d+)x(\d+)")


def parse_shapes(text: str) -> list[dict]:
    """'chain:7,tree:6x8x63' -> shape_from's keywords for each shape (a tree: depth x topk x budget)."""
    shapes = []
    for item in (x.strip() for x in text.split(",")):
        m = SHAPE.fullmatch(item)
        if not m:
            raise UsageError(f"--shapes: {item!r} is neither chain:K nor tree:DEPTHxTOPKxBUDGET "
                             "(e.g. --shapes chain:4,chain:7,tree:6x8x63)")
        shape = {"mode": "chain", "chain": int(m[1])} if m[1] else \
            {"mode": "tree", "depth": int(m[2]), "topk": int(m[3]), "budget": int(m[4])}
        if 0 in shape.values():
            raise UsageError(f"--shapes: {item} holds a 0; a chain's length and a tree's depth, top-k and budget "
                             "are each at least 1")
        if shape in shapes:
            raise UsageError(f"--shapes: {item} is listed twice")
        shapes.append(shape)
    return shapes


def shape_name(cfg: BenchConfig) -> str:
    s = cfg.shape
    return f"chain {s.K}" if s.mode == "chain" else f"tree d{s.depth} k{s.topk} b{s.budget}"


def engine_shapes(cfg: BenchConfig) -> dict[str, dict | None]:
    """The shape in the engines' words: SGLang's steps, topk and draft tokens (the root counted; None where
    SGLang has no such shape: a tree of more tokens than its levels hold), vLLM's chain length."""
    s = cfg.shape
    chain = s.mode == "chain"
    steps, topk = (s.K, 1) if chain else (s.depth, s.topk)
    try:
        a = SpecArgs(num_steps=steps, topk=topk, draft_tokens=None if chain else s.budget + 1)
    except UsageError:
        a = None
    return {"sglang": None if a is None else dataclasses.asdict(a),
            "vllm": {"num_speculative_tokens": s.K} if chain else None}


def _release(device: torch.device) -> None:
    """A finished shape's caches and graphs go before the next shape's are made (its runners refer to each
    other: only a collection frees them)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_shapes(target, draft, suite: str, shapes: list[dict], *, json_out=None, plot=None, log=None,
               **settings) -> dict:
    """(a) HF generate and (b) our decoder without a draft once (interleaved prompt by prompt), then the draft
    in each of `shapes` on the same prompts. The shapes are `parse_shapes`' dicts, one shape's graphs alive at a
    time. Returns the result dict (written to `json_out`)."""
    if not shapes:
        raise UsageError("--shapes: name at least one shape, e.g. chain:7")
    cfg = BenchConfig(suite=suite, **settings)
    cfgs = [dataclasses.replace(cfg, shape=shape_from(cfg.device, **s)) for s in shapes]  # checked before loading
    log = log or (lambda msg: print(msg, file=sys.stderr))
    device, dtype, sp, t, draft_model, meta, prompts, eos = prepare(target, draft, cfg)
    runners = {"hf": hf_runner(t, cfg, device, eos)} if cfg.hf else {}
    runners["base"] = decoder_runner(t, draft_model, meta, cfg, device, eos, speculate=False)
    gens = run_prompts({k: (f"{k} ({name})", run) for k, (name, run, _) in runners.items()}, prompts, cfg, device, log)
    names = {k: r[0] for k, r in runners.items()}
    base = (f"base ({names['base']})", runners["base"][1])  # timed again beside each shape
    base_linears = runners["base"][2].applied.linears
    del runners
    _release(device)
    head = describe(cfg, t, meta, sp, device, dtype)
    head["settings"]["draft"] = [c.draft_shape() for c in cfgs]
    head["settings"]["linears"] = base_linears  # the run without a draft's; each shape's own in its row
    runs = summarize_runs(t, gens, names, head["floor"]["ms"])
    ref = "hf" if cfg.hf else "base"
    greedy = cfg.sampling.greedy
    base_over_hf = runs["base"]["tokens_per_s"] / runs["hf"]["tokens_per_s"] if "hf" in runs else None
    rows = []
    for c in cfgs:
        name, run, dec = decoder_runner(t, draft_model, meta, c, device, eos, speculate=True)
        pair = run_prompts({"base": base, "spec": (f"{shape_name(c)} ({name})", run)}, prompts, c, device, log,
                           warmed=("base",))
        g = pair["spec"]
        row = {"shape": shape_name(c), **c.draft_shape(), "name": name, **summarize(g, head["floor"]["ms"]),
               "acceptance": acceptance(g, c.shape.levels), "engines": engine_shapes(c),
               "greedy_check": greedy_check(t, prompts, {ref: gens[ref], "spec": g}, ref, dtype) if greedy else None,
               "warnings": list(dec.warnings),
               "linears": dec.applied.linears}  # timed at this shape's verify rows too (prepack.py)
        row["base_tokens_per_s"] = summarize(pair["base"], None)["tokens_per_s"]  # timed in turn with this shape
        row["spec/base"] = row["tokens_per_s"] / row["base_tokens_per_s"]
        row["spec/hf"] = row["spec/base"] * base_over_hf if base_over_hf else None
        rows.append(row)
        del dec, run
        _release(device)
    result = {"eaglewire_bench_shapes": 1, **head, "runs": runs,
              "base_check": greedy_check(t, prompts, {"hf": gens["hf"], "base": gens["base"]}, "hf", dtype)
              if greedy and cfg.hf else None,
              "shapes": rows, "fastest": max(rows, key=lambda r: r["spec/base"])["shape"]}
    if json_out:
        write_json(result, json_out)
    if plot:
        plot_shapes(result, Path(plot))
    return result


def _checks(result: dict) -> list[tuple[str, dict | None]]:
    """(run, its greedy check against the reference) for the base run and each shape."""
    return [("base", result["base_check"])] + [(r["shape"], r["greedy_check"]) for r in result["shapes"]]


def failed_checks(result: dict) -> list[str]:
    """Runs whose greedy fp32 tokens differ from the reference's where the target's top-2 logits are no tie."""
    return [name for name, c in _checks(result) if c is not None and c["ok"] is False]


def format_shapes(r: dict) -> str:
    """The human-readable report of a shapes run."""
    m, s, runs = r["machine"], r["settings"], r["runs"]
    lines = [f"eaglewire bench --shapes  {r['suite']['name']} ({r['suite']['prompts']} prompts)  target "
             f"{r['target']['spec']}  {s['dtype']} on {m['device_name']}  max new {s['max_new_tokens']}  "
             f"T={s['temperature']}",
             f"{'run':<22}{'tok/s':>9}{'ms/step':>9}{'accept':>8}{'x base':>8}{'x hf':>7}  {'greedy':<8}SGLang"]
    for key in ("hf", "base"):
        if key in runs:
            check = r["base_check"] if key == "base" else None
            lines.append(f"{key:<22}{or_dash(runs[key]['tokens_per_s'], '.1f'):>9}{runs[key]['ms_per_step']:>9.2f}"
                         f"{'-':>8}{'-':>8}{'-':>7}  {_verdict(check):<8}")
    for row in r["shapes"]:
        lines.append(f"{row['shape']:<22}{or_dash(row['tokens_per_s'], '.1f'):>9}{row['ms_per_step']:>9.2f}"
                     f"{or_dash(row['acceptance']['acceptance_length'], '.2f'):>8}{row['spec/base']:>7.2f}x"
                     f"{or_dash(row['spec/hf'], '.2f') + 'x' if row['spec/hf'] else '-':>7}  "
                     f"{_verdict(row['greedy_check']):<8}{_sglang_flags(row['engines']['sglang'])}")
    lines.append("x base: against the run without a draft timed in turn with each shape; x hf: that times base/hf")
    unjudged = [c for _, c in _checks(r) if c is not None and c["ok"] is None and c["mismatches"]]
    if unjudged:
        lines.append(f"greedy: in {s['dtype']} a run may differ from {unjudged[0]['reference']} where kernels round "
                     "differently; tokens are judged in fp32 only")
    best = next(row for row in r["shapes"] if row["shape"] == r["fastest"])
    lines.append(f"fastest here: {best['shape']}, {best['tokens_per_s']:.1f} tok/s ({best['spec/base']:.2f}x without a "
                 f"draft, acceptance {best['acceptance']['acceptance_length']:.2f})")
    a = best["engines"]["sglang"]
    if a is not None:
        lines.append(f"  export for it: eaglewire export --draft {r['draft']['path']} --format sglang --num-steps "
                     f"{a['num_steps']} --topk {a['topk']} --draft-tokens {a['draft_tokens']} --out <dir>")
    return "\n".join(lines)


def _sglang_flags(a: dict | None) -> str:
    if a is None:
        return "- (no SGLang shape)"
    return (f"--speculative-num-steps {a['num_steps']} --speculative-eagle-topk {a['topk']} "
            f"--speculative-num-draft-tokens {a['draft_tokens']}")


def _verdict(check: dict | None) -> str:
    if check is None:
        return "-"
    return {True: "OK", False: "FAILED", None: "same" if not check["mismatches"] else "differs"}[check["ok"]]


def plot_shapes(result: dict, out: Path) -> Path:
    """PNG: tokens/s against acceptance length, a point a shape, and the run without a draft as a line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for row in result["shapes"]:
        x, y = row["acceptance"]["acceptance_length"], row["tokens_per_s"]
        ax.plot([x], [y], "o", color="#4477aa" if row["mode"] == "chain" else "#228833")
        ax.annotate(row["shape"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for key, style in (("base", "--"), ("hf", ":")):
        if key in result["runs"]:
            ax.axhline(result["runs"][key]["tokens_per_s"], linestyle=style, color="#777777",
                       label=f"{key} ({result['runs'][key]['tokens_per_s']:.1f} tok/s)")
    ax.set(xlabel="acceptance length (tokens a step)", ylabel="tokens/s",
           title=f"{result['suite']['name']} - {result['target']['spec']} - speculation shapes")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def main_shapes(args, settings: dict) -> int:
    """`bench --shapes`: the shapes run, its table, and a failed greedy fp32 check as an error."""
    if args.tree or args.chain:
        raise UsageError("--shapes names every shape to time; leave out --chain and --tree")
    result = run_shapes(args.target, args.draft, args.suite, parse_shapes(args.shapes), json_out=args.json,
                        plot=args.plot, **{k: v for k, v in settings.items() if k != "shape"})
    print(format_shapes(result))
    for what, path in (("json", args.json), ("plot", args.plot)):
        if path:
            print(f"{what}: {path}")
    bad = failed_checks(result)
    if bad:
        raise EaglewireError(f"greedy fp32 output of {', '.join(bad)} differs from the reference beyond a tie: "
                             "the decoder is not lossless")
    return 0
