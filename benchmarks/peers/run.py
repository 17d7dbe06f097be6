"""Side by side with the peer trainers: eaglewire, vllm-project/speculators and SpecForge on the same target,
the same data and the same training minutes, each draft served as it comes out of its tool.

    python benchmarks/peers/run.py --work DIR [--target smollm2-135m] [--conversations 5000] [--minutes 4]
        [--trainers eaglewire,speculators,specforge] [--suites mt-bench,humaneval] [--prompts 80]
        [--new-tokens 256] [--chain 7] [--engines vllm,sglang] [--speed-prompts 20] [--peer-python PY]
        [--conversations-file FILE] [--stages replies,capture,...] [--device cuda] [--variant NAME:FIELD=VALUE,...]

Stages, each one's result kept in DIR/stages/ so that a rerun goes on where the last stopped:
    replies   the target's own replies to ShareGPT's first turns (`recipe full --mode replies`), or a file
              of conversations given; a fixed share of them held out from every trainer (acc@1)
    capture   one tokenization (the target's chat template, assistant-only loss mask) and one target
              forward per sample, written in each trainer's own format (features.py), timed
    train     each trainer alone on the GPU for the same minutes: eaglewire with `recipe full`'s settings,
              speculators and SpecForge with their own defaults (peer_speculators.py, peer_specforge.py)
    import    each peer's output through `eaglewire import`, as a user runs it
    doctor    each peer's output through `eaglewire doctor --probe` (PROBE_OK expected), and a copy with
              every id +1 (PROBE_WIRING expected)
    eval      held-out acc@1, and acceptance in eaglewire's decoder (its chain replayed on the target's
              greedy text of each suite, every draft on the same tokens, paired by prompt)
    serve     acceptance in each engine (vLLM, SGLang) on the same prompts, all prompts in one batch
    speed     vLLM tokens/s at batch 1 with CUDA graphs, without and with each draft
    report    the table (report.md), report.json and report.png

A draft is served as its tool wrote it where the engine reads it right (`eaglewire.interop.read_engine_view`);
otherwise eaglewire's export of it, and the table says which.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: `peers` as a package

from eaglewire import files, interop, targets  # noqa: E402
from eaglewire.errors import EaglewireError, UsageError  # noqa: E402
from eaglewire.interop.common import IDS_KEY  # noqa: E402

from peers import features, measure, report  # noqa: E402

STAGES = ("replies", "capture", "train", "import", "doctor", "eval", "serve", "speed", "report")
TRAINERS = ("eaglewire", "speculators", "specforge")
PEERS = ("speculators", "specforge")
OURS = "eaglewire"  # and its variants, eaglewire-NAME (--variant): the same trainer with other settings
# The engine each peer's output is made for: speculators' for vLLM (its loader), SpecForge's HF export for SGLang
# (LlamaForCausalLMEagle3, its ids nested as SGLang reads them). The doctor examines each for that engine.
HOME_ENGINE = {"speculators": "vllm", "specforge": "sglang"}
HELDOUT = 0.02  # share of the conversations no trainer sees (acc@1), by a hash of their text
MIN_HELDOUT = 4


def ours(name: str) -> bool:
    return name == OURS or name.startswith(OURS + "-")


def say(msg: str) -> None:
    print(f"peers: {msg}", file=sys.stderr, flush=True)


def peer_module(name: str):
    if name == "speculators":
        from peers import peer_speculators as m
    else:
        from peers import peer_specforge as m
    return m


class Work:
    """The run's directory: each stage's result as stages/NAME.json, written when the stage is done."""

    def __init__(self, root: Path):
        self.root = root
        for sub in ("stages", "data", "logs"):
            (root / sub).mkdir(parents=True, exist_ok=True)

    def done(self, stage: str) -> dict | None:
        p = self.root / "stages" / f"{stage}.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def save(self, stage: str, result: dict) -> dict:
        files.write_json(self.root / "stages" / f"{stage}.json", result)
        return result

    def __truediv__(self, other):
        return self.root / other


# --- replies ------------------------------------------------------------------------------------------

def _key(conv: list) -> int:
    return int(hashlib.sha256(json.dumps(conv, sort_keys=True).encode()).hexdigest()[:8], 16)


def split(convs: list) -> tuple[list, list]:
    """(train, held out): the conversations whose hash falls in the lowest HELDOUT share (at least MIN_HELDOUT)."""
    order = sorted(range(len(convs)), key=lambda i: _key(convs[i]))
    n = min(len(convs) - 1, max(MIN_HELDOUT, round(HELDOUT * len(convs))))
    # The rest in the hashes' order: a fixed shuffle (speculators holds out its last 10% of rows, as its own
    # prepare-data's shuffle would have them)
    return [convs[i] for i in order[n:]], [convs[i] for i in order[:n]]


def stage_replies(w: Work, a) -> dict:
    from eaglewire.prompts import load_conversations
    from eaglewire.prompts import write_conversations

    t0 = time.perf_counter()
    if a.conversations_file:
        src, how = Path(a.conversations_file), f"given: {Path(a.conversations_file).name}"
    else:
        out = w / "replies"
        shutil.rmtree(out, ignore_errors=True)  # a recipe writes into a new directory; a killed one left this
        _run([sys.executable, "-m", "eaglewire.cli", "recipe", "full", "--mode", "replies", "--out", str(out),
              "--target", a.target, "--max-prompts", str(a.conversations), "--device", a.device,
              "--bench-suite", "none", "--no-progress"], w / "logs" / "replies.log")
        src, how = out / "regenerated.jsonl", "regenerated by the target (recipe full --mode replies)"
    convs = load_conversations(src, need_assistant=True).conversations
    train, held = split(convs)
    write_conversations(train, w / "data" / "train.jsonl")
    write_conversations(held, w / "data" / "heldout.jsonl")
    say(f"replies: {len(train)} conversations to train on, {len(held)} held out ({how})")
    return {"source": how, "train": len(train), "heldout": len(held), "seconds": round(time.perf_counter() - t0, 1)}


# --- capture ------------------------------------------------------------------------------------------

def stage_capture(w: Work, a) -> dict:
    tgt = targets.load_target(a.target, device=a.device)
    tdir = targets.resolve(a.target)
    H = tgt.config.hidden_size
    root = w / "features"
    shutil.rmtree(root, ignore_errors=True)  # a capture killed half-way is redone whole
    from eaglewire.data import datagen
    from eaglewire.prompts import load_pool
    from eaglewire.taps import TapContract

    cfg = datagen.DatagenConfig(max_len=a.max_len, batch_size=16, dtype="bf16")
    pset = load_pool(w / "data" / "train.jsonl")
    writers = {"eaglewire": features.ShardsWriter(root / "eaglewire", target=tgt,
                                                  contract=TapContract.default(tgt.num_layers), pset=pset, cfg=cfg)}
    if "speculators" in a.trainers:  # its own code builds its row table at close(): the peers' interpreter
        writers["speculators"] = peer_module("speculators").Writer(root / "speculators", target_dir=tdir, hidden_size=H,
                                                                   python=a.peer_python, env=a.peer_env)
    if "specforge" in a.trainers:
        writers["specforge"] = peer_module("specforge").Writer(root / "specforge", target_dir=tdir, hidden_size=H)
    r = features.capture_all(tgt, pset, writers, cfg=cfg, progress=say)
    say(f"capture: {r['counts']['tokens']} tokens, forward {r['timing']['forward_s']:.0f} s, "
        + ", ".join(f"{k} written in {r['timing'][f'{k}_write_s']:.0f} s" for k in writers))
    return r


# --- train --------------------------------------------------------------------------------------------

def _run(argv: list, log: Path, env: dict | None = None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run([str(x) for x in argv], stdout=f, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise EaglewireError(f"{' '.join(map(str, argv[:4]))} ... exited {r.returncode}: {' | '.join(tail)} "
                             f"(log: {log})")


def train_one(w: Work, a, name: str) -> dict:
    seconds = a.minutes * 60
    out = w / "trained" / name
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    if ours(name):
        js = w / "logs" / f"train-{name}.json"
        _run([sys.executable, Path(__file__).with_name("train_eaglewire.py"), "--target", a.target, "--data",
              w / "features" / "eaglewire", "--out", out, "--seconds", seconds, "--device", a.device, "--json", js,
              *[x for s in a.set + a.variants.get(name, []) for x in ("--set", s)]], w / "logs" / f"train-{name}.log")
        r = json.loads(js.read_text())
    else:
        own = dict(extra_args=a.speculators_args) if name == "speculators" else dict(
            overrides=a.specforge_set, draft={"draft_vocab_size": a.specforge_draft_vocab} if a.specforge_draft_vocab
            else None)
        r = peer_module(name).train(w / "features" / name, targets.resolve(a.target), out, seconds=seconds,
                                    python=a.peer_python, env=a.peer_env, device=a.device,
                                    log_path=w / "logs" / f"train-{name}.log", **own)
        r = {**r, "checkpoint": str(r["checkpoint"])}
    r["process_s"] = round(time.perf_counter() - t0, 1)
    say(f"train {name}: {r.get('steps')} steps in {r.get('train_s', 0):.0f} s of training "
        f"({r['process_s']:.0f} s with start-up) -> {r['checkpoint']}")
    return r


def stage_train(w: Work, a) -> dict:
    out = {}
    for name in a.trainers:
        out[name] = w.done(f"train-{name}") or w.save(f"train-{name}", train_one(w, a, name))
    return out


# --- import and doctor --------------------------------------------------------------------------------

def stage_import(w: Work, a, trained: dict) -> dict:
    out = dict(w.done("import") or {})  # what an earlier run of this directory imported (a row added since)
    out.pop("stage_s", None)
    for name in a.trainers:
        if name in out:
            continue
        raw = Path(trained[name]["checkpoint"])
        if ours(name):
            out[name] = {"raw": str(raw), "native": str(raw), "how": "native"}
            continue
        native = w / "native" / name
        shutil.rmtree(native, ignore_errors=True)
        log = w / "logs" / f"import-{name}.log"
        _run([sys.executable, "-m", "eaglewire.cli", "import", "--from", raw, "--out", native, "--target",
              targets.resolve(a.target)], log)
        out[name] = {"raw": str(raw), "native": str(native), "how": log.read_text().strip().splitlines()[-1:]}
        say(f"import {name}: {' '.join(out[name]['how'])}")
    return out


def shifted(raw: Path, engine: str, num_layers: int, out: Path) -> Path:
    """A copy of `raw` whose ids, in the key `engine` reads, are every trained id +1 (the seed's fault)."""
    from eaglewire.engines.serve_check import served_copy

    view = interop.read_engine_view(raw, engine, num_layers=num_layers)
    ids = [i + 1 for i in interop.CONVENTIONS[engine].to_ids(view.captured_taps, num_layers)]

    def edit(cfg):
        (cfg.setdefault("eagle_config", {}) if engine == "sglang" else cfg)[IDS_KEY] = ids

    shutil.rmtree(out, ignore_errors=True)
    return served_copy(raw, edit, out)


def stage_doctor(w: Work, a, imported: dict) -> dict:
    from eaglewire.doctor import DoctorRequest, diagnose
    from eaglewire.doctor.cli import render

    tgt = targets.load_target(a.target, device=a.device)
    out = {k: v for k, v in (w.done("doctor") or {}).items() if k != "stage_s"}  # an earlier run's rows
    for name in a.trainers:
        if ours(name) or name in out:
            continue
        raw, engine = Path(imported[name]["raw"]), HOME_ENGINE[name]
        rows = {"engine": engine}
        for variant, d in (("as written", raw), ("every id +1", shifted(raw, engine, tgt.num_layers,
                                                                         w / "doctor" / f"{name}-plus1"))):
            t0 = time.perf_counter()
            r = diagnose(DoctorRequest(d, target=tgt, engine=engine, probe=a.probe, probe_tokens=128))
            verdict = next((f for f in r.findings if f.code in ("PROBE_WIRING", "PROBE_OK", "PROBE_UNSURE")), None)
            # the whole report, the probe's table of wirings included: a verdict alone does not say which shift
            # the probe could not tell apart
            report_file = w / "logs" / f"doctor-{name}-{variant.replace(' ', '-').replace('+', 'plus')}.txt"
            report_file.write_text(render(r) + "\n")
            rows[variant] = {"exit": r.exit_code, "codes": [f"{f.severity}:{f.code}" for f in r.findings],
                             "report": report_file.name,
                             "verdict": f"{verdict.severity}:{verdict.code}" if verdict else None,
                             "engine_ids": r.context.get("engine_ids"), "seconds": round(time.perf_counter() - t0, 1)}
            say(f"doctor {name} ({variant}): {rows[variant]['verdict']}, exit {r.exit_code} "
                f"({', '.join(c for c in rows[variant]['codes'] if not c.startswith('info'))})")
        out[name] = rows
    return out


# --- eval ---------------------------------------------------------------------------------------------

def stage_eval(w: Work, a, imported: dict) -> dict:
    import torch

    from eaglewire.prompts import load_conversations

    tgt = targets.load_target(a.target, device=a.device, dtype=torch.float32)  # the reference the decoder checks
    held = load_conversations(w / "data" / "heldout.jsonl", need_assistant=True).conversations
    texts = [measure.heldout_text(tgt, held, a.max_len)] + [measure.suite_text(tgt, s, a.prompts, a.new_tokens)
                                                           for s in a.suites]
    drafts = {name: measure.load(Path(imported[name]["native"]), tgt.device) for name in a.trainers}
    out = {}
    for text in texts:
        rows, per = {}, {}
        for name, (draft, taps) in drafts.items():
            rows[name], per[name] = measure.replay(draft, taps, text, a.chain)
        base = "eaglewire" if "eaglewire" in per else next(iter(per))
        rows["paired_against"] = {"base": base, **measure.against(per[base], {k: v for k, v in per.items()
                                                                              if k != base})}
        out[text.name] = {"prompts": len(text.seqs), "rows": rows}
        say(f"eval {text.name}: " + ", ".join(f"{k} {v['acceptance_length']:.3f} (acc@1 {v['acc1']:.3f})"
                                              for k, v in rows.items() if k in drafts))
    return out


# --- serve and speed ----------------------------------------------------------------------------------

def served_dir(w: Work, engine: str, name: str, imp: dict, num_layers: int) -> tuple[Path, str]:
    """The directory `engine` loads for this draft: as its tool wrote it when the engine reads it right,
    else eaglewire's export of it (and why)."""
    from eaglewire import checkpoint
    from eaglewire.interop.serve import SpecArgs

    raw = Path(imp["raw"])
    trained = tuple(checkpoint.load_meta(imp["native"]).contract.taps)
    if not ours(name):
        view = interop.read_engine_view(raw, engine, num_layers=num_layers)
        if view.recognised and view.captured_taps is not None and tuple(view.captured_taps) == trained:
            return raw, "as its tool wrote it"
        why = "; ".join(view.problems) or f"{engine} would capture {view.captured_taps}, trained on {list(trained)}"
    else:
        why = "native"
    out = w / "served" / engine / name
    if not (out / "config.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        interop.export_draft(Path(imp["native"]), engine, out, spec=SpecArgs(num_steps=7))
    return out, f"eaglewire's export ({why})"


def stage_serve(w: Work, a, imported: dict) -> dict:
    """Each engine's acceptance for every draft. Each row is its own file (serve-ENGINE-TRAINER.json), whichever
    process served it: the two engines can run at once, in two processes of this script, and a row that failed
    (an engine that exited) is served again alone by a rerun, the others kept."""
    out, failed = {}, []
    for engine in a.engines:
        out[engine], lost = serve_engine(w, a, imported, engine)
        failed += [f"{engine} {name}: {why}" for name, why in lost.items()]
    if failed:
        raise EaglewireError(f"serve: {len(failed)} row(s) failed, the rest kept (rerun --stages serve to serve only "
                             f"these): " + " | ".join(failed))
    return out


def serve_engine(w: Work, a, imported: dict, engine: str) -> tuple[dict, dict]:
    """(rows served or kept, {trainer: why} for rows whose engine failed)."""
    from eaglewire.data.suites import load_suite

    tdir = targets.resolve(a.target)
    N = targets.config_of(a.target).num_hidden_layers
    suites = [load_suite(s, a.prompts) for s in a.suites]
    convs = [c for sp in suites for c in sp.conversations[:a.prompts]]
    groups = [min(a.prompts, len(sp.conversations)) for sp in suites]
    mod = _engine(engine)
    rows, failed = {}, {}
    for name in a.trainers:
        # each draft's row is kept as it is served: a rerun (or a row added later) serves only what is missing
        kept = w.done(f"serve-{engine}-{name}")
        if kept is not None:
            rows[name] = kept
            continue
        try:
            d, how = served_dir(w, engine, name, imported[name], N)
        except (UsageError, EaglewireError) as e:  # a draft this engine cannot run as trained (eaglewire says why)
            rows[name] = w.save(f"serve-{engine}-{name}", {"served": None, "how": f"not servable: {e}", "suites": {}})
            say(f"serve {engine} {name}: not servable: {e}")
            continue
        t0 = time.perf_counter()
        try:
            r = mod.run_job(_acceptance_job(engine, mod, tdir, d, convs, groups, a),
                            log_path=w / "logs" / f"serve-{engine}-{name}.log")
        except EaglewireError as e:  # the engine itself failed (seen: vLLM's memory profiling beside another job)
            failed[name] = str(e)
            say(f"serve {engine} {name}: failed, the next rows go on: {e}")
            continue
        per = _per_suite(engine, r, groups, a.chain)
        rows[name] = {"served": str(d), "how": how, "seconds": round(time.perf_counter() - t0, 1),
                      "suites": dict(zip(a.suites, per)),
                      "version": r.get("vllm_version") or r.get("sglang_version")}
        w.save(f"serve-{engine}-{name}", rows[name])
        say(f"serve {engine} {name}: " + ", ".join(f"{k} {v['acceptance_length']:.3f}"
                                                 for k, v in rows[name]["suites"].items()
                                                 if v["acceptance_length"]))
    return rows, failed


def _engine(engine: str):
    if engine == "vllm":
        from eaglewire.engines import vllm as mod
    else:
        from eaglewire.engines import sglang as mod
    return mod


def _acceptance_job(engine: str, mod, tdir, draft, convs, groups, a):
    common = dict(target=str(tdir), draft=str(draft), conversations=convs, max_new_tokens=a.new_tokens, batch=0)
    if engine == "vllm":
        return mod.Job(**common, num_speculative_tokens=a.chain, enforce_eager=True, groups=groups,
                       gpu_memory_utilization=a.gpu_memory_utilization)
    return mod.Job(**common, num_steps=a.chain, eagle_topk=1, num_draft_tokens=a.chain + 1, cuda_graph=False,
                   mem_fraction_static=a.gpu_memory_utilization)


def _per_suite(engine: str, r: dict, groups: list, K: int) -> list[dict]:
    """Acceptance per suite with each engine's own reader: vLLM counts each call (one a suite), SGLang each
    request (its meta_info), so a suite is its requests."""
    if engine == "vllm":
        from eaglewire.engines.serve_check import counts

        return [counts([g], K) for g in r["groups"]]
    from eaglewire.engines import sglang

    out, at = [], 0
    for n in groups:
        out.append(sglang.counts({**r, "prompts": r["prompts"][at:at + n]}, K))
        at += n
    return out


def stage_speed(w: Work, a, imported: dict) -> dict:
    from eaglewire.data.suites import load_suite
    from eaglewire.engines import vllm

    tdir = targets.resolve(a.target)
    N = targets.config_of(a.target).num_hidden_layers
    convs = load_suite(a.suites[0], a.speed_prompts).conversations[:a.speed_prompts]
    job = dict(target=str(tdir), conversations=convs, max_new_tokens=a.new_tokens, num_speculative_tokens=a.chain,
               gpu_memory_utilization=a.gpu_memory_utilization)
    rows = dict((w.done("speed") or {}).get("rows", {}))  # an earlier run's rows: a row added later is timed alone
    for name in [None, *a.trainers]:
        if (name or "none") in rows:
            continue
        d = served_dir(w, "vllm", name, imported[name], N)[0] if name else None
        r = vllm.run_job(vllm.Job(draft=str(d) if d else None, **job),
                         log_path=w / "logs" / f"speed-{name or 'none'}.log")
        toks, secs = sum(len(p["tokens"]) for p in r["prompts"]), sum(p["seconds"] for p in r["prompts"])
        rows[name or "none"] = {"tokens_per_s": toks / secs if secs else None, "tokens": toks,
                                "seconds": round(secs, 2)}
        say(f"speed vllm {name or 'without a draft'}: {rows[name or 'none']['tokens_per_s']:.0f} tokens/s")
    return {"suite": a.suites[0], "prompts": len(convs), "rows": rows}


# --- the run ------------------------------------------------------------------------------------------

def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True, help="the run's directory (made, or continued)")
    p.add_argument("--target", default=targets.DEFAULT_TARGET)
    p.add_argument("--conversations", type=int, default=5000, help="ShareGPT first turns the target answers")
    p.add_argument("--conversations-file", default=None, help="conversations with replies, instead of regenerating")
    p.add_argument("--minutes", type=float, default=4.0, help="training minutes, each trainer alone on the GPU")
    p.add_argument("--trainers", default=",".join(TRAINERS))
    p.add_argument("--suites", default="mt-bench,humaneval")
    p.add_argument("--prompts", type=int, default=80, help="prompts a suite")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--chain", type=int, default=7)
    p.add_argument("--max-len", type=int, default=1024, help="tokens a training sample (recipe full's)")
    p.add_argument("--probe", type=int, default=32, help="the doctor's probe prompts")
    p.add_argument("--engines", default="vllm,sglang")
    p.add_argument("--speed-prompts", type=int, default=20)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--peer-python", default=sys.executable, help="the interpreter that runs the peers' trainers")
    p.add_argument("--peer-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the peers' processes (e.g. PYTHONPATH=their site folder)")
    p.add_argument("--speculators-args", default="", help="more `speculators train` flags (their defaults: none)")
    p.add_argument("--specforge-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a SpecForge run.yaml override (their defaults: none)")
    p.add_argument("--specforge-draft-vocab", type=int, default=None,
                   help="SpecForge's draft vocabulary (default its 32,000; a toy target needs fewer)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="a training field of eaglewire's row (its ablations)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE[,FIELD=VALUE...]",
                   help="one more eaglewire row, eaglewire-NAME, trained with these fields changed (an ablation "
                        "toward a peer's settings, e.g. ttt3:ttt_steps=3,ttt_decay=1.0; a JSON value may hold commas: "
                        "norms:draft_overrides={\"norm_before_residual\":true,\"norm_before_fc\":true})")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    for field in ("trainers", "suites", "engines", "stages"):
        setattr(a, field, [x for x in getattr(a, field).split(",") if x])
    a.speculators_args = shlex.split(a.speculators_args)
    a.peer_env = dict(kv.split("=", 1) for kv in a.peer_env if "=" in kv)
    a.variants = {}
    for v in a.variant:
        name, _, sets = v.partition(":")
        fields = [x for x in re.split(r",(?=\w+=)", sets) if x]  # a comma inside a JSON value stays in it
        if not name.replace("_", "").isalnum() or not fields or not all("=" in x for x in fields):
            raise UsageError(f"--variant {v!r}: NAME:FIELD=VALUE[,FIELD=VALUE...], e.g. ttt3:ttt_steps=3,ttt_decay=1.0")
        a.variants[f"{OURS}-{name}"] = fields
    if OURS in a.trainers:  # the variants run with eaglewire's row (or alone: --trainers eaglewire-NAME)
        a.trainers += [t for t in a.variants if t not in a.trainers]
    bad = [t for t in a.trainers if t not in TRAINERS and t not in a.variants] + [s for s in a.stages if s not in STAGES]
    if bad:
        raise UsageError(f"unknown trainer or stage {bad}: trainers {', '.join(TRAINERS)}; stages {', '.join(STAGES)}")
    for name in ("conversations", "prompts", "new_tokens", "chain", "max_len", "probe", "speed_prompts"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(a, name)}: must be >= 1")
    if a.minutes <= 0:
        raise UsageError(f"--minutes {a.minutes}: must be > 0")
    return a


# Stages kept in parts, one file each, so that parts can run in separate processes at once (or be redone alone)
PARTS = {"train": lambda a: [f"train-{t}" for t in a.trainers], "serve": lambda a: [f"serve-{e}" for e in a.engines]}


def _kept(w: Work, a, stage: str) -> dict | None:
    if stage == "serve":  # a row per file, from whichever run served it
        rows = {e: {t: r for t in a.trainers if (r := w.done(f"serve-{e}-{t}")) is not None} for e in a.engines}
        return {e: r for e, r in rows.items() if r} or None
    if stage not in PARTS:
        return w.done(stage)
    parts = {p.split("-", 1)[1]: w.done(p) for p in PARTS[stage](a)}
    return {k: v for k, v in parts.items() if v is not None} or None


def _covers(stage: str, have: dict, a) -> bool:
    """Whether a kept result holds every trainer asked for (a row added to a finished run makes it incomplete)."""
    want = list(a.trainers)
    if stage in PARTS:
        if len(have) < len(PARTS[stage](a)):
            return False
        return stage != "serve" or all(t in rows for rows in have.values() for t in want)
    if stage == "import":
        return all(t in have for t in want)
    if stage == "doctor":
        return all(t in have for t in want if not ours(t))
    if stage == "eval":
        return all(t in text["rows"] for text in have.values() if isinstance(text, dict) for t in want)
    if stage == "speed":
        return all(t in have.get("rows", {}) for t in ["none", *want])
    return True


def run(a) -> dict:
    w = Work(Path(a.work))
    results = {}
    steps = {"replies": lambda: stage_replies(w, a), "capture": lambda: stage_capture(w, a),
             "train": lambda: stage_train(w, a), "import": lambda: stage_import(w, a, results["train"]),
             "doctor": lambda: stage_doctor(w, a, results["import"]), "eval": lambda: stage_eval(w, a, results["import"]),
             "serve": lambda: stage_serve(w, a, results["import"]), "speed": lambda: stage_speed(w, a, results["import"])}
    for stage in STAGES[:-1]:
        have = _kept(w, a, stage)
        if stage in a.stages and (have is None or not _covers(stage, have, a)):
            t0 = time.perf_counter()
            have = steps[stage]()  # a stage in parts saves each part itself
            if stage not in PARTS:
                have = w.save(stage, {**have, "stage_s": round(time.perf_counter() - t0, 1)})
        if have is not None:
            results[stage] = have
    if "report" in a.stages:
        meta = {"target": a.target, "minutes": a.minutes, "chain": a.chain, "new_tokens": a.new_tokens,
                "prompts": a.prompts, "suites": a.suites, "trainers": a.trainers, "device": _device(a.device),
                "date": time.strftime("%Y-%m-%d")}
        results["report"] = report.write(w.root, meta, results)
    return results


def _device(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else "cpu"


def main(argv=None) -> int:
    try:
        a = parse(argv)
        run(a)
    except EaglewireError as e:
        print(f"peers: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
