"""`eaglewire serve-check`: the draft served by the real engine, beside eaglewire's own decoder.

    eaglewire serve-check --draft DIR --target T [--engine vllm] [--suite mt-bench|humaneval|gsm8k|arena-hard|alpaca-eval|FILE]
        [--max-prompts N] [--max-new-tokens M] [--chain K] [--wirings] [--json OUT] [--plot OUT.png]

The incident eaglewire exists for was lost between training and the serving engine, so the engine's own
counters are the ground truth here: the same prompts, greedy, batch 1, through
 (a) vLLM without the draft, (b) vLLM with it (a native draft is exported to vLLM's format first; an export
     is served as it is), (c) eaglewire's decoder without and with it;
then acceptance length, acceptance by position and tokens/s side by side, and the engine's greedy tokens with
and without the draft compared token for token. `--wirings` serves the draft again with the tap ids of the
doctor's main alternative wirings (every tap -1, every tap +1, and id 0 in place of the first: the embedding on
paper, the last layer's output in vLLM 0.26.0): the engine's acceptance for each is the ground truth that
`eaglewire doctor --probe` estimates.

Exit 1 when the two acceptance lengths differ by more than TOLERANCE, or when the engine's greedy tokens differ
with and without the draft other than at a near-tie.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import checkpoint, cli_args, interop, targets
from ..errors import UsageError
from ..files import write_json
from ..interop.common import IDS_KEY, PROVENANCE_KEY
from ..interop.serve import SpecArgs
from ..data.suites import SUITES
from ..taps import CONVENTIONS
from . import vllm as engine

# Both run the same draft on the same prompts greedily, but in bf16 their kernels round differently: once a
# near-tie flips, the two continue different texts, and over 20 MT-bench prompts acceptance length moves by a
# few percent that way. A precision loss in one of them (a 7% gap was one) or a wiring fault (10% for a
# one-layer shift on SmolLM2) is larger: 5% of acceptance length tells them apart.
TOLERANCE = 0.05
# A greedy token whose two most likely candidates lie closer than this (nats) is a near-tie: another kernel's
# rounding can pick the other one, so a divergence there is reported, not failed.
TIE = 0.1


@dataclass(frozen=True)
class Prepared:
    engine_dir: Path  # what the engine loads
    native: Path  # what eaglewire's decoder loads
    taps: tuple[int, ...]  # what the engine captures for it
    num_layers: int
    how: str


def prepare_draft(draft, target_spec: str, work: Path, chain: int) -> Prepared:
    """A native checkpoint exported to vLLM's format in `work`; an engine export served as it is and imported
    for our decoder."""
    d = Path(draft)
    if not (d / "config.json").is_file():
        raise UsageError(f"--draft {d}: no config.json (a native checkpoint or a vLLM-format export)")
    info = interop.load_target_info(target_spec)
    N = info.num_layers
    if json.loads((d / "config.json").read_text()).get("format") == checkpoint.FORMAT:
        out = work / "vllm"
        interop.export_draft(d, "vllm", out, spec=SpecArgs(num_steps=chain))
        engine_dir, native, how = out, d, "exported to vLLM's format"
    else:
        native, _ = interop.import_draft(d, work / "native", target=info)
        engine_dir, how = d, "served as it is"
    view = interop.read_engine_view(engine_dir, "vllm", num_layers=N)
    if not view.recognised or view.captured_taps is None:
        raise UsageError(f"--draft {d}: vLLM cannot serve it as written ({'; '.join(view.problems) or 'no taps'}): "
                         f"run `eaglewire doctor --draft {d} --engine vllm`")
    return Prepared(engine_dir, Path(native), tuple(view.captured_taps), N, how)


def wirings(taps: tuple[int, ...], num_layers: int) -> list[tuple[str, list[int]]]:
    """(label, vLLM ids) of the doctor's main alternatives: every tap -1 and +1, and id 0 for the first tap, the
    embedding on paper. vLLM 0.26.0 feeds the last layer's output at id 0 (taps._VLLM_ID0), so that row measures
    what a checkpoint asking for the embedding really gets."""
    from ..doctor.probe import candidates

    conv = CONVENTIONS["vllm"]
    out = [(w.label, conv.to_ids(w.sources, num_layers)) for w in candidates(taps, None, num_layers)
           if w.label in ("every tap -1", "every tap +1") and w.plain and min(w.sources) >= 1]
    if taps[0] > 0:
        out.append((f"id 0 for tap {taps[0]}: the embedding on paper, the last layer's output in vLLM",
                    [0] + conv.to_ids(taps[1:], num_layers)))
    return out


def with_ids(engine_dir: Path, ids, out: Path) -> Path:
    """A copy of an engine directory whose top-level ids are `ids` (vLLM's words); weights linked."""
    out.mkdir(parents=True)
    for f in engine_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((engine_dir / "config.json").read_text())
    cfg[IDS_KEY] = [int(i) for i in ids]
    cfg.pop(PROVENANCE_KEY, None)  # the record would contradict the ids written here
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


# --- figures (pure) -----------------------------------------------------------------------------------

def counts(per_prompt: list[dict], K: int) -> dict:
    """Acceptance over prompts from per-prompt counters {drafts, accepted, accepted_per_pos}."""
    drafts = sum(p["drafts"] for p in per_prompt)
    accepted = sum(p["accepted"] for p in per_prompt)
    pos = [sum((p["accepted_per_pos"] + [0] * K)[i] for p in per_prompt) for i in range(K)]
    return {"acceptance_length": 1 + accepted / drafts if drafts else None, "drafts": drafts, "accepted": accepted,
            "rate_by_position": [a / drafts if drafts else 0.0 for a in pos]}


def speed(per_prompt: list[dict]) -> float | None:
    tokens, seconds = sum(p["tokens"] for p in per_prompt), sum(p["seconds"] for p in per_prompt)
    return tokens / seconds if seconds else None


def _per_prompt(rows: list[dict]):
    """Per-prompt engine counters as the paired bootstrap's tallies (doctor/paired.py)."""
    import torch

    from ..doctor import paired

    t = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    return paired.PerPrompt(t([r["drafts"] + r["accepted"] for r in rows]), t([r["drafts"] for r in rows]),
                            t([(r["accepted_per_pos"] or [0])[0] for r in rows]), t([r["drafts"] for r in rows]))


def against(base: list[dict], others: list[list[dict]]) -> list[dict]:
    """Each of `others` against `base` (per-prompt counters on the same prompts): the acceptance-length difference,
    its simultaneous interval paired over prompts, and the relative difference."""
    from ..doctor import paired

    out = []
    for d in paired.compare(_per_prompt(base), [_per_prompt(o) for o in others]):
        out.append({"difference": d.length, "interval": list(d.length_ci),
                    "relative": d.length / d.base_length if d.base_length else 0.0})
    return out


def agreement(ours: list[dict], theirs: list[dict]) -> dict:
    """Ours against the engine's acceptance length: the relative difference, its paired interval over prompts
    (doctor/paired.py), and whether it is within TOLERANCE."""
    d = against(theirs, [ours])[0]
    return {**d, "tolerance": TOLERANCE, "agree": abs(d["relative"]) <= TOLERANCE}


def greedy_identity(plain: list[dict], spec: list[dict]) -> dict:
    """The engine's greedy tokens without and with the draft, prompt by prompt: a divergence at a near-tie
    (top-2 gap < TIE in the run without the draft) is reported, any other fails."""
    from ..bench.run import first_divergence

    ties, faults = [], []
    for i, (a, b) in enumerate(zip(plain, spec)):
        at = first_divergence(a["tokens"], b["tokens"])
        if at is None:
            continue
        gaps = a.get("gaps") or []
        gap = gaps[at] if at < len(gaps) else None
        row = {"prompt": i, "position": at, "top2_gap": gap}
        (ties if gap is not None and gap < TIE else faults).append(row)
    return {"prompts": len(plain), "identical": len(plain) - len(ties) - len(faults), "near_ties": ties,
            "mismatches": faults, "ok": not faults}


# --- the runs -----------------------------------------------------------------------------------------

def ours(target, native: Path, suite: str, max_prompts, max_new_tokens: int, chain: int, device, log) -> dict:
    """eaglewire's decoder without and with the draft on the suite, batch 1, bench's settings: per prompt the
    same counters the engine reports."""
    from ..bench import run as bench

    cfg = bench.BenchConfig(suite=suite, max_prompts=max_prompts, max_new_tokens=max_new_tokens, chain=chain,
                            hf=False, device=device)
    dev, dtype, sp, t, draft, meta, prompts, eos = bench.prepare(target, str(native), cfg)
    runs = {k: bench.decoder_runner(t, draft, meta, cfg, dev, eos, speculate=k == "spec") for k in ("base", "spec")}
    gens = bench.run_prompts({k: (f"eaglewire {k}", r[1]) for k, r in runs.items()}, prompts, cfg, dev, log)
    rows = {k: [{"tokens": len(g.tokens), "seconds": g.wall_s, "drafts": len(g.accepted or []),
                 "accepted": sum(g.accepted or []),
                 "accepted_per_pos": [sum(a > i for a in (g.accepted or [])) for i in range(chain)]}
                for g in gens[k]] for k in gens}
    return {"suite": sp, "conversations": sp.conversations, "dtype": str(dtype).removeprefix("torch."),
            "prompt_tokens": [int(p.shape[1]) for p in prompts], "base": rows["base"], "spec": rows["spec"],
            "names": {k: r[0] for k, r in runs.items()}}


def engine_rows(result: dict) -> list[dict]:
    return [{"tokens": len(p["tokens"]), "seconds": p["seconds"], **p["counters"]} for p in result["prompts"]]


def serve_check(draft, target: str, *, engine_name: str = "vllm", suite: str = "mt-bench", max_prompts=20,
                max_new_tokens: int = 256, chain: int = 7, with_wirings: bool = False, device=None,
                gpu_memory_utilization: float | None = None, log=None, work=None) -> dict:
    """Run the whole check; -> the JSON-ready result (its "ok" says whether the command exits 0)."""
    if engine_name != "vllm":
        raise UsageError(f"--engine {engine_name}: serve-check runs vllm (SGLang is not staged here)")
    engine.require()
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    path = targets.resolve(target)
    if path.suffix == ".gguf":
        raise UsageError(f"--target {target}: vLLM serves Hugging Face model directories; `eaglewire prepare` "
                         "writes one for a registry target, or pass a model directory")
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="eaglewire-serve-check-")) if own else Path(work)
    try:
        p = prepare_draft(draft, target, work, chain)
        log(f"eaglewire serve-check: the draft {p.how}; vLLM will capture taps {list(p.taps)}")
        mine = ours(target, p.native, suite, max_prompts, max_new_tokens, chain, device, log)
        convs = mine["conversations"]
        job = dict(target=str(path), conversations=convs, max_new_tokens=max_new_tokens,
                   num_speculative_tokens=chain, **engine.memory_share(gpu_memory_utilization))
        log("eaglewire serve-check: vLLM without the draft")
        plain = engine.run_job(engine.Job(draft=None, logprobs=2, **job))
        log("eaglewire serve-check: vLLM with the draft")
        spec = engine.run_job(engine.Job(draft=str(p.engine_dir), **job))
        alts = []
        for label, ids in (wirings(p.taps, p.num_layers) if with_wirings else []):
            d = with_ids(p.engine_dir, ids, work / f"wiring-{'-'.join(map(str, ids))}")
            log(f"eaglewire serve-check: vLLM with the draft given ids {ids} ({label})")
            r = engine.run_job(engine.Job(draft=str(d), enforce_eager=True, **job))
            alts.append({"label": label, "ids": ids, "aux_layers": r["aux_layers"], "per_prompt": engine_rows(r),
                         **counts(engine_rows(r), chain)})
        return result(p, mine, plain, spec, alts, chain, max_new_tokens, target)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def result(p: Prepared, mine: dict, plain: dict, spec: dict, alts: list, chain: int, max_new_tokens: int,
           target) -> dict:
    e_plain, e_spec = engine_rows(plain), engine_rows(spec)
    agree = agreement(mine["spec"], e_spec)
    for alt, d in zip(alts, against(e_spec, [a["per_prompt"] for a in alts])):
        alt["vs_draft_ids"] = d  # paired over the same prompts: the engine's greedy text is the same for each
    same = greedy_identity(plain["prompts"], spec["prompts"])
    seen = spec.get("aux_layers")
    wired = seen is None or tuple(seen["ids"]) == p.taps
    return {
        "eaglewire_serve_check": 1, "engine": "vllm", "engine_version": spec.get("vllm_version"),
        "target": target, "suite": mine["suite"].summary(), "draft": {"served": str(p.engine_dir), "how": p.how,
                                                                     "taps": list(p.taps)},
        "settings": {"chain": chain, "max_new_tokens": max_new_tokens, "dtype": mine["dtype"], "batch": 1,
                     "greedy": True},
        "engine_aux_layers": seen,
        "ours": {**counts(mine["spec"], chain), "tokens_per_s": speed(mine["spec"]),
                 "tokens_per_s_without": speed(mine["base"]), "name": mine["names"]["spec"]},
        "vllm": {**counts(e_spec, chain), "tokens_per_s": speed(e_spec), "tokens_per_s_without": speed(e_plain)},
        "agreement": agree, "greedy": same, "wirings": alts,
        "ok": agree["agree"] and same["ok"] and wired,
    }


# --- the report -----------------------------------------------------------------------------------------

def render(r: dict) -> str:
    o, v, a, g = r["ours"], r["vllm"], r["agreement"], r["greedy"]
    f = lambda x, fmt=".2f": "-" if x is None else format(x, fmt)  # noqa: E731
    lines = [f"eaglewire serve-check  {r['suite']['name']} ({r['suite']['prompts']} prompts)  target {r['target']}  "
             f"vLLM {r['engine_version']}  greedy, batch 1, chain of {r['settings']['chain']}",
             f"  draft {r['draft']['how']}: taps {r['draft']['taps']}; vLLM said it captures "
             + (f"{r['engine_aux_layers']['ids']} (from its {r['engine_aux_layers']['from']})"
                if r["engine_aux_layers"] else "(no log line found)"), "",
             f"  {'':<28}{'eaglewire':>12}{'vLLM':>12}",
             f"  {'acceptance length':<28}{f(o['acceptance_length']):>12}{f(v['acceptance_length']):>12}",
             f"  {'verification steps':<28}{o['drafts']:>12}{v['drafts']:>12}"]
    for i, (x, y) in enumerate(zip(o["rate_by_position"], v["rate_by_position"])):
        lines.append(f"  {f'accepted at position {i + 1}':<28}{x:>12.3f}{y:>12.3f}")
    lines += [f"  {'tokens/s with the draft':<28}{f(o['tokens_per_s'], '.1f'):>12}{f(v['tokens_per_s'], '.1f'):>12}",
              f"  {'tokens/s without':<28}{f(o['tokens_per_s_without'], '.1f'):>12}"
              f"{f(v['tokens_per_s_without'], '.1f'):>12}", ""]
    lines.append(f"acceptance length: eaglewire {a['difference']:+.3f} against vLLM ({100 * a['relative']:+.1f}%, "
                 f"interval {a['interval'][0]:+.3f}..{a['interval'][1]:+.3f} paired over prompts): "
                 + ("within" if a["agree"] else "BEYOND") + f" the tolerance of {100 * a['tolerance']:.0f}%")
    lines.append(f"vLLM's greedy tokens with and without the draft: {g['identical']} of {g['prompts']} prompts "
                 f"identical" + (f", {len(g['near_ties'])} diverge at a near-tie" if g["near_ties"] else "")
                 + (f", {len(g['mismatches'])} MISMATCH (first: prompt {g['mismatches'][0]['prompt']} position "
                    f"{g['mismatches'][0]['position']})" if g["mismatches"] else ""))
    seen = r["engine_aux_layers"]
    if seen and seen["ids"] != r["draft"]["taps"]:
        lines.append(f"vLLM captured taps {seen['ids']}, not {r['draft']['taps']}: run `eaglewire doctor`")
    if r["wirings"]:
        lines += ["", "the engine's acceptance with other ids (what `eaglewire doctor --probe` estimates; the difference "
                  "with its simultaneous 95% interval, paired over prompts):",
                  f"  {'vLLM ids':<16}{'accept-len':>12}  {'difference':<26}what"]
        lines.append(f"  {str(r['draft']['taps']):<16}{f(v['acceptance_length']):>12}  {'':<26}the draft's ids")
        for w in r["wirings"]:
            d = w["vs_draft_ids"]
            diff = f"{d['difference']:+.2f} ({d['interval'][0]:+.2f}..{d['interval'][1]:+.2f})"
            lines.append(f"  {str(w['ids']):<16}{f(w['acceptance_length']):>12}  {diff:<26}{w['label']}")
    lines += ["", "ok" if r["ok"] else "NOT OK: see above"]
    return "\n".join(lines)


def plot(r: dict, out) -> Path:
    """PNG: acceptance by draft position, eaglewire against vLLM, and the wirings' acceptance lengths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    o, v = r["ours"]["rate_by_position"], r["vllm"]["rate_by_position"]
    x = list(range(1, len(o) + 1))
    fig = Figure(figsize=(10.5 if r["wirings"] else 6, 3.6), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1) if r["wirings"] else fig.add_subplot()
    ax.bar([i - 0.2 for i in x], o, width=0.4, color="#4477aa", label=f"eaglewire ({r['ours']['acceptance_length']:.2f})")
    ax.bar([i + 0.2 for i in x], v, width=0.4, color="#ee6677", label=f"vLLM ({r['vllm']['acceptance_length']:.2f})")
    ax.set(xlabel="draft position", ylabel="accepted (share of steps)", ylim=(0, 1.05), xticks=x,
           title=f"{r['suite']['name']}: acceptance by position")
    ax.legend(fontsize=8)
    if r["wirings"]:
        bx = fig.add_subplot(1, 2, 2)
        rows = [(str(r["draft"]["taps"]), r["vllm"]["acceptance_length"])] + \
            [(f"{w['ids']} {w['label'].split(':')[0]}", w["acceptance_length"]) for w in r["wirings"]]
        bx.barh([a for a, _ in rows][::-1], [b or 0 for _, b in rows][::-1], color="#228833")
        bx.set(xlabel="vLLM acceptance length", title="other ids")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def cmd_serve_check(args) -> int:
    r = serve_check(args.draft, args.target, engine_name=args.engine, suite=args.suite, max_prompts=args.max_prompts,
                    max_new_tokens=args.max_new_tokens, chain=args.chain, with_wirings=args.wirings,
                    device=args.device, gpu_memory_utilization=args.gpu_memory_utilization)
    print(render(r))
    if args.json:
        write_json(args.json, r)
    if args.plot:
        plot(r, args.plot)
    return 0 if r["ok"] else 1


def register(sub) -> None:
    p = sub.add_parser("serve-check", help="serve the draft in the real engine (vLLM) beside eaglewire's decoder: "
                       "acceptance, greedy identity, tap wirings")
    cli_args.add_draft(p, required=True, help="native checkpoint (exported for the engine) or a vLLM export")
    cli_args.add_target(p, help="registry name or Hugging Face model directory")
    p.add_argument("--engine", default="vllm", choices=["vllm"])
    cli_args.add_suite(p, default="mt-bench", help=f"{', '.join(SUITES)} or a prompt FILE")
    p.add_argument("--max-prompts", type=int, default=20, metavar="N")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="M")
    p.add_argument("--chain", type=int, default=7, metavar="K", help="draft tokens a step (default 7)")
    p.add_argument("--wirings", action="store_true",
                   help="serve again with every id -1, every id +1, and id 0 in place of the first (the embedding on "
                        "paper; vLLM feeds the last layer's output there)")
    cli_args.add_device(p, help="where eaglewire's decoder runs (default: cuda if available)")
    cli_args.add_gpu_memory(p, help="the share of the GPU's memory vLLM takes (default 0.5)")
    p.add_argument("--json", default=None, metavar="OUT")
    p.add_argument("--plot", default=None, metavar="OUT.png")
    p.set_defaults(func=cmd_serve_check)
