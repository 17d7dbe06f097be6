"""`eaglewire doctor`: the report, the Python entry point `diagnose`, and the command line.

    eaglewire doctor --draft DIR [--target T] [--engine sglang|vllm] [--engine-version V]
                     [--engine-args "ARGS AS ON THE SERVE COMMAND LINE"] [--probe N] [--json]

Exit code 0: no finding of severity error; 1: at least one; 2: usage error.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from .. import interop
from ..errors import EaglewireError, UsageError
from . import engine_args as eargs
from . import probe as probe_mod
from . import static
from .findings import CODES, SEVERITIES, Finding, finding
from .subject import TargetFacts, load_subject, load_target

ENGINES = eargs.ENGINES


@dataclass
class Report:
    findings: list[Finding]
    probe: dict | None = None
    context: dict = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 1 if any(f.severity == "error" for f in self.findings) else 0

    def codes(self, severity: str | None = None) -> list[str]:
        return [f.code for f in self.findings if severity is None or f.severity == severity]

    def get(self, code: str) -> Finding | None:
        return next((f for f in self.findings if f.code == code), None)

    def to_dict(self) -> dict:
        return {"findings": [f.to_dict() for f in self.findings], "probe": self.probe, "context": self.context}


def _version(engine: str | None, given: str | None, subject) -> tuple[str | None, str]:
    if given is not None:
        return given, "given with --engine-version"
    block = subject.provenance or {}
    if engine == "sglang" and block.get("format") == "sglang" and block.get("engine_version"):
        return block["engine_version"], "recorded at export"
    return None, "not stated: the latest rules eaglewire knows"


def _infer_engine(text: str, fallback: str | None) -> str:
    low = text.lower().replace("_", "-")
    if "sglang" in low or "--speculative-algorithm" in low or "--speculative-num-steps" in low:
        return "sglang"
    if "vllm" in low or "--speculative-config" in low:
        return "vllm"
    if fallback:
        return fallback
    raise UsageError("--engine-args: cannot tell which engine they are for; pass --engine sglang|vllm")


def diagnose(draft, *, target=None, engine: str | None = None, engine_version: str | None = None,
             engine_args: str | None = None, source: str | None = None, probe: int = 0, prompts=None,
             probe_steps: int = 3, records: str | None = None) -> Report:
    """Every static check, then (probe > 0, needs target) the measurement. target: a spec or a Target."""
    if engine is not None and engine not in ENGINES:
        raise UsageError(f"--engine {engine!r}: one of {', '.join(ENGINES)}")
    if probe and target is None:
        raise UsageError("--probe runs the target: pass --target")
    if probe < 0 or probe_steps < 1:
        raise UsageError("--probe and --probe-steps must be positive")
    if isinstance(target, TargetFacts):  # a fingerprint only (API): no weights to compare or run
        tf, facts_given = None, target
    else:
        tf, facts_given = (load_target(target) if target is not None else None), None
    if probe and tf is None:
        raise UsageError("--probe runs the target: pass --target (a model, not a fingerprint)")
    s = load_subject(draft, source=source, target=tf or facts_given, engine_version=engine_version, records=records)
    facts = tf or facts_given or TargetFacts(fingerprint={**({"num_layers": s.contract.num_layers} if s.contract else {}),
                                           **s.recorded_target})
    if engine is None and engine_args:
        engine = _infer_engine(engine_args, s.engine)
    engine = engine or s.engine
    version, how = _version(engine, engine_version, s)
    findings: list[Finding] = []
    if s.load_error:
        findings.append(finding("DRAFT_UNREADABLE", "error" if s.draft is None and s.contract is None else "warning",
                                s.load_error, "see the other findings; for a foreign format pass "
                                "--source (and --target for its layer count)"))
    view = None
    if engine is not None and s.kind != "native":
        try:
            view = interop.read_engine_view(s.path, engine, version, model_type=facts.model_type,
                                            num_layers=facts.num_layers)
        except EaglewireError as e:
            findings.append(finding("TAPS_MISSING", "error", f"{engine} cannot read the layer ids: {e}; SGLang's "
                                    "bare except then captures its default taps, vLLM refuses to start",
                                    "write the ids as a list of integers"))
    run = eargs.parse(engine, engine_args, target_arch=facts.architecture, draft_path=str(s.path),
                      draft_config=s.dd.config) if engine_args else None
    ctx = static.Context(subject=s, target=facts, engine=engine, version=version, version_assumed=how, view=view,
                         run=run, engine_args=engine_args)
    findings += static.run_checks(ctx)
    context = _context(ctx, tf)
    record = None
    if probe:
        record = _probe(ctx, tf, s, probe, prompts, probe_steps, findings)
    return Report(findings=findings, probe=record, context=context)


def _probe(ctx, tf, s, n, prompts, steps, findings) -> dict:
    if s.draft is None:
        findings.append(finding("DRAFT_UNREADABLE", "error", "the probe needs the draft's weights, which could not "
                                f"be loaded: {s.load_error}", "fix the findings above first"))
        return {"skipped": "the draft could not be loaded"}
    v = ctx.view
    engine_taps = tuple(v.captured_taps) if v is not None and v.captured_taps else None
    who = static.engine_name(ctx) if engine_taps else "eaglewire (the recorded taps)"
    prompt_list = None
    if prompts:
        from ..prompts import load_conversations

        prompt_list = load_conversations(prompts, need_assistant=False, limit=n).conversations
    new, record = probe_mod.run(tf.loaded, s.draft, engine_taps=engine_taps,
                                trained=s.contract.taps if s.contract else None, n=n, prompts=prompt_list,
                                steps=steps, recorded_metrics=s.metrics, recorded_stats=s.tap_stats,
                                change_for=lambda taps: static.contract_ids_remedy(ctx, taps), who=who)
    if not s.recorded and any(f.code == "PROBE_OK" for f in new):  # measured: the inferred taps are right
        findings[:] = [f if f.code != "TAPS_UNVERIFIED" else finding(
            "TAPS_UNVERIFIED", "info", f.message + "; the probe confirms them", "") for f in findings]
    findings += new
    return record


def _context(ctx, tf) -> dict:
    s, v = ctx.subject, ctx.view
    return {"draft": str(s.path), "kind": s.kind, "taps": list(s.contract.taps) if s.contract else None,
            "num_layers": ctx.num_layers, "taps_from": s.contract_from,
            "target": (tf.spec if tf else None), "target_fingerprint": ctx.target.fingerprint if ctx.target else {},
            "engine": ctx.engine, "engine_version": v.engine_version if v else ctx.version,
            "engine_version_from": ctx.version_assumed if ctx.engine else None,
            "engine_ids": v.ids if v else None, "engine_ids_where": v.ids_where if v else None,
            "engine_taps": v.captured_taps if v else None,
            "engine_run": ctx.run.summary() if ctx.run else None, "notes": s.notes}


# --- rendering ----------------------------------------------------------------------------------------

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
    head = f"probe: {p['prompts']} prompt(s), {p.get('positions', 0)} positions, step-1..{k} accuracy"
    rows = [head, f"  {'wiring':<26}{''.join(f'acc@{i + 1:<4}' for i in range(k))}accept-len  what"]
    for w in p["wirings"]:
        accs = "".join(f"{(a or 0):<8.3f}" for a in w["acc"])
        rows.append(f"  {str(w['taps']):<26}{accs}{w['acceptance_length']:<12.2f}{w['label']}")
    if p.get("recorded_acc"):
        rows.append(f"  recorded at training: step-1 accuracy {p['recorded_acc'][0]:.3f}")
    return "\n".join(rows)


# --- command line ---------------------------------------------------------------------------------------

def cmd_doctor(args) -> int:
    kw = dict(target=args.target, engine=args.engine, engine_version=args.engine_version,
              engine_args=args.engine_args, source=args.source, probe=args.probe or 0, prompts=args.prompts,
              probe_steps=args.probe_steps, records=args.records)
    report = diagnose(args.draft, **kw)
    if args.apply:
        applied = [f for f in report.findings if f.remedy is not None and f.remedy.edits_files]
        for f in applied:
            f.remedy.apply(args.draft)
        if applied:
            print(f"applied {len(applied)} fix(es) to {args.draft}: {', '.join(f.code for f in applied)}; "
                  "examining it again", file=sys.stderr)
            report = diagnose(args.draft, **kw)
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return report.exit_code


def register(sub) -> None:
    codes = ", ".join(CODES)
    p = sub.add_parser("doctor", help="find every known wiring fault of a draft, statically and by measurement",
                       description=f"Checks (codes): {codes}. Exit 0: no error; 1: at least one error; "
                                   "2: usage error.")
    p.add_argument("--draft", required=True, help="draft directory: native checkpoint or any format `import` reads")
    p.add_argument("--source", default=None, choices=list(interop.FORMATS),
                   help="the draft's format, when the files alone do not tell")
    p.add_argument("--target", default=None, help="registry name, HF model directory or .gguf file")
    p.add_argument("--engine", default=None, choices=ENGINES, help="the engine that will serve the draft "
                   "(default: the format's engine)")
    p.add_argument("--engine-version", default=None, help="engine release (SGLang's reading of ids depends on it)")
    p.add_argument("--engine-args", default=None, metavar="ARGS",
                   help="the serve command's arguments as one quoted string; write --engine-args=\"--flag ...\" "
                        "when it is a single flag")
    p.add_argument("--probe", type=int, default=0, metavar="N", help="measure on N prompts (needs --target)")
    p.add_argument("--prompts", default=None, metavar="FILE", help="prompt file for the probe (default: built-in)")
    p.add_argument("--probe-steps", type=int, default=3, metavar="K", help="draft steps measured (default 3)")
    p.add_argument("--records", default=None, metavar="CKPT",
                   help="native checkpoint whose training metrics and tap statistics the probe compares against "
                        "(default: the draft itself when native)")
    p.add_argument("--apply", action="store_true", help="apply the fixes that edit the draft's files, in place, "
                   "then examine it again")
    p.add_argument("--json", action="store_true", help='print {"findings": [...], "probe": {...}}')
    p.set_defaults(func=cmd_doctor)
