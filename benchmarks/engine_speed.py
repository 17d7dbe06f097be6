"""Tokens/s of the real engine (vLLM or SGLang) without and with an EAGLE-3 draft, by requests in flight at once.

    python benchmarks/engine_speed.py --target T --draft DIR --engine vllm|sglang [--suite mt-bench] [--prompts 32]
        [--new-tokens 256] [--chain 7 | --chain 3,5,7] [--concurrency 1,4,16] [--gpu-memory-utilization 0.5]
        [--json OUT] [--plot OUT.png] [--sglang-python PY] [--sglang-path DIR]

What it measures. Engine runs, each in its own process, on the same prompts, greedy: the target alone, then the
target with the draft, served as `eaglewire serve-check` serves it (a native checkpoint exported to the engine's
format, a chain of --chain draft tokens; an engine export as it is), once for each chain length --chain lists. A
draft round costs more with each draft token and earns less from the later ones: the sweep shows which length is
fastest on this target, at each load. In each run, after a warm-up, for
each c of --concurrency the prompts go to the engine in consecutive calls of c prompts (the engine's batch API:
c requests at once), each call timed around the engine's call alone (engines/vllm.py, engines/sglang_worker.py:
Job.concurrency). Per c:
- tokens/s = the new tokens of all its calls / their seconds: what c concurrent requests get out of the GPU
  together (at c = 1 also a request's own speed);
- speed-up = tokens/s with the draft / without, at the same c (one run without the draft serves every chain);
- acceptance length = 1 + accepted draft tokens / verification steps, from the engine's own counters over the
  with-draft calls at that c, computed as serve-check computes it;
- step cost = acceptance length / speed-up: what a step with the draft costs, in steps without it (both runs write
  the same greedy tokens). The draft pays where the acceptance length exceeds it; 2x needs twice it.

How to read it. A draft spends spare GPU compute to save target steps: at c = 1 a decode step leaves most of the
GPU idle, and the speed-up there is what a lone user sees. As c grows the batch itself fills the GPU, a verify
step of c x (chain + 1) tokens costs more than a plain step of c, and the speed-up shrinks; where it falls under
1, the draft costs throughput at that load. Acceptance should barely move with c (the same prompts, greedy): if
it does, the engine drafts differently in a batch. A call lasts as long as its longest reply, so slots that
finish early idle until it ends: tokens/s at c > 1 is below what a server that refills its slots sustains, for
both runs alike. Needs --prompts >= the largest c; use a few times that, so each c has several calls.

Prints a markdown table on stdout, progress on stderr; --json writes the settings, the machine, the engine's
version and limits and a row per chain length and c; --plot a PNG of tokens/s and the speed-up against c, a line per
chain length. With several lengths the table names the one with the highest speed-up measured at each c: one run
each, so a close second may be noise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from eaglewire import cli_args, targets
from eaglewire.data.suites import load_suite
from eaglewire.engines import serve_check
from eaglewire.errors import EaglewireError, UsageError
from eaglewire.files import atomic_path, write_json

CONCURRENCY = (1, 4, 16)


def say(msg: str) -> None:
    print(f"engine_speed: {msg}", file=sys.stderr, flush=True)


def positive_ints(flag: str, text: str, means: str, example: str) -> tuple[int, ...]:
    """A flag's comma-separated integers >= 1, as given (order kept, repeats dropped); else its one-line error."""
    try:
        ns = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        ns = []
    if not ns or any(n < 1 for n in ns):
        raise UsageError(f"{flag} {text}: give {means}integers >= 1, comma-separated (e.g. {flag} {example})")
    return tuple(dict.fromkeys(ns))


def parse_concurrency(text: str) -> tuple[int, ...]:
    return positive_ints("--concurrency", text, "", "1,4,16")


def parse_chains(text: str) -> tuple[int, ...]:
    """--chain: one draft length, or several (a sweep)."""
    return positive_ints("--chain", text, "draft tokens a step, ", "3,5,7")


def measure(target: str, draft, engine: str, *, suite: str = "mt-bench", prompts: int = 32, new_tokens: int = 256,
            chains: tuple[int, ...] = (7,), concurrency: tuple[int, ...] = CONCURRENCY, memory: float | None = None,
            sglang_python: str | None = None, sglang_path: str | None = None, log=say) -> dict:
    """The run without the draft and one with it per chain length, each with `concurrency`; -> the JSON-ready
    result (`result`)."""
    eng = serve_check.serving(engine, memory=memory, sglang_python=sglang_python, sglang_path=sglang_path)
    if prompts < max(concurrency):
        raise UsageError(f"--prompts {prompts}: fewer than the largest concurrency {max(concurrency)}; give "
                         f"--prompts {4 * max(concurrency)} (several calls at each c)")
    eng.require()
    path = targets.resolve(target)
    if path.suffix == ".gguf":
        raise UsageError(f"--target {target}: {eng.label} serves Hugging Face model directories; `eaglewire prepare` "
                         "writes one for a registry target, or pass a model directory")
    sp = load_suite(suite, prompts)
    convs = sp.conversations[:prompts]
    if len(convs) < max(concurrency):
        raise UsageError(f"--suite {suite}: {len(convs)} prompts, fewer than the largest concurrency "
                         f"{max(concurrency)}; give a larger suite or a smaller --concurrency")
    with tempfile.TemporaryDirectory(prefix="engine-speed-") as work:
        # every export before any engine starts: a draft the engine cannot take fails in seconds, not runs later
        served = {k: serve_check.prepare_draft(draft, target, Path(work) / f"chain-{k}", k, eng) for k in chains}
        p = served[chains[0]]
        log(f"the draft {p.how}; {eng.label} will capture taps {list(p.taps)}")
        at = f"{len(convs)} prompts at concurrency {', '.join(map(str, concurrency))}"
        log(f"{eng.label} without the draft: {at}")
        plain = eng.run(str(path), conversations=convs, input_ids=None, max_new_tokens=new_tokens, chain=chains[0],
                        draft=None, concurrency=concurrency)
        spec = {}
        for k, q in served.items():
            log(f"{eng.label} with the draft, a chain of {k}: {at}")
            spec[k] = eng.run(str(path), conversations=convs, input_ids=None, max_new_tokens=new_tokens, chain=k,
                              draft=str(q.engine_dir), concurrency=concurrency)
    r = result(eng, plain, spec, concurrency)
    r.update(target=target, suite=sp.summary(), draft={"given": str(draft), "how": p.how, "taps": list(p.taps)},
             settings={"prompts": len(convs), "new_tokens": new_tokens, "chains": list(chains),
                       "concurrency": list(concurrency), "memory_share": memory, "greedy": True,
                       "engine_cuda_graphs": True})
    return r


def result(eng, plain_run: dict, spec_runs: dict, concurrency: tuple[int, ...]) -> dict:
    """A row per chain length and c: the run without the draft beside that chain's run, the acceptance from its
    counters (serve-check's `counts` over the engine's counters, read by its Serving class)."""
    first = next(iter(spec_runs))
    plain = {r["c"]: r for r in eng.concurrency_rows(plain_run, first)}
    plain_limit = eng.running_limit(plain_run)
    limits = {"without": plain_limit}
    rows = []
    for k, run in spec_runs.items():
        spec = {r["c"]: r for r in eng.concurrency_rows(run, k)}
        lim = (plain_limit, eng.running_limit(run))
        limits[f"with, chain {k}"] = lim[1]
        for c in concurrency:
            w, s = plain[c], spec[c]
            tw, ts = serve_check.speed([w]), serve_check.speed([s])  # a row's tokens over its seconds
            acc = serve_check.counts([s["counters"]], k) if s["counters"] else None
            # an engine that runs fewer than c at once measures that many, not c: said beside the row
            capped = min((v for v in lim if v is not None and v < c), default=None)
            rows.append({"chain": k, "c": c, "calls": s["calls"], "tokens_per_s_without": tw, "tokens_per_s_with": ts,
                         "speedup": ts / tw if tw and ts else None,
                         "acceptance_length": acc["acceptance_length"] if acc else None,
                         "step_cost": acc["acceptance_length"] * tw / ts if acc and tw and ts else None,
                         "rate_by_position": acc["rate_by_position"] if acc else None,
                         "engine_ran_at_most": capped, "without": w, "with": s})
    return {"eaglewire_engine_speed": 2, "engine": eng.name, "engine_label": eng.label,
            "engine_version": eng.version(spec_runs[first]), "engine_limits": limits,
            "engine_resolved": {str(k): v.get("resolved") for k, v in spec_runs.items()}, "rows": rows}


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(r: dict) -> str:
    E, s = r["engine_label"], r["settings"]
    ks, sweep = s["chains"], len(s["chains"]) > 1
    lines = [f"{E} {r['engine_version']}, {r['target']}, draft {r['draft']['given']} ({r['draft']['how']}): "
             f"{r['suite']['name']}, {s['prompts']} prompts, {s['new_tokens']} new tokens, greedy, chain"
             f"{'s' if sweep else ''} of {', '.join(map(str, ks))}", "",
             "| " + "chain | " * sweep + "c | tokens/s without | tokens/s with | speed-up | acceptance length | "
             "step cost |", "|" + "---:|" * sweep + "---:|---:|---:|---:|---:|---:|"]
    for x in r["rows"]:
        lines.append("| " + f"{x['chain']} | " * sweep + f"{x['c']} | {_f(x['tokens_per_s_without'], '.1f')} | "
                     f"{_f(x['tokens_per_s_with'], '.1f')} | {_f(x['speedup'], '.2f')}x | "
                     f"{_f(x['acceptance_length'], '.2f')} | {_f(x['step_cost'], '.2f')} |")
    notes = ["step cost: a step with the draft in steps without it (acceptance length / speed-up); the draft pays "
             "where the acceptance length exceeds it, 2x needs twice it"]
    for c in dict.fromkeys(x["c"] for x in r["rows"]):
        measured = [x for x in r["rows"] if x["c"] == c and x["speedup"] is not None]
        if sweep and measured:
            top = max(measured, key=lambda x: x["speedup"])
            notes.append(f"c = {c}: a chain of {top['chain']} gave the highest speed-up measured, "
                         f"{top['speedup']:.2f}x (one run each)")
        capped = [x["engine_ran_at_most"] for x in r["rows"] if x["c"] == c and x["engine_ran_at_most"] is not None]
        if capped:
            notes.append(f"c = {c}: {E} ran at most {min(capped)} requests at once")
    return "\n".join(lines + [""] + notes)


def plot(r: dict, out) -> Path:
    """PNG: tokens/s without and with the draft against c, and the speed-up against c (1 = no gain), a line per
    chain length."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ks = r["settings"]["chains"]
    cs = list(dict.fromkeys(x["c"] for x in r["rows"]))
    nan = lambda v: float("nan") if v is None else v  # noqa: E731  a missing point is a gap, not a zero
    fig = Figure(figsize=(10.5, 3.8), dpi=120)
    FigureCanvasAgg(fig)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    first = [x for x in r["rows"] if x["chain"] == ks[0]]
    ax.plot(cs, [nan(x["tokens_per_s_without"]) for x in first], "o-", color="#777777", label="without the draft")
    colours = ["#4477aa", "#228833", "#ee6677", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb"]
    for i, k in enumerate(ks):
        rows, colour = [x for x in r["rows"] if x["chain"] == k], colours[i % len(colours)]
        label = "with the draft" if len(ks) == 1 else f"with the draft, chain of {k}"
        ax.plot(cs, [nan(x["tokens_per_s_with"]) for x in rows], "o-", color=colour, label=label)
        bx.plot(cs, [nan(x["speedup"]) for x in rows], "o-", color=colour, label=f"chain of {k}")
        for x in rows:
            if x["speedup"] is not None and x["acceptance_length"] is not None:
                bx.annotate(f"accept {x['acceptance_length']:.2f}", (x["c"], x["speedup"]),
                            textcoords="offset points", xytext=(4, 4), fontsize=8, color=colour)
    bx.axhline(1.0, linestyle="--", color="#777777")
    bx.margins(x=0.15)  # room for the last point's label
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.set_xticks(cs)
        a.set_xticklabels([str(c) for c in cs])
        a.set_xlabel("requests at once (c)")
    ax.set(ylabel="tokens/s (all requests)", title=f"{r['engine_label']} {r['engine_version']}: {r['suite']['name']}")
    ax.legend(fontsize=8)
    bx.set(ylabel="speed-up (with / without)", title="chain of " + ", ".join(map(str, ks)))
    if len(ks) > 1:
        bx.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    return out


def machine() -> dict:
    """bench's description of the machine (the engines ran on its GPU, when it has one)."""
    import torch

    from eaglewire.bench.report import machine_info

    return machine_info(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as eaglewire's own errors
        say(f"error: {message}")
        sys.exit(2)


def main(argv=None) -> int:
    p = _Parser(description=__doc__.split("\n\n")[0])
    cli_args.add_target(p, help="Hugging Face model directory (or a registry name `eaglewire prepare` wrote one for)")
    cli_args.add_draft(p, required=True, help="native checkpoint (exported for the engine) or an engine export")
    p.add_argument("--engine", required=True, help=" or ".join(serve_check.ENGINES))
    cli_args.add_suite(p, default="mt-bench", help="a bench suite or a prompt FILE")
    p.add_argument("--prompts", type=cli_args.positive_int, default=32, metavar="N",
                   help="prompts in each run (default 32; at least the largest c)")
    p.add_argument("--new-tokens", type=cli_args.positive_int, default=256, metavar="M",
                   help="new tokens a request at most (default 256)")
    p.add_argument("--chain", default="7", metavar="K[,K...]",
                   help="draft tokens a step (default 7); several, comma-separated, serve one run each (a sweep)")
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), metavar="C,...",
                   help="requests at once, comma-separated (default 1,4,16)")
    cli_args.add_gpu_memory(p, help="the share of the GPU's memory the engine takes (vLLM's gpu_memory_utilization, "
                            "SGLang's mem_fraction_static; default 0.5)")
    p.add_argument("--sglang-python", default=None, metavar="PY", help="SGLang's Python (as serve-check)")
    p.add_argument("--sglang-path", default=None, metavar="DIR", help="SGLang's site folders (as serve-check)")
    p.add_argument("--json", default=None, metavar="OUT")
    p.add_argument("--plot", default=None, metavar="OUT.png")
    a = p.parse_args(argv)
    try:
        r = measure(a.target, a.draft, a.engine, suite=a.suite, prompts=a.prompts, new_tokens=a.new_tokens,
                    chains=parse_chains(a.chain), concurrency=parse_concurrency(a.concurrency),
                    memory=a.gpu_memory_utilization,
                    sglang_python=a.sglang_python, sglang_path=a.sglang_path)
    except EaglewireError as e:
        say(f"error: {e}")
        return e.exit_code
    r["machine"] = machine()
    print(render(r))
    if a.json:
        write_json(a.json, r)
        say(f"wrote {a.json}")
    if a.plot:
        say(f"wrote {plot(r, a.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
