"""The doctor's Python entry point: `diagnose(DoctorRequest(draft, target=..., engine=..., ...)) -> Report`,
every static check then (with a probe) the measurement. The request checks its own arguments when built;
the command line (cli.py) maps its flags to one and prints the report.
"""

from __future__ import annotations

import sys
import time
from dataclasses import KW_ONLY, dataclass, field

from .. import interop
from ..errors import EaglewireError, UsageError
from . import engine_args as eargs
from . import probe as probe_mod
from . import probe_inputs as probe_data
from . import static, taps_checks
from .context import Context, contract_ids_remedy, engine_name
from .findings import Finding, finding
from .subject import TargetFacts, draft_dir, load_subject, load_target

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


@dataclass(frozen=True)
class DoctorRequest:
    """What to examine and how: `diagnose`'s one argument; `eaglewire doctor` maps its flags to it (cli.py).

    `draft`: the directory. `target`: a spec, a loaded targets.Target or (API) a TargetFacts
    fingerprint. `probe`: prompts to measure on (0: static checks only), from `prompts` (written
    replies) or `suite` (the target's own continuations). `records`: the native checkpoint whose
    record an export lacks.
    """

    draft: object
    _: KW_ONLY
    target: object = None
    engine: str | None = None
    engine_version: str | None = None
    engine_args: str | None = None
    source: str | None = None
    probe: int = 0
    prompts: object = None
    suite: str | None = None
    probe_steps: int = 7
    probe_tokens: int = 128
    records: str | None = None
    device: str | None = None
    progress: bool = False

    def __post_init__(self):
        # Usage errors surface when the request is built, before any file or model is read.
        if self.engine is not None and self.engine not in ENGINES:
            raise UsageError(f"--engine {self.engine!r}: one of {', '.join(ENGINES)}")
        if self.probe and self.target is None:
            raise UsageError("--probe runs the target: pass --target")
        if self.probe < 0 or self.probe_steps < 1 or self.probe_tokens < 2:
            raise UsageError("--probe and --probe-steps must be positive, --probe-tokens at least 2")
        if self.prompts and self.suite:
            raise UsageError("--prompts and --suite: pass one (--prompts measures a file's written replies, "
                             "--suite the target's own continuations of a suite's prompts)")
        if self.probe and isinstance(self.target, TargetFacts):  # a fingerprint has no weights to run
            raise UsageError("--probe runs the target: pass --target (a model, not a fingerprint)")


def diagnose(req: DoctorRequest) -> Report:
    """Every static check, then (req.probe > 0, needs a target) the measurement."""
    target, engine = req.target, req.engine
    draft = draft_dir(req.draft)
    if isinstance(target, TargetFacts):  # a fingerprint only (API): no weights to compare or run
        tf, facts_given = None, target
    else:
        tf, facts_given = (load_target(target, req.device) if target is not None else None), None
    s = load_subject(draft, source=req.source, target=tf or facts_given, engine_version=req.engine_version,
                     records=req.records)
    facts = tf or facts_given or TargetFacts(fingerprint={**({"num_layers": s.contract.num_layers} if s.contract else {}),
                                           **s.recorded_target})
    if engine is None and req.engine_args:
        engine = _infer_engine(req.engine_args, s.engine)
    engine = engine or s.engine
    version, how = _version(engine, req.engine_version, s)
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
    run = eargs.parse(engine, req.engine_args, target_arch=facts.architecture, draft_path=str(s.path),
                      draft_config=s.dd.config, engine_version=version) if req.engine_args else None
    ctx = Context(subject=s, target=facts, engine=engine, version=version, version_assumed=how, view=view,
                  run=run, engine_args=req.engine_args)
    findings += static.run_checks(ctx)
    context = _context(ctx, tf)
    record = None
    if req.probe:
        record = _probe(ctx, tf, s, req, findings)
    return Report(findings=findings, probe=record, context=context)


# Static findings about the taps that only a measurement can settle: the probe's verdict replaces them.
SETTLED_BY_PROBE = ("TAPS_UNVERIFIED", "TAPS_MISSING", "TAPS_WRONG_PLACE")


def _probe(ctx, tf, s, req: DoctorRequest, findings) -> dict:
    if s.draft is None:
        findings.append(finding("DRAFT_UNREADABLE", "error", "the probe needs the draft's weights, which could not "
                                f"be loaded: {s.load_error}", "fix the findings above first"))
        return {"skipped": "the draft could not be loaded"}
    v = ctx.view
    engine_taps = tuple(v.captured_taps) if v is not None and v.captured_taps else None
    who = engine_name(ctx) if engine_taps else "eaglewire (the recorded taps)"
    if engine_taps is None and s.contract is None:
        return {"skipped": "neither the taps the engine will capture nor the taps the draft was trained on are "
                           "known: fix the ids first (see the findings above)"}
    t0 = time.perf_counter()
    inputs = probe_data.chosen(tf.loaded, req.probe, req.prompts, req.suite, req.probe_tokens)
    if req.progress:
        print(f"eaglewire doctor: probe: {len(inputs.seqs)} sequence(s) from {inputs.source} in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    new, record = probe_mod.run(tf.loaded, s.draft, engine_taps=engine_taps,
                                trained=s.contract.taps if s.contract else None, recorded=s.recorded,
                                inputs=inputs, steps=req.probe_steps,
                                recorded_metrics=s.metrics, recorded_stats=s.tap_stats,
                                change_for=lambda taps: contract_ids_remedy(ctx, taps), who=who,
                                pin_ids=not s.recorded and v is not None and v.ids is None,
                                stated=_stated(ctx, s), progress=req.progress)
    verdict = next((f for f in new if f.code in ("PROBE_OK", "PROBE_WIRING")), None)
    if not s.recorded and verdict is not None:  # no record: the measurement, not an assumption, decides
        findings[:] = [f if f.code not in SETTLED_BY_PROBE else finding(
            f.code, "info", f"{f.message}; measured: see {verdict.code}", "") for f in findings]
    findings += new
    return record


def _stated(ctx, s) -> tuple:
    """Without a record, the taps the files state other than by what the engine reads, as probe candidates:
    the source convention's reading and ids under keys the engine ignores."""
    if s.recorded:
        return ()
    out = []
    if s.contract is not None and s.contract_from.startswith("inferred"):
        out.append((f"as its {s.kind} convention reads its ids", s.contract.taps))
    v = ctx.view
    for where, ids in (v.ids_ignored.items() if v is not None else ()):
        out += [(f"as {who} reads the ids under {where}", taps) for who, taps in taps_checks.stated_taps(ctx, where, ids)]
    return tuple(out)


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
