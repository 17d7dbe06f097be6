"""The bench's report: the machine it ran on, the target step's physical floor, the acceptance plot
and the table (bench.py runs the bench; shapes.py sweeps speculation shapes and reuses these)."""

from __future__ import annotations

import datetime
import platform
from pathlib import Path

import torch

from .. import __version__, files, stats

BANDWIDTH = {"H200": 4.3e12}  # bytes/s a decode step can stream (below the 4.8 TB/s peak); others: pass bandwidth=
RUNS = ("hf", "base", "spec")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict:
    import transformers

    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": str(device), "device_name": _cpu_name(), "cpu": _cpu_name(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "platform": platform.platform(), "torch": torch.__version__, "transformers": transformers.__version__,
            "eaglewire": __version__}
    if device.type == "cuda":
        info.update(device_name=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return info


def floor_ms(weight_bytes: int, device_name: str, bandwidth: float | None) -> tuple[float | None, float | None]:
    """(bandwidth bytes/s, ms) of reading the target's weights once; None where unknown (CPUs)."""
    bw = bandwidth or next((v for k, v in BANDWIDTH.items() if k in device_name), None)
    return (bw, 1e3 * weight_bytes / bw) if bw else (None, None)


def plot_acceptance(result: dict, out: Path) -> Path:
    """PNG of the acceptance rate by draft position, and by category where the suite has them (Agg canvas:
    no display, no global backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    acc = result["acceptance"]
    rate = acc["rate_by_position"]
    cond = [c if c is not None else float("nan") for c in acc["conditional_rate_by_position"]]
    x = list(range(1, len(rate) + 1))
    groups = {k: v for k, v in (result.get("acceptance_by_group") or {}).items() if v is not None}
    fig = Figure(figsize=(10.5 if groups else 6, 3.6), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1) if groups else fig.add_subplot()
    if groups:  # a second panel: acceptance length by category (MT-bench's writing, roleplay, ...)
        bx = fig.add_subplot(1, 2, 2)
        bx.barh(list(groups)[::-1], list(groups.values())[::-1], color="#228833")
        bx.set(xlabel="acceptance length (tokens a step)", title="by category")
    ax.bar(x, rate, color="#4477aa", label="accepted at least i (share of steps)")
    ax.plot(x, cond, "o-", color="#ee6677", label="given i-1 accepted")
    ax.set(xlabel="draft position i", ylabel="acceptance rate", ylim=(0, 1.05), xticks=x)
    s = result["settings"]
    ax.set_title(f"{result['suite']['name']} - {result['runs']['spec']['name']} - acceptance length "
                 f"{acc['acceptance_length']:.2f} (T={s['temperature']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def or_dash(v, fmt: str) -> str:
    """v formatted, or "-" where it is unknown (None)."""
    return "-" if v is None else format(v, fmt)


def format_table(r: dict) -> str:
    """The human-readable report of a bench result."""
    m, s = r["machine"], r["settings"]
    lines = [f"eaglewire bench  {r['suite']['name']} ({r['suite']['prompts']} prompts)  target {r['target']['spec']}"
             f"  {s['dtype']} on {m['device_name']}  max new {s['max_new_tokens']}  T={s['temperature']}",
             f"{'run':<10}{'engine':<28}{'tokens':>8}{'wall s':>9}{'tok/s':>9}{'ms/step':>9}{'x floor':>9}"]
    for key, label in zip(RUNS, ("(a) hf", "(b) base", "(c) spec")):
        run = r["runs"].get(key)
        if run:
            lines.append(f"{label:<10}{run['name']:<28}{run['tokens']:>8}{run['wall_s']:>9.2f}"
                         f"{or_dash(run['tokens_per_s'], '.1f'):>9}{run['ms_per_step']:>9.2f}"
                         f"{or_dash(run['steps_over_floor'], '.0f'):>9}")
    late = {k: v["graphs_compiled_while_timed"] for k, v in r["runs"].items() if v.get("graphs_compiled_while_timed")}
    if late:
        lines.append(f"note: graphs compiled inside timed runs (their compile time is in the timings): {late}")
    fl = r["floor"]
    mb = f"{fl['weight_bytes'] / 1e6:.1f} MB of weights"
    lines.append(f"target step floor: {fl['ms']:.3f} ms ({mb} at {fl['bandwidth'] / 1e12:.1f} TB/s)" if fl["ms"] else
                 f"target step floor: no bandwidth known for {m['device_name']} ({mb}; pass --bandwidth)")
    acc = r["acceptance"]
    ci = acc.get("acceptance_length_interval")
    spread = f"; {stats.interval_words(ci)}" if ci else ""
    lines.append(f"acceptance length {or_dash(acc['acceptance_length'], '.3f')} tokens/step (bonus included{spread}), "
                 f"{acc['verification_steps']} steps")
    lines.append("acceptance by position: " + "  ".join(f"{i}:{v:.2f}" for i, v in
                                                         enumerate(acc["rate_by_position"], 1)))
    if r.get("acceptance_by_group"):
        lines.append("acceptance by category: " + "  ".join(f"{k} {or_dash(v, '.2f')}"
                                                              for k, v in r["acceptance_by_group"].items()))
    lines.append("speed-ups: " + "  ".join(f"{k} " + (f"{v:.2f}x" if v else "-") for k, v in r["speedups"].items()))
    g = r["greedy_check"]
    if g is not None:
        bad = g["mismatches"]
        gaps = sorted(m["top2_logit_gap"] for m in bad if m["top2_logit_gap"] is not None)
        verdict = ("identical tokens" if not bad else
                   f"{len(bad)} mismatch(es); first: {bad[0]['run']} prompt {bad[0]['prompt']} position "
                   f"{bad[0]['position']}" + (f"; top-2 logit gap at the divergence: median "
                                              f"{gaps[len(gaps) // 2]:.2g}, max {gaps[-1]:.2g}" if gaps else ""))
        status = {True: "OK", False: "FAILED", None: "report only (not fp32)"}[g["ok"]]
        lines.append(f"greedy check vs {g['reference']}: {status}: {verdict}")
        parted = len({m["prompt"] for m in bad if m["run"] == "spec"})
        if g["ok"] is None and parted:  # a near-tie rounds another way in a batched verify: another reply
            ref = {"hf": "HF generate's", "base": "the plain decoder's"}.get(g["reference"], g["reference"] + "'s")
            lines.append(f"in {s['dtype']} the speculative text parts from {ref} on {parted} of {len(r['per_prompt'])} "
                         "prompts: the acceptance above is on the text this run wrote, and a run in another dtype "
                         "scores another text (one text for both: benchmarks/precision.py)")
    return "\n".join(lines)


def write_json(result: dict, path) -> None:
    """The result as JSON at `path` (its folder made), written whole or not at all."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    files.write_json(out, result)
