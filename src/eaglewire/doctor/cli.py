"""`eaglewire doctor`: the command line and the printed report; the checks themselves are `diagnose` (api.py).

    eaglewire doctor --draft DIR [--target T] [--engine sglang|vllm] [--engine-version V]
                     [--engine-args "ARGS AS ON THE SERVE COMMAND LINE"] [--probe N] [--json]

Exit code 0: no finding of severity error; 1: at least one; 2: usage error.
"""

from __future__ import annotations

import json
import sys

from .. import cli_args, interop
from .api import ENGINES, DoctorRequest, Report, diagnose
from .findings import CODES, SEVERITIES


def render(report: Report) -> str:
    c, lines = report.context, []
    lines.append(f"eaglewire doctor: {c['draft']}")
    taps = f"taps {c['taps']} of {c['num_layers']} layers ({c['taps_from']})" if c["taps"] else c["taps_from"]
    lines.append(f"  draft    {c['kind']}; {taps}")
    fp = c["target_fingerprint"] or {}
    shape = f"{fp.get('model_type', '?')}, {fp.get('num_layers', '?')} layers, hidden {fp.get('hidden_size', '?')}"
    lines.append(f"  target   {c['target'] + ' (' + shape + ')' if c['target'] else 'not given: ' + shape + ' as recorded'}")
    if c["engine"]:
        where = (f"reads {c['engine_ids_where']} = {c['engine_ids']}" if c["engine_ids"] is not None
                 else "reads no layer ids")
        lines.append(f"  engine   {c['engine']} {c['engine_version'] or 'latest'} ({c['engine_version_from']}); {where}"
                     + (f" -> captures taps {c['engine_taps']}" if c["engine_taps"] else ""))
        if c["engine_run"]:
            lines.append(f"  run      {c['engine_run']}")
    else:
        lines.append("  engine   not given: engine-specific checks skipped (pass --engine sglang|vllm)")
    for n in c["notes"]:
        lines.append(f"  note     {n}")
    lines.append("")
    order = {s: i for i, s in enumerate(SEVERITIES)}
    for f in sorted(report.findings, key=lambda f: order[f.severity]):
        lines.append(f"{f.severity.upper():<8}{f.code}: {f.message}")
        if f.fix:
            lines.append(f"{'':<8}fix: {f.fix}")
    if not report.findings:
        lines.append("no findings")
    if report.probe and report.probe.get("wirings"):
        lines += ["", _probe_table(report.probe)]
    n = {s: sum(f.severity == s for f in report.findings) for s in SEVERITIES}
    lines += ["", f"{n['error']} error(s), {n['warning']} warning(s), {n['info']} note(s): exit {report.exit_code}"]
    return "\n".join(lines)


def _probe_table(p: dict) -> str:
    k = p["steps"]
    head = (f"probe: {p['prompts']} prompt(s) ({p.get('prompt_source', '?')}), {p.get('positions', 0)} positions, "
            f"{p.get('rounds', 0)} decoder rounds of a greedy chain of {k}; log-prob: the mean step-1 log-probability "
            f"of the target's token (nats); intervals: {100 * p['level']:.0f}% for all wirings together, paired by "
            "prompt")
    rows = [head, f"  {'wiring':<22}{'acc@1':<8}{'accept-len':<12}{'vs the engine':<26}{'log-prob':<10}"
                  f"{'vs the engine':<26}what"]
    for w in p["wirings"]:
        d = w.get("vs_engine")
        vs = "" if d is None else (f"{d['acceptance_length']:+.2f} [{d['acceptance_length_ci'][0]:+.2f}, "
                                   f"{d['acceptance_length_ci'][1]:+.2f}]")
        ll = "" if w.get("loglik1") is None else f"{w['loglik1']:.3f}"
        vl = "" if not d or "loglik1_ci" not in d else (f"{d['loglik1']:+.3f} [{d['loglik1_ci'][0]:+.3f}, "
                                                        f"{d['loglik1_ci'][1]:+.3f}]")
        rows.append(f"  {str(w['taps']):<22}{(w['acc1'] or 0):<8.3f}{w['acceptance_length']:<12.2f}{vs:<26}"
                    f"{ll:<10}{vl:<26}{w['label']}")
    first = p["wirings"][0]
    rows.append(f"  accepted at draft position 1..{k} with {first['taps']}: "
                + " ".join("-" if a is None else f"{a:.2f}" for a in first["accepted_per_pos"]))
    if p.get("recorded_acc"):
        rows.append(f"  recorded at training: step-1 accuracy {p['recorded_acc'][0]:.3f}")
    rows += [f"  note: {n}" for n in p.get("notes", [])]
    return "\n".join(rows)


# --- command line ---------------------------------------------------------------------------------------

def _request(args) -> DoctorRequest:
    """The command line's flags as the request `diagnose` takes (one flag, one field)."""
    return DoctorRequest(args.draft, target=args.target, engine=args.engine, engine_version=args.engine_version,
                         engine_args=args.engine_args, source=args.source, probe=args.probe or 0,
                         prompts=args.prompts, suite=args.suite, probe_steps=args.probe_steps,
                         probe_tokens=args.probe_tokens, records=args.records, device=args.device, progress=True)


def cmd_doctor(args) -> int:
    request = _request(args)
    report = diagnose(request)
    if args.apply:
        applied = [f for f in report.findings if f.remedy is not None and f.remedy.edits_files]
        for f in applied:
            f.remedy.apply(args.draft)
        if applied:
            print(f"applied {len(applied)} fix(es) to {args.draft}: {', '.join(f.code for f in applied)}; "
                  "examining it again", file=sys.stderr)
            report = diagnose(request)  # the same request: the fixes are in the files
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return report.exit_code


def register(sub) -> None:
    codes = ", ".join(CODES)
    p = sub.add_parser("doctor", help="find every known wiring fault of a draft, statically and by measurement",
                       description=f"Checks (codes): {codes}. Exit 0: no error; 1: at least one error; "
                                   "2: usage error.")
    cli_args.add_draft(p, required=True, help="draft directory: native checkpoint or any format `import` reads")
    p.add_argument("--source", default=None, choices=list(interop.FORMATS),
                   help="the draft's format, when the files alone do not tell")
    cli_args.add_target(p, required=False, default=None, help="registry name, HF model directory or .gguf file")
    p.add_argument("--engine", default=None, choices=ENGINES, help="the engine that will serve the draft "
                   "(default: the format's engine)")
    p.add_argument("--engine-version", default=None, help="engine release (SGLang's reading of ids depends on it)")
    p.add_argument("--engine-args", default=None, metavar="ARGS",
                   help="the serve command's arguments as one quoted string; write --engine-args=\"--flag ...\" "
                        "when it is a single flag")
    p.add_argument("--probe", type=cli_args.positive_int, default=0, metavar="N",
                   help="measure on N distinct prompts (needs --target; 32 take minutes on a CPU, seconds on a GPU; "
                        "default: no probe)")
    cli_args.add_suite(p, default=None, metavar="NAME|FILE", help="the probe's prompts: a bench suite "
                       "(mt-bench, humaneval, gsm8k, arena-hard, alpaca-eval) or a prompt file, continued by the target (default: 76 built-in)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="the probe's conversations with their written replies, measured as they are")
    p.add_argument("--probe-steps", type=cli_args.positive_int, default=7, metavar="K",
                   help="the greedy chain the acceptance length is for (default 7)")
    p.add_argument("--probe-tokens", type=cli_args.int_at_least(2), default=128, metavar="T",
                   help="new tokens the target writes for each prompt (default 128)")
    cli_args.add_device(p, help="where the probe runs the target (default: cuda if available)")
    p.add_argument("--records", default=None, metavar="CKPT",
                   help="native checkpoint whose training metrics and tap statistics the probe compares against "
                        "(default: the draft itself when native)")
    p.add_argument("--apply", action="store_true", help="apply the fixes that edit the draft's files, in place, "
                   "then examine it again")
    p.add_argument("--json", action="store_true", help='print {"findings": [...], "probe": {...}}')
    p.set_defaults(func=cmd_doctor)
