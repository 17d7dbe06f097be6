"""`eaglewire serve-check`: the draft served by the real engine, beside eaglewire's own decoder.

    eaglewire serve-check --draft DIR --target T [--engine vllm|sglang] [--suite mt-bench|humaneval|gsm8k|arena-hard|
        alpaca-eval|FILE] [--max-prompts N] [--max-new-tokens M] [--chain K] [--wirings [KEY,...]] [--json OUT]
        [--plot OUT.png]
        [--engine-args "SGLANG'S --speculative-* FLAGS"] [--sglang-python PY] [--sglang-path DIR]

The incident eaglewire exists for was lost between training and the serving engine, so the engine's own
counters are the ground truth here: the same prompts, greedy, batch 1, through
 (a) the engine without the draft, (b) the engine with it (a native draft is exported to the engine's format
     first; an export is served as it is), (c) eaglewire's decoder without and with it.
Then acceptance length, acceptance by position and tokens/s are set side by side, and the engine's greedy
tokens with and without the draft are compared token for token. `--wirings` serves the draft again with the
tap ids of the doctor's main alternative wirings, in the engine's words: the engine's acceptance for each is
the ground truth that `eaglewire doctor --probe` estimates. `--wirings minus1,missing` serves only those: each
wiring restarts the engine.

This module is engine-neutral: what it needs of an engine (its jobs, its counters per prompt, where it reads
tap ids, its wirings, what it says it captured) is that engine's `Serving` class, beside its boundary
(engines/vllm.py, engines/sglang.py). `--engine-args` (SGLang) serves the draft with SGLang's own
--speculative-num-steps / -eagle-topk / -num-draft-tokens and reports what SGLang resolved them to beside what
`eaglewire doctor --engine-args` predicts (the seed incident's 16 draft tokens that ran as 2).

Each side writes its own greedy text, and in bf16 a flipped near-tie sends them apart, so acceptance is also
counted on one text: our draft replayed on the engine's (fed our capture of the trained taps). Exit 1 when the
engine's acceptance and that replay differ by more than TOLERANCE; with vLLM also when its greedy tokens differ
with and without the draft other than at a near-tie (with SGLang they are counted, not held to it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import checkpoint, cli_args, interop, targets
from ..errors import EaglewireError, UsageError
from ..files import write_json
from ..interop.common import PROVENANCE_KEY
from ..interop.serve import SpecArgs
from ..data.suites import SUITES
from . import sglang, vllm
from .serve_report import plot, render  # the command's report (and the tests' reader of it)

# Both run the same draft on the same prompts greedily, but in bf16 their kernels round differently: once a
# near-tie flips, the two continue different texts, which moves acceptance length by a few percent on 20 MT-bench
# prompts, more on a target full of near-ties. The verdict is therefore taken on the engine's own text (replayed),
# where only the draft's inputs differ. A precision loss (a 7% gap was one) or a wiring fault (10% for a one-layer
# shift on SmolLM2) is larger: 5% of acceptance length tells them apart.
TOLERANCE = 0.05
# A greedy token whose two most likely candidates lie closer than this (nats) is a near-tie: another kernel's
# rounding can pick the other one, so a divergence there is reported, not failed.
TIE = 0.1


ENGINES = ("vllm", "sglang")
SGLANG_SPEC_FLAGS = {"speculative-num-steps": "num_steps", "speculative-eagle-topk": "eagle_topk",
                     "speculative-num-draft-tokens": "num_draft_tokens"}
# the wirings an engine may offer for a draft (its Serving.wirings' keys); ALL: each one it offers
WIRINGS = ("plus1", "minus1", "embedding", "missing")
ALL = "all"


def wiring_keys(text: str):
    """--wirings' value: ALL, or keys of WIRINGS separated by commas."""
    if text == ALL:
        return ALL
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in keys if k not in WIRINGS]
    if bad or not keys:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be {ALL} or wirings among "
                                         f"{', '.join(WIRINGS)}, comma-separated")
    return keys


def serving(name: str, *, memory: float | None = None, sglang_python: str | None = None,
            sglang_path: str | None = None, spec: dict | None = None):
    """The engine's serve-check class: vllm.Serving or sglang.Serving. `memory`: the share of the GPU's memory
    (vLLM's gpu_memory_utilization, SGLang's mem_fraction_static); `spec`: SGLang's speculative arguments."""
    if name == "vllm":
        if sglang_python or sglang_path or spec:
            raise UsageError("--engine-args, --sglang-python and --sglang-path are for --engine sglang")
        return vllm.Serving(memory)
    if name == "sglang":
        return sglang.Serving(memory, sglang.locate(sglang_python, sglang_path), spec)
    raise UsageError(f"--engine {name!r}: one of {', '.join(ENGINES)}")


@dataclass(frozen=True)
class Prepared:
    engine_dir: Path  # what the engine loads
    native: Path  # what eaglewire's decoder loads
    taps: tuple[int, ...]  # what the engine captures for it
    num_layers: int
    how: str
    model_type: str | None = None
    ids: list[int] | None = None  # the ids written where the engine reads them
    fingerprint: dict | None = None  # the target's, for the doctor


def prepare_draft(draft, target_spec: str, work: Path, chain: int, engine=None) -> Prepared:
    """A native checkpoint exported to the engine's format (vLLM's unless `engine`, a Serving, says otherwise) in
    `work`; an engine export served as it is and imported for our decoder."""
    engine = engine or vllm.Serving()
    d = Path(draft)
    if not (d / "config.json").is_file():
        raise UsageError(f"--draft {d}: no config.json (a native checkpoint or a {engine.label}-format export)")
    info = interop.load_target_info(target_spec)
    N = info.num_layers
    model_type = getattr(targets.config_of(target_spec), "model_type", None)
    if json.loads((d / "config.json").read_text()).get("format") == checkpoint.FORMAT:
        out = work / engine.name
        interop.export_draft(d, engine.name, out, engine_version=engine.export_version, spec=SpecArgs(num_steps=chain))
        engine_dir, native, how = out, d, f"exported to {engine.label}'s format"
    else:
        native, _ = interop.import_draft(d, work / "native", target=info)
        engine_dir, how = d, "served as it is"
    view = interop.read_engine_view(engine_dir, engine.name, engine.export_version, model_type=model_type,
                                    num_layers=N)
    if not view.recognised or view.captured_taps is None:
        raise UsageError(f"--draft {d}: {engine.label} cannot serve it as written "
                         f"({'; '.join(view.problems) or 'no taps'}): run `eaglewire doctor --draft {d} "
                         f"--engine {engine.name}`")
    return Prepared(engine_dir, Path(native), tuple(view.captured_taps), N, how, model_type, view.ids,
                    dict(info.fingerprint))


def served_copy(engine_dir: Path, edit, out: Path, keep_record: bool = False) -> Path:
    """A copy of an engine directory whose config.json `edit` (a function of the config dict) changed; weights
    linked. The export record is dropped unless `keep_record`: kept, it contradicts the edit as a hand edit of an
    export would, which is what the doctor is asked to name."""
    out.mkdir(parents=True)
    for f in engine_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((engine_dir / "config.json").read_text())
    edit(cfg)
    if not keep_record:
        cfg.pop(PROVENANCE_KEY, None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def with_ids(engine_dir: Path, ids, out: Path) -> Path:
    """A copy of a vLLM-format directory whose top-level ids are `ids` (vLLM's words); weights linked."""
    from ..interop.common import IDS_KEY

    return served_copy(engine_dir, lambda cfg: cfg.__setitem__(IDS_KEY, [int(i) for i in ids]), out)


def speculative_args(engine_name: str, text: str | None, target: str) -> tuple[dict | None, object]:
    """`--engine-args` for SGLang: (the speculative arguments as asked, the doctor's resolution of them: an
    engine_args.EngineRun). Only SGLang's three --speculative-* shape flags are passed on; a combination SGLang
    refuses, or a tree, is a usage error (serve-check compares chains)."""
    if not text:
        return None, None
    if engine_name != "sglang":
        raise UsageError("--engine-args: serve-check passes SGLang's --speculative-* flags; vLLM drafts --chain K")
    from ..doctor import engine_args as ea

    arch = (getattr(targets.config_of(target), "architectures", None) or [None])[0]
    run = ea.parse("sglang", "--speculative-algorithm EAGLE3 " + text, target_arch=arch)
    extra = sorted(k for k in run.given if k not in SGLANG_SPEC_FLAGS and k != "speculative-algorithm"
                   and not k.startswith("__"))
    if extra or run.given.get("__positional__") or run.algorithm != ea.SGLANG_EAGLE3:
        flags = ", ".join("--" + k for k in SGLANG_SPEC_FLAGS)
        raise UsageError(f"--engine-args {text!r}: serve-check passes only {flags} to SGLang (EAGLE3)")
    if run.refusals:
        raise UsageError(f"--engine-args {text!r}: SGLang would refuse to start: {run.refusals[0].why}")
    if run.topk != 1:
        raise UsageError(f"--engine-args {text!r}: SGLang would draft a tree (topk {run.topk}); serve-check compares "
                         "chains: pass --speculative-eagle-topk 1")
    spec = {field: int(run.given[flag]) for flag, field in SGLANG_SPEC_FLAGS.items() if run.given.get(flag)}
    return spec, run


# --- figures (pure) -----------------------------------------------------------------------------------

def counts(per_prompt: list[dict], K: int) -> dict:
    """Acceptance over prompts from per-prompt counters {drafts, accepted, accepted_per_pos}."""
    drafts = sum(p["drafts"] for p in per_prompt)
    accepted = sum(p["accepted"] for p in per_prompt)
    pos = [sum((p["accepted_per_pos"] + [0] * K)[i] for p in per_prompt) for i in range(K)]
    return {"acceptance_length": 1 + accepted / drafts if drafts else None, "drafts": drafts, "accepted": accepted,
            "rate_by_position": [a / drafts if drafts else 0.0 for a in pos]}


def _fmt(x: float | None) -> str:
    return "none" if x is None else f"{x:.3f}"


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


def greedy_identity(plain: list[dict], spec: list[dict], must_match: bool = True) -> dict:
    """The engine's greedy tokens without and with the draft, prompt by prompt. A divergence at a near-tie
    (top-2 gap < TIE in the run without the draft) is reported. Any other fails the check when `must_match`
    (the engine's Serving.greedy_must_match), and is counted either way."""
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
            "mismatches": faults, "must_match": must_match, "ok": not faults or not must_match}


def engine_rows(result: dict) -> list[dict]:
    """Per-prompt counters of a vLLM job (benchmarks/capture_engines.py); other engines: their Serving.rows."""
    return vllm.Serving.rows(result, 0)


# --- the runs -----------------------------------------------------------------------------------------

def ours(target, native: Path, suite: str, max_prompts, max_new_tokens: int, chain: int, device, log,
         compile: bool = True) -> dict:
    """eaglewire's decoder without and with the draft on the suite, batch 1, bench's settings: per prompt the
    same counters the engine reports, and the prompts' token ids (what the engine is given too). `compile`
    False skips torch.compile's warm-up (minutes on CUDA); the acceptance is read either way."""
    from ..bench import run as bench

    ups = None if compile else bench.speedups_from(bench.pick_device(device), compile=False)
    cfg = bench.BenchConfig(suite=suite, max_prompts=max_prompts, max_new_tokens=max_new_tokens,
                            shape=bench.shape_from(device, chain=chain), hf=False, device=device, speedups=ups)
    dev, dtype, sp, t, draft, meta, prompts, eos = bench.prepare(target, str(native), cfg)
    runs = {k: bench.decoder_runner(t, draft, meta, cfg, dev, eos, speculate=k == "spec") for k in ("base", "spec")}
    gens = bench.run_prompts({k: (f"eaglewire {k}", r[1]) for k, r in runs.items()}, prompts, cfg, dev, log)
    rows = {k: [{"tokens": len(g.tokens), "seconds": g.wall_s, "drafts": len(g.accepted or []),
                 "accepted": sum(g.accepted or []),
                 "accepted_per_pos": [sum(a > i for a in (g.accepted or [])) for i in range(chain)]}
                for g in gens[k]] for k in gens}
    return {"suite": sp, "conversations": sp.conversations, "dtype": str(dtype).removeprefix("torch."),
            "prompt_tokens": [int(p.shape[1]) for p in prompts], "input_ids": [p[0].tolist() for p in prompts],
            "base": rows["base"], "spec": rows["spec"], "names": {k: r[0] for k, r in runs.items()}}


def replayed(target: str, native: Path, input_ids: list[list[int]], texts: list[list[int]], chain: int,
             device) -> list[dict]:
    """eaglewire's draft replayed on the engine's own greedy text (doctor/chain.py): per prompt the counters the
    engine reports, had it fed our draft our capture of the trained taps. Each side writes its own text, and a
    near-tie flipped in bf16 sends them apart; on one text, what is left is what the draft was fed.

    A prompt's last round runs on past the text's end, into our target's greedy continuation: both engines count
    the drafts it accepts there before they trim the text at its stop (vLLM 0.26.0 v1/core/sched/scheduler.py:1687
    before :1724; SGLang 0.5.17 managers/scheduler_components/batch_result_processor.py:685-689 before :859-864)."""
    import torch

    from ..bench.run import pick_device
    from ..checkpoint import load_draft
    from ..doctor import chain as walked
    from ..doctor.probe_inputs import capture_states, continuation

    dev = pick_device(device)
    t = targets.load_target(target, dtype=targets.dtype_of(None, dev), device=dev)
    draft, meta = load_draft(native, device=dev)
    rows = []
    for prompt, new in zip(input_ids, texts):
        text = torch.tensor(list(prompt) + list(new))
        ids = torch.cat([text, torch.tensor(continuation(t.model, text, chain), dtype=text.dtype)])
        pos = torch.arange(ids.numel())
        reach = pos >= len(prompt)  # rounds start in the engine's text and may run past its end
        st = capture_states(t.model, ids)
        # the engine's greedy text is its target's choice at every position: a draft token counts when it is that
        top = torch.cat([ids[1:], ids.new_full((1,), -1)])
        tl = walked.tally(draft, torch.cat([st[k] for k in meta.contract.taps], -1), ids, reach & (pos < len(text)),
                          top, chain, reach)
        rows.append({"drafts": tl.walk_rounds, "accepted": tl.walk_tokens - tl.walk_rounds,
                     "accepted_per_pos": tl.walk_accepted.tolist()})
    del t, draft
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the engine serves the wirings next, in the memory it finds free
    return rows


def serve_check(draft, target: str, *, engine_name: str = "vllm", suite: str = "mt-bench", max_prompts=20,
                max_new_tokens: int = 256, chain: int | None = None, wirings=(), device=None,
                gpu_memory_utilization: float | None = None, engine_args: str | None = None,
                sglang_python: str | None = None, sglang_path: str | None = None, eager: bool = False, log=None,
                work=None, progress=None) -> dict:
    """Run the whole check; -> the JSON-ready result (its "ok" says whether the command exits 0). `chain`: draft
    tokens a step (default 7; with SGLang `engine_args`, the steps they resolve to). `eager`: no CUDA graphs in
    the engine's timed runs either (the wirings always run eager), and eaglewire's decoder uncompiled. `wirings`:
    the keys of the engine's wirings to serve as well (WIRINGS), ALL for each it has, () for none. `progress`: called
    with the result so far once the draft is served and after each wiring, so that a machine lost mid-run leaves
    what it measured."""
    spec, asked, chain = _chain_of(engine_name, engine_args, target, chain)
    eng = serving(engine_name, memory=gpu_memory_utilization, sglang_python=sglang_python, sglang_path=sglang_path,
                  spec=spec)
    found = eng.require()
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    if eng.name == "sglang" and found != sglang.VERSION:
        log(f"eaglewire serve-check: SGLang {found} here; eaglewire's SGLang rules were read from {sglang.VERSION}")
    path = targets.resolve(target)
    if path.suffix == ".gguf":
        raise UsageError(f"--target {target}: {eng.label} serves Hugging Face model directories; `eaglewire prepare` "
                         "writes one for a registry target, or pass a model directory")
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="eaglewire-serve-check-")) if own else Path(work)
    try:
        p = prepare_draft(draft, target, work, chain, eng)
        log(f"eaglewire serve-check: the draft {p.how}; {eng.label} will capture taps {list(p.taps)}")
        chosen = choose_wirings(eng, p, wirings)  # before anything is served: a key it lacks is the user's to fix
        mine = ours(target, p.native, suite, max_prompts, max_new_tokens, chain, device, log, compile=not eager)
        job = dict(conversations=mine["conversations"], input_ids=mine["input_ids"], max_new_tokens=max_new_tokens,
                   chain=chain)
        log(f"eaglewire serve-check: {eng.label} without the draft")
        plain = eng.run(str(path), gaps=True, eager=eager, **job)
        log(f"eaglewire serve-check: {eng.label} with the draft")
        spec_r = eng.run(str(path), draft=str(p.engine_dir), eager=eager, **job)
        log(f"eaglewire serve-check: {eng.label} with the draft: acceptance length "
            f"{_fmt(counts(eng.rows(spec_r, chain), chain)['acceptance_length'])}, eaglewire's "
            f"{_fmt(counts(mine['spec'], chain)['acceptance_length'])}")
        log(f"eaglewire serve-check: eaglewire's draft replayed on {eng.label}'s text")
        mine["replay"] = replayed(str(path), p.native, mine["input_ids"], eng.tokens(spec_r), chain, device)
        # the flags as served: serve-check adds the algorithm
        said = doctor_says(p.engine_dir, eng, p, engine_args and "--speculative-algorithm EAGLE3 " + engine_args)

        def report(alts: list) -> dict:
            r = result(eng, p, mine, plain, spec_r, alts, chain, max_new_tokens, target,
                       _asked(asked, eng.speculation(spec_r), engine_args) if asked is not None else None)
            r["draft"]["doctor"] = said
            r["settings"].update(engine_cuda_graphs=not eager, eaglewire_compiled=not eager)
            r["wirings_pending"] = [w["key"] for w in chosen[len(alts):]]  # a run cut short says what it lacks
            return r

        def landed(alts: list) -> None:
            if progress:
                progress(report(alts))

        landed([])
        return report(serve_wirings(eng, chosen, p, path, job, work, chain, log, landed))
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def _chain_of(engine_name: str, engine_args: str | None, target: str, chain: int | None) -> tuple:
    """(SGLang's speculative arguments, the doctor's resolution of them, the chain): --chain, or the steps
    --engine-args resolve to, or 7."""
    spec, asked = speculative_args(engine_name, engine_args, target)
    if asked is not None:
        if chain is not None and chain != asked.num_steps:
            raise UsageError(f"--chain {chain} and --engine-args (SGLang drafts {asked.num_steps} a step): give one")
        chain = asked.num_steps
    return spec, asked, 7 if chain is None else chain


def choose_wirings(eng, p: Prepared, wanted) -> list[dict]:
    """The engine's wirings for this draft whose keys are `wanted` (ALL: each of them), in the engine's order."""
    offered = eng.wirings(p.taps, p.num_layers, p.model_type)
    if wanted == ALL:
        return offered
    lacking = [k for k in wanted if k not in {w["key"] for w in offered}]
    if lacking:
        raise UsageError(f"--wirings {','.join(lacking)}: {eng.label} has no such wiring for this draft (taps "
                         f"{list(p.taps)} of {p.num_layers} layers); it has {','.join(w['key'] for w in offered)}")
    return [w for w in offered if w["key"] in wanted]


def serve_wirings(eng, wirings: list[dict], p: Prepared, path: Path, job: dict, work: Path, chain: int,
                  log, landed=lambda alts: None) -> list[dict]:
    """The engine served each of `wirings` (other tap ids), eager; the doctor's word on each before it is served.
    `landed(rows so far)` after each."""
    alts = []
    for k, w in enumerate(wirings):
        # The doctor examines the edit as a hand edit of the export leaves it (its record contradicting the
        # ids); the engine, which ignores that record, is served the same edit without it.
        edit = w.pop("edit")
        said = doctor_says(served_copy(p.engine_dir, edit, work / f"wiring-{k}-edited", keep_record=True), eng, p)
        d = served_copy(p.engine_dir, edit, work / f"wiring-{k}")
        log(f"eaglewire serve-check: {eng.label} with the draft given ids {w['ids']} ({w['label']}); the doctor: "
            f"{', '.join(said['findings']) or 'nothing'}")
        try:
            r = eng.run(str(path), draft=str(d), eager=True, **job)
        except EaglewireError as e:  # a wiring the engine cannot serve (vLLM's id 0 on DeepSeek): that is the finding
            alts.append({**w, "doctor": said, "captured": None, "per_prompt": None, "failed": str(e),
                         **counts([], chain)})
            log(f"eaglewire serve-check: {eng.label} given ids {w['ids']}: the engine failed: {e}")
            landed(alts)
            continue
        rows = eng.rows(r, chain)
        alts.append({**w, "doctor": said, "captured": eng.captured(r), "per_prompt": rows, **counts(rows, chain)})
        log(f"eaglewire serve-check: {eng.label} given ids {w['ids']}: acceptance length "
            f"{_fmt(alts[-1]['acceptance_length'])}")  # logged as it lands: a run cut short keeps it
        landed(alts)
    return alts


def doctor_says(d: Path, eng, p: Prepared, engine_args: str | None = None) -> dict:
    """`eaglewire doctor`'s static verdict on a directory the engine is about to serve: its exit code and the
    findings above info."""
    from ..doctor.api import DoctorRequest, diagnose
    from ..doctor.subject import TargetFacts

    r = diagnose(DoctorRequest(d, target=TargetFacts(fingerprint=p.fingerprint or {"num_layers": p.num_layers}),
                               engine=eng.name, engine_version=eng.export_version, engine_args=engine_args))
    return {"exit": r.exit_code, "findings": [f"{f.severity}:{f.code}" for f in r.findings if f.severity != "info"]}


def _asked(run, resolved: dict | None, text: str) -> dict:
    """--engine-args: what was asked, what `eaglewire doctor` predicts SGLang runs, what SGLang resolved."""
    predicted = {"num_steps": run.num_steps, "eagle_topk": run.topk, "num_draft_tokens": run.num_draft_tokens}
    got = {k: (resolved or {}).get(k) for k in predicted}
    return {"text": text, "requested": {f: run.given.get(flag) for flag, f in SGLANG_SPEC_FLAGS.items()},
            "doctor": {**predicted, "overrides": [f"{o.setting}: {o.why}" for o in run.overrides]},
            "doctor_agrees": predicted == got}


def result(eng, p: Prepared, mine: dict, plain: dict, spec: dict, alts: list, chain: int, max_new_tokens: int,
           target, asked: dict | None = None) -> dict:
    e_plain, e_spec = eng.rows(plain, chain), eng.rows(spec, chain)
    agree = agreement(mine["spec"], e_spec)
    same_text = {**counts(mine["replay"], chain), **agreement(mine["replay"], e_spec)}
    served = [a for a in alts if a["per_prompt"] is not None]
    for alt in alts:
        alt["vs_draft_ids"] = None
    for alt, d in zip(served, against(e_spec, [a["per_prompt"] for a in served])):
        alt["vs_draft_ids"] = d  # paired over the same prompts (each wiring's own greedy text)
    same = greedy_identity([{"tokens": t, "gaps": g} for t, g in zip(eng.tokens(plain), eng.gaps(plain))],
                           [{"tokens": t} for t in eng.tokens(spec)], eng.greedy_must_match)
    seen = eng.captured(spec)
    wired = seen is None or tuple(seen["taps"]) == p.taps
    speculation = eng.speculation(spec)
    return {
        "eaglewire_serve_check": 1, "engine": eng.name, "engine_label": eng.label,
        "engine_version": eng.version(spec), "target": target, "suite": mine["suite"].summary(),
        "draft": {"served": str(p.engine_dir), "how": p.how, "taps": list(p.taps), "ids": p.ids},
        "settings": {"chain": chain, "max_new_tokens": max_new_tokens, "dtype": mine["dtype"], "batch": 1,
                     "greedy": True},
        "engine_aux_layers": seen,
        "ours": {**counts(mine["spec"], chain), "tokens_per_s": speed(mine["spec"]),
                 "tokens_per_s_without": speed(mine["base"]), "name": mine["names"]["spec"]},
        eng.name: {**counts(e_spec, chain), "tokens_per_s": speed(e_spec), "tokens_per_s_without": speed(e_plain),
                   **({"reported_accept_length": sglang.counts(spec, chain)["reported_accept_length"]}
                      if eng.name == "sglang" else {})},
        "speculation": speculation,
        "engine_args": asked,
        "agreement": agree, "same_text": same_text, "greedy": same, "wirings": alts,
        "ok": same_text["agree"] and same["ok"] and wired,
    }


def cmd_serve_check(args) -> int:
    r = serve_check(args.draft, args.target, engine_name=args.engine, suite=args.suite, max_prompts=args.max_prompts,
                    max_new_tokens=args.max_new_tokens, chain=args.chain, wirings=args.wirings,
                    device=args.device, gpu_memory_utilization=args.gpu_memory_utilization,
                    engine_args=args.engine_args, sglang_python=args.sglang_python, sglang_path=args.sglang_path,
                    eager=args.eager, progress=args.json and (lambda so_far: write_json(args.json, so_far)))
    print(render(r))
    if args.json:
        write_json(args.json, r)
    if args.plot:
        plot(r, args.plot)
    return 0 if r["ok"] else 1


def register(sub) -> None:
    p = sub.add_parser("serve-check", help="serve the draft in the real engine (vLLM or SGLang) beside eaglewire's "
                       "decoder: acceptance, greedy identity, tap wirings")
    cli_args.add_draft(p, required=True, help="native checkpoint (exported for the engine) or an engine export")
    cli_args.add_target(p, help="registry name or Hugging Face model directory")
    p.add_argument("--engine", default="vllm", choices=list(ENGINES))
    cli_args.add_suite(p, default="mt-bench", help=f"{', '.join(SUITES)} or a prompt FILE")
    p.add_argument("--max-prompts", type=cli_args.positive_int, default=20, metavar="N")
    p.add_argument("--max-new-tokens", type=cli_args.positive_int, default=256, metavar="M")
    p.add_argument("--chain", type=cli_args.positive_int, default=None, metavar="K",
                   help="draft tokens a step (default 7)")
    p.add_argument("--wirings", nargs="?", const=ALL, default=(), type=wiring_keys, metavar="KEY,...",
                   help="serve again with other tap ids, each or those named: plus1 and minus1 (every id +1, -1), "
                        "embedding (vLLM: id 0 in place of the first tap; SGLang: the embedding in its place, on a "
                        "family whose SGLang captures it: DeepSeek, the Qwen MoEs), missing (SGLang: the nested key "
                        "misspelled, its default taps)")
    p.add_argument("--engine-args", default=None, metavar='"ARGS"',
                   help="SGLang: its --speculative-num-steps/-eagle-topk/-num-draft-tokens as on its command line, "
                        "served as they are; the report says what SGLang resolved them to")
    p.add_argument("--sglang-python", default=None, metavar="PY",
                   help=f"the Python of a venv with {sglang.REQUIREMENT} (default ${sglang.PYTHON_ENV}, else this one)")
    p.add_argument("--sglang-path", default=None, metavar="DIR",
                   help=f"folders put first on that Python's path, where SGLang's wheels were unpacked (default "
                        f"${sglang.PATH_ENV})")
    p.add_argument("--eager", action="store_true",
                   help="the engine's timed runs without CUDA graphs too, eaglewire's decoder uncompiled (starts minutes "
                        "faster; tokens/s then not as served)")
    cli_args.add_device(p, help="where eaglewire's decoder runs (default: cuda if available)")
    cli_args.add_gpu_memory(p, help="the share of the GPU's memory the engine takes (vLLM's gpu_memory_utilization, "
                            "default 0.5; SGLang's mem_fraction_static, default 0.5)")
    p.add_argument("--json", default=None, metavar="OUT")
    p.add_argument("--plot", default=None, metavar="OUT.png")
    p.set_defaults(func=cmd_serve_check)
