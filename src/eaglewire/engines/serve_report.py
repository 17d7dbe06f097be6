"""`eaglewire serve-check`'s report: the result (serve_check.result) as a text table, and as a PNG of acceptance by
draft position and of each wiring's acceptance length."""

from __future__ import annotations

from pathlib import Path


def render(r: dict) -> str:
    E = r.get("engine_label") or r["engine"]
    seen = r["engine_aux_layers"]
    lines = _header(r, E, seen) + _counts(r, E) + _verdicts(r, E, seen)
    if r["wirings"]:
        lines += _wirings(r, E, seen)
    lines += ["", "ok" if r["ok"] else "NOT OK: see above"]
    return "\n".join(lines)


def _f(x, fmt=".2f") -> str:
    """A number in a table cell, or - for None."""
    return "-" if x is None else format(x, fmt)


def _header(r: dict, E: str, seen: dict | None) -> list[str]:
    """The run's suite, target, engine and settings, and the taps the draft and the engine name."""
    return [f"eaglewire serve-check  {r['suite']['name']} ({r['suite']['prompts']} prompts)  target {r['target']}  "
            f"{E} {r['engine_version']}  greedy, batch 1, chain of {r['settings']['chain']}",
            f"  draft {r['draft']['how']}: taps {r['draft']['taps']}; {E} "
            + (f"captured taps {seen['taps']} (its {seen['from']})" if seen else
               "said nothing of the taps it captured" + (" (its forward hook fires on eager forwards only)"
                                                         if r["engine"] == "sglang" else " (no log line found)")),
            ""]


def _counts(r: dict, E: str) -> list[str]:
    """The table of eaglewire's and the engine's acceptance and speed, side by side."""
    o, v = r["ours"], r[r["engine"]]
    lines = [f"  {'':<28}{'eaglewire':>12}{E:>12}",
             f"  {'acceptance length':<28}{_f(o['acceptance_length']):>12}{_f(v['acceptance_length']):>12}",
             f"  {'verification steps':<28}{o['drafts']:>12}{v['drafts']:>12}"]
    for i, (x, y) in enumerate(zip(o["rate_by_position"], v["rate_by_position"])):
        lines.append(f"  {f'accepted at position {i + 1}':<28}{x:>12.3f}{y:>12.3f}")
    eager = " (eager)" if r["settings"].get("engine_cuda_graphs") is False else ""
    lines += [f"  {'tokens/s with the draft' + eager:<28}{_f(o['tokens_per_s'], '.1f'):>12}"
              f"{_f(v['tokens_per_s'], '.1f'):>12}",
              f"  {'tokens/s without' + eager:<28}{_f(o['tokens_per_s_without'], '.1f'):>12}"
              f"{_f(v['tokens_per_s_without'], '.1f'):>12}", ""]
    if eager:  # an engine without CUDA graphs is bound by launches: its tokens/s are not what it serves at
        lines[-1:-1] = [f"  {'':<28}--eager: no CUDA graphs, eaglewire uncompiled; not the served speed"]
    return lines


def _verdicts(r: dict, E: str, seen: dict | None) -> list[str]:
    """The agreement on acceptance, the greedy identity, and what the engine and the doctor resolved."""
    v, a, g = r[r["engine"]], r["agreement"], r["greedy"]
    lines = []
    if v.get("reported_accept_length") is not None:
        lines.append(f"SGLang's own spec_accept_length: {v['reported_accept_length']:.2f} (completion tokens / verify "
                     "steps: it counts the token the prefill wrote too)")
    lines.append(f"acceptance length, each on its own text: eaglewire {_diff(a, E)}"
                 + ("" if a["agree"] else " (reported; the verdict is on one text, below)"))
    st = r["same_text"]
    lines.append(f"acceptance length on {E}'s text: eaglewire's draft replayed there "
                 f"{_f(st['acceptance_length'], '.3f')}, {_diff(st, E)}"
                 + ("; the gap above is in the texts each side wrote" if st["agree"] and not a["agree"] else ""))
    bad = "MISMATCH" if g["must_match"] else "differ"
    lines.append(f"{E}'s greedy tokens with and without the draft: {g['identical']} of {g['prompts']} prompts "
                 f"identical" + (f", {len(g['near_ties'])} diverge at a near-tie" if g["near_ties"] else "")
                 + (f", {len(g['mismatches'])} {bad} (first: prompt {g['mismatches'][0]['prompt']} position "
                    f"{g['mismatches'][0]['position']})" if g["mismatches"] else "")
                 + ("" if g["must_match"] else " (counted, not held to identity for this engine)"))
    if seen and seen["taps"] != r["draft"]["taps"]:
        lines.append(f"{E} captured taps {seen['taps']}, not {r['draft']['taps']}: run `eaglewire doctor`")
    sp, ask = r.get("speculation"), r.get("engine_args")
    if sp:
        lines.append(f"{E} resolved: steps {sp['num_steps']}, topk {sp['eagle_topk']}, draft tokens "
                     f"{sp['num_draft_tokens']}; its counters: {sp['verify_steps']} verify steps, "
                     f"{_f(sp['proposed_per_step'])} draft tokens proposed a step")
    dr = r["draft"].get("doctor")
    if dr:
        lines.append(f"`eaglewire doctor` on what was served, before serving: exit {dr['exit']}"
                     + (f" ({', '.join(dr['findings'])})" if dr["findings"] else ", nothing above info"))
    if ask:
        d = ask["doctor"]
        lines.append(f"--engine-args {ask['text']!r}: `eaglewire doctor` predicts steps {d['num_steps']}, topk "
                     f"{d['eagle_topk']}, draft tokens {d['num_draft_tokens']}: "
                     + ("as SGLang resolved" if ask["doctor_agrees"] else "NOT what SGLang resolved"))
        lines += [f"  doctor: {x}" for x in d["overrides"]]
    return lines


def _diff(a: dict, E: str) -> str:
    """An agreement (serve_check.agreement) in words."""
    return (f"{a['difference']:+.3f} against {E} ({100 * a['relative']:+.1f}%, interval {a['interval'][0]:+.3f}.."
            f"{a['interval'][1]:+.3f} paired over prompts): " + ("within" if a["agree"] else "BEYOND")
            + f" the tolerance of {100 * a['tolerance']:.0f}%")


def _wirings(r: dict, E: str, seen: dict | None) -> list[str]:
    """The table of the engine's acceptance with the draft's ids and with each other wiring tried."""
    v = r[r["engine"]]
    lines = ["", "the engine's acceptance with other ids (what `eaglewire doctor --probe` estimates; the difference "
             "with its simultaneous 95% interval, paired over prompts):",
             f"  {E + ' ids':<16}{'captures':<16}{'seen':<16}{'accept-len':>10}  {'difference':<26}"
             f"{'doctor before serving':<28}what"]
    saw = seen["taps"] if seen else "-"
    lines.append(f"  {str(r['draft'].get('ids') or '-'):<16}{str(r['draft']['taps']):<16}{str(saw):<16}"
                 f"{_f(v['acceptance_length']):>10}  {'':<26}{said(r['draft'].get('doctor')):<28}the draft's ids")
    for w in r["wirings"]:
        dd = w["vs_draft_ids"]
        diff = f"{dd['difference']:+.2f} ({dd['interval'][0]:+.2f}..{dd['interval'][1]:+.2f})" if dd else "-"
        saw = w["captured"]["taps"] if w.get("captured") else "-"
        lines.append(f"  {str(w['ids'] if w['ids'] is not None else 'not read'):<16}"
                     f"{str(w['taps'] if w['taps'] is not None else '-'):<16}{str(saw):<16}"
                     f"{_f(w['acceptance_length']):>10}  {diff:<26}{said(w.get('doctor')):<28}{w['label']}")
        if w.get("failed"):
            lines.append(f"    {E} failed to serve these ids: {w['failed']}")
    return lines


def said(doctor: dict | None) -> str:
    """The doctor's verdict in a table cell: its worst findings' codes, or clean."""
    if not doctor:
        return "-"
    worst = [c for c in doctor["findings"] if c.startswith("error:")] or doctor["findings"]
    return ", ".join(c.replace(":", " ", 1) for c in worst) or "clean"


def wiring_bars(r: dict) -> list[tuple[str, float | None]]:
    """The wirings' bars: each named by what the engine was given and what it read, or that it failed."""
    E = r.get("engine_label") or r["engine"]

    def read(w):
        return (f"{E} failed" if w.get("failed") else f"taps {w['taps']}" if w["taps"] is not None
                else "not a tap")
    return [(f"the draft's ids: taps {r['draft']['taps']}", r[r["engine"]]["acceptance_length"])] + \
        [(f"{w['label'].split(':')[0].split(' (')[0]}: {read(w)}", w["acceptance_length"]) for w in r["wirings"]]


def plot(r: dict, out) -> Path:
    """PNG: acceptance by draft position, eaglewire against the engine, and the wirings' acceptance lengths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    E = r.get("engine_label") or r["engine"]
    st = r.get("same_text")  # absent from results written before the replay
    series = [(r["ours"], "#4477aa", "eaglewire")] + ([(st, "#66ccee", f"eaglewire on {E}'s text")] if st else []) \
        + [(r[r["engine"]], "#ee6677", E)]
    x = list(range(1, len(r["ours"]["rate_by_position"]) + 1))
    fig = Figure(figsize=(10.5 if r["wirings"] else 6, 3.6), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1) if r["wirings"] else fig.add_subplot()
    w = 0.8 / len(series)
    for k, (s, color, name) in enumerate(series):
        ax.bar([i + (k - (len(series) - 1) / 2) * w for i in x], s["rate_by_position"], width=w, color=color,
               label=f"{name} ({s['acceptance_length'] or 0:.2f})")
    ax.set(xlabel="draft position", ylabel="accepted (share of steps)", ylim=(0, 1.05), xticks=x,
           title=f"{r['suite']['name']}: acceptance by position")
    ax.legend(fontsize=8)
    if r["wirings"]:
        bx = fig.add_subplot(1, 2, 2)
        rows = wiring_bars(r)
        bx.barh([a for a, _ in rows][::-1], [b or 0 for _, b in rows][::-1], color="#228833")
        bx.set(xlabel=f"{E} acceptance length", title="other ids, by the taps read")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
