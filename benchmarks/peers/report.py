"""The peers' table: what each trainer cost and what its draft accepts, as markdown, JSON and a PNG.

Only numbers the run measured are printed; a stage that did not run leaves its columns as "-".
"""

from __future__ import annotations

from pathlib import Path

from eaglewire.files import atomic_write, write_json

NAMES = {"eaglewire": "eaglewire", "speculators": "speculators 0.9.0", "specforge": "SpecForge 0.2.0"}


def name(trainer: str) -> str:
    return NAMES.get(trainer, trainer)  # eaglewire-NAME: a variant of eaglewire's row


def _f(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def capture_minutes(capture: dict | None, name: str) -> float | None:
    """The shared forward pass plus this trainer's own writing, in minutes."""
    t = _get(capture, "timing")
    if not t or f"{name}_write_s" not in t:
        return None
    return (t["forward_s"] + t["encode_s"] + t[f"{name}_write_s"]) / 60


def rows(meta: dict, r: dict) -> list[dict]:
    out = []
    for name in meta["trainers"]:
        tr = _get(r, "train", name) or {}
        cap = capture_minutes(r.get("capture"), name)
        train_min = tr.get("train_s") / 60 if tr.get("train_s") is not None else None
        row = {"trainer": name, "capture_min": cap, "train_min": train_min,
               "startup_min": tr.get("startup_s") / 60 if tr.get("startup_s") is not None else None,
               "gpu_min_with_capture": (cap or 0) + train_min if train_min is not None else None,
               # what the GPU was held for this draft: its capture, its trainer's start-up and its training
               "gpu_min_all_in": (cap or 0) + train_min + (tr.get("startup_s") or 0) / 60
               if train_min is not None else None,
               "steps": tr.get("steps"), "stopped": tr.get("stopped") or {True: "clock", False: "passes"}.get(
                   tr.get("interrupted")), "tokens_per_s": tr.get("tokens_per_s") or (
                   tr["tokens"] / tr["train_s"] if tr.get("tokens") and tr.get("train_s") else None),
               "settings": tr.get("settings"), "interrupt_lost": tr.get("interrupt_lost"),
               # each trainer's own held-out accuracy by draft step, on its own split (not comparable row to row
               # as acc@1 is): eaglewire's eval fraction, speculators' last 10% of rows
               "own_validation": (_get(tr, "heldout", "acc") or _get(tr, "own_validation", "full_acc")),
               "acc1": _get(r, "eval", "held-out", "rows", name, "acc1"), "suites": {}}
        for s in meta["suites"]:
            ev = _get(r, "eval", s, "rows", name) or {}
            paired = _get(r, "eval", s, "rows", "paired_against", name)
            row["suites"][s] = {
                "eaglewire_decoder": ev.get("acceptance_length"), "by_position": ev.get("accepted_per_pos"),
                "vs_base": paired,
                "vllm": _get(r, "serve", "vllm", name, "suites", s, "acceptance_length"),
                "sglang": _get(r, "serve", "sglang", name, "suites", s, "acceptance_length")}
        sp = _get(r, "speed", "rows") or {}
        row["vllm_tokens_per_s"] = _get(sp, name, "tokens_per_s")
        row["vllm_tokens_per_s_without"] = _get(sp, "none", "tokens_per_s")
        row["served"] = {e: _get(r, "serve", e, name, "how") for e in ("vllm", "sglang")}
        row["doctor"] = _get(r, "doctor", name)
        out.append(row)
    return out


def markdown(meta: dict, table: list[dict], r: dict) -> str:
    rows = [name(x["trainer"]) for x in table]
    title = ", ".join(rows[:-1]) + " and " + rows[-1] if len(rows) > 1 else "".join(rows)
    unit = "minute" if meta["minutes"] == 1 else "minutes"
    lines = [f"# Peers: {title} ({meta['date']}, {meta['device']})", "",
             f"Target {meta['target']}; each trainer alone on the GPU with a budget of {meta['minutes']:g} training {unit}, "
             "each budget from its first step, on the "
             f"same conversations and one capture; chain of {meta['chain']}, greedy, {meta['new_tokens']} new tokens, "
             f"{meta['prompts']} prompts a suite.", "",
             "| trainer | capture min | training min | start-up min | GPU min, all in | steps | stopped by | "
             "training tokens/s | held-out acc@1 |", "|---|---|---|---|---|---|---|---|---|"]
    ended = {"clock": "the clock", "passes": "its last pass"}
    for x in table:
        lines.append(f"| {name(x['trainer'])} | {_f(x['capture_min'])} | {_f(x['train_min'])} | "
                     f"{_f(x['startup_min'])} | {_f(x['gpu_min_all_in'])} | {_f(x['steps'], 'd')} | "
                     f"{ended.get(x['stopped'], '-')} | "
                     f"{_f(x['tokens_per_s'], ',.0f')} | {_f(x['acc1'], '.3f')} |")
    lines += ["", "GPU min, all in: the capture, the trainer's start-up (launch to its first step) and its training. Not "
              "counted: the harness's SpecForge calibration run, and each tool's config generation, save and export."]
    own = [x for x in table if x["own_validation"]]
    if own:
        lines += ["", "Each trainer's own held-out accuracy by draft step, on its own split (eaglewire: 2% of its "
                  "samples; speculators: its last 10% of rows), as it logged it:", ""]
        lines += [f"- {name(x['trainer'])}: " + ", ".join(f"{a:.3f}" for a in x["own_validation"]) for x in own]
    lines += [f"- {name(x['trainer'])}: the budget's interrupt was lost ({x['interrupt_lost']})"
              for x in table if x["interrupt_lost"]]
    lines += ["", "Acceptance length (tokens a verify step, the bonus token included):", ""]
    head = "| trainer | " + " | ".join(f"{s}: eaglewire | {s}: vLLM | {s}: SGLang" for s in meta["suites"]) + " |"
    lines += [head, "|---|" + "---|" * (3 * len(meta["suites"]))]
    for x in table:
        cells = []
        for s in meta["suites"]:
            c = x["suites"][s]
            cells += [_f(c["eaglewire_decoder"], ".3f"), _f(c["vllm"], ".3f"), _f(c["sglang"], ".3f")]
        lines.append(f"| {name(x['trainer'])} | " + " | ".join(cells) + " |")
    base = next((x for x in table if x["trainer"] == "eaglewire"), None)
    if base:
        lines += ["", "eaglewire's decoder, paired over the same prompts and tokens (difference with its "
                  "simultaneous 95% interval):", ""]
        for x in table:
            for s in meta["suites"]:
                d = x["suites"][s]["vs_base"]
                if d and d.get("difference") is not None:
                    lines.append(f"- {s}: {name(x['trainer'])} {d['difference']:+.3f} "
                                 f"({d['interval'][0]:+.3f}..{d['interval'][1]:+.3f}) against eaglewire, "
                                 f"{100 * d['relative']:+.1f}%")
        for s in meta["suites"]:
            ours_v = base["suites"][s]["vllm"]
            for x in table:
                v = x["suites"][s]["vllm"]
                if x is not base and ours_v and v:
                    lines.append(f"- {s} in vLLM (counters over the suite, no interval): {name(x['trainer'])} "
                                 f"{v - ours_v:+.3f} against eaglewire, {100 * (v / ours_v - 1):+.1f}%")
    if any(x["vllm_tokens_per_s"] for x in table):
        none = table[0]["vllm_tokens_per_s_without"]
        lines += ["", f"vLLM at batch 1, CUDA graphs, {meta['suites'][0]} ({_get(r, 'speed', 'prompts')} prompts): "
                  f"{_f(none, ',.0f')} tokens/s without a draft.", "",
                  "| trainer | tokens/s with the draft | speed-up |", "|---|---|---|"]
        for x in table:
            v = x["vllm_tokens_per_s"]
            lines.append(f"| {name(x['trainer'])} | {_f(v, ',.0f')} | "
                         f"{_f(v / none if v and none else None)}x |")
    served = [f"- {name(x['trainer'])}: " + "; ".join(f"{e}: {h}" for e, h in x["served"].items() if h)
              for x in table if any(x["served"].values())]
    if served:
        lines += ["", "What each engine loaded:", ""] + served
    docs = [x for x in table if x["doctor"]]
    if docs:
        lines += ["", "`eaglewire doctor --probe` on each peer's output as written, and on a copy with every id +1, for "
                  "the engine it is made for:", ""]
        for x in docs:
            d = x["doctor"]
            lines.append(f"- {name(x['trainer'])} ({d['engine']}): " + "; ".join(
                f"{v}: ids {r['engine_ids']}, {r['verdict']}, exit {r['exit']}" for v, r in d.items() if v != "engine"))
    return "\n".join(lines) + "\n"


def plot(meta: dict, table: list[dict], out: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1)
    # a reader that measured nothing (an engine not run) gets no empty slot
    cols = [(s, e) for s in meta["suites"] for e in ("eaglewire_decoder", "vllm", "sglang")
            if any(x["suites"][s][e] is not None for x in table)]
    width = 0.8 / max(1, len(table))
    for i, x in enumerate(table):
        vals = [x["suites"][s][e] or 0 for s, e in cols]
        ax.bar([j + i * width for j in range(len(cols))], vals, width=width, label=name(x["trainer"]))
    ax.set_xticks([j + width * (len(table) - 1) / 2 for j in range(len(cols))])
    ax.set_xticklabels([f"{s}\n{e.split('_')[0]}" for s, e in cols], fontsize=7)
    top = max([x["suites"][s][e] or 0 for x in table for s, e in cols] or [1.0])
    ax.set(ylabel="acceptance length", ylim=(0, 1.25 * top),  # headroom: the legend sits above the bars
           title=f"{meta['minutes']:g} training minute{'' if meta['minutes'] == 1 else 's'} each")
    ax.legend(fontsize=7, ncol=len(table), loc="upper left")
    bx = fig.add_subplot(1, 2, 2)
    s = meta["suites"][0]
    for x in table:
        pos = x["suites"][s]["by_position"]
        if pos:
            bx.plot(range(1, len(pos) + 1), pos, marker="o", label=name(x["trainer"]))
    bx.set(xlabel="draft position", ylabel="accepted (share of rounds)", ylim=(0, 1),
           title=f"{s}: eaglewire's decoder, by position")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    return out


def write(root: Path, meta: dict, results: dict) -> dict:
    table = rows(meta, results)
    text = markdown(meta, table, results)
    atomic_write(root / "report.md", text)
    write_json(root / "report.json", {"meta": meta, "table": table, "stages": results})
    plot(meta, table, root / "report.png")
    print(text)
    return {"table": table}
