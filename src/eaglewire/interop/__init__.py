"""Interop: export native drafts to SGLang / vLLM / speculators, import drafts from every ecosystem format.

FORMATS (a plain dict; the CLI's choices derive from it) maps a format name to what eaglewire can
do with it. Detection looks at config.json and the weight names; where the files admit several
readings (a plain config with top-level ids could be vLLM or SpecForge-style; SGLang's meaning of
ids for DeepSeek-family targets depends on its version), every plausible reading is computed and
`--source` (or `--engine-version`) is required only when they disagree.

Public API: `export_draft`, `import_draft`, `load_any`, `read_engine_view`, `detect`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import checkpoint, files, targets
from ..draft import Eagle3Draft
from ..errors import EaglewireError, UsageError
from ..taps import CONVENTIONS, TapContract
from . import eagle, modelopt, serve, sglang, specforge, vllm
from .common import (CONFIG, PROVENANCE_KEY, SERVE, WEIGHTS, DraftDir, Reading, assert_same_draft, build_draft,
                     read_dir)
from .engine_view import EngineView, FlagView

# name -> (can export, description). Readers are dispatched in `_readings`.
FORMATS: dict[str, dict] = {
    "sglang": {"export": True, "what": "SGLang LlamaForCausalLMEagle3 (midlayer.*, nested eagle_config ids)"},
    "vllm": {"export": True, "what": "vLLM: speculators Eagle3Speculator config (top-level ids) served by vLLM; "
                                     "imports also read vLLM's plain Eagle3LlamaForCausalLM configs"},
    "speculators": {"export": True, "what": "vllm-project/speculators Eagle3Speculator (the library's loader)"},
    "specforge": {"export": False, "what": "SpecForge LlamaForCausalLMEagle3 draft (output-of-layer ids)"},
    "eagle": {"export": False, "what": "SafeAILab/EAGLE reference draft (hard-coded taps)"},
    "modelopt": {"export": False, "what": "NVIDIA ModelOpt EAGLE-3 export (layers.0.*, d2t only)"},
}
EXPORT_FORMATS = [k for k, v in FORMATS.items() if v["export"]]
ENGINES = ("sglang", "vllm", "speculators")


@dataclass(frozen=True, kw_only=True)
class TargetInfo:
    """What the importer knows about the target: its fingerprint and (when loaded) its embedding."""

    fingerprint: dict
    embedding: object = None  # torch.Tensor or None

    @property
    def num_layers(self) -> int | None:
        return self.fingerprint.get("num_layers")


@dataclass(frozen=True, kw_only=True)
class ImportMeta:
    """Where an imported draft came from and what it reads."""

    path: Path
    source: str
    convention: str
    contract: TapContract
    target: dict
    engine_version: str | None = None
    ids: list[int] | None = None
    ids_where: str | None = None
    notes: tuple[str, ...] = ()
    config: object = None  # DraftConfig

    def to_dict(self) -> dict:
        return {"path": str(self.path), "source": self.source, "convention": self.convention,
                "engine_version": self.engine_version, "ids": self.ids, "ids_where": self.ids_where,
                "taps": list(self.contract.taps), "num_layers": self.contract.num_layers, "notes": list(self.notes)}


def load_target_info(spec: str) -> TargetInfo:
    """Load a --target on the CPU for its exact fingerprint and its token embedding.

    A model directory without a tokenizer is accepted (the tokenizer hashes are then unknown).
    """
    from ..capture import locate

    path = targets.resolve(spec)
    if path.suffix == ".gguf":
        t = targets.load_target(spec, device="cpu")
        model, fingerprint = t.model, t.fingerprint
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            tok = None
        fingerprint = targets.fingerprint(model, tok)
    embed = locate(model).embed.weight.detach().float().cpu()
    return TargetInfo(fingerprint=fingerprint, embedding=embed)


# --- detection ------------------------------------------------------------------------------------

def detect(dd: DraftDir) -> tuple[list[str], str]:
    """Candidate sources for a directory, with the reason. Our own exports name theirs."""
    cfg, names = dd.config, dd.names
    block = cfg.get(PROVENANCE_KEY)
    if isinstance(block, dict) and block.get("format") in FORMATS:
        return [block["format"]], f"written by eaglewire as {block['format']} (config.json '{PROVENANCE_KEY}')"
    if cfg.get("format") == checkpoint.FORMAT:
        return ["native"], "an eaglewire native checkpoint"
    archs = cfg.get("architectures") or []
    mid = any(n.startswith("midlayer.") for n in names)
    if vllm.is_speculators(cfg):
        return ["speculators", "vllm"], "speculators_model_type: eagle3 (read by the speculators library and vLLM)"
    if "Eagle3LlamaForCausalLM" in archs:
        return ["vllm"], "architectures Eagle3LlamaForCausalLM (vLLM's class name)"
    if sglang.ARCH in archs:
        if modelopt.looks_like(cfg, names):
            return ["modelopt"], "LlamaForCausalLMEagle3 with ModelOpt's eagle_config keys and no t2d"
        if dd.ids("top") is not None and dd.ids("nested") is None:
            return ["vllm", "specforge"], ("LlamaForCausalLMEagle3 with TOP-LEVEL ids: vLLM reads id j as tap j, "
                                           "SpecForge-style trainers as tap j+1")
        return ["sglang", "specforge"], "LlamaForCausalLMEagle3 with nested (or no) ids"
    if "LlamaForCausalLM" in archs and mid and "draft_vocab_size" in cfg:
        return ["eagle"], "LlamaForCausalLM config with draft_vocab_size and midlayer.* weights (SafeAILab/EAGLE)"
    raise UsageError(f"{dd.path}: format not recognised (architectures {archs}); pass --source "
                     f"({', '.join(FORMATS)})")


def _readings(dd: DraftDir, source: str, t: TargetInfo, engine_version: str | None) -> list[Reading]:
    n = t.num_layers
    if n is None:
        raise UsageError(f"{dd.path}: the target's layer count is needed to read its taps; pass --target")
    vocab = t.fingerprint.get("vocab_size")
    if source == "sglang":
        model_type = t.fingerprint.get("model_type")
        if engine_version:
            return [sglang.read(dd, model_type=model_type, num_layers=n, vocab_size=vocab, version=engine_version)]
        out, first_error = [], None
        for v in ("latest", "0.5.12"):  # the newest rules, and the last release before PR #25454
            try:
                out.append(sglang.read(dd, model_type=model_type, num_layers=n, vocab_size=vocab, version=v))
            except EaglewireError as e:
                first_error = first_error or e
        if not out:
            raise first_error
        return out
    if source in ("vllm", "speculators"):
        return [vllm.read(dd, engine=source, num_layers=n, vocab_size=vocab)]
    mod = {"specforge": specforge, "eagle": eagle, "modelopt": modelopt}.get(source)
    if mod is None:
        raise UsageError(f"--source {source!r}: one of {', '.join(FORMATS)}")
    return [mod.read(dd, num_layers=n, vocab_size=vocab)]


def _target_for(dd: DraftDir, target: TargetInfo | None) -> TargetInfo:
    block = dd.config.get(PROVENANCE_KEY) or {}
    recorded = block.get("target") or {}
    if target is not None:
        diff = targets.compare_fingerprints(recorded, target.fingerprint, "--target")
        if diff:
            raise UsageError(f"{dd.path} was exported for another target: {'; '.join(diff)}")
        return target
    fp = dict(recorded)
    if not fp.get("num_layers") and isinstance(block.get("taps"), dict):
        fp["num_layers"] = block["taps"].get("num_layers")
    return TargetInfo(fingerprint=fp)


def _choose(dd: DraftDir, sources: list[str], why: str, t: TargetInfo, engine_version: str | None,
            explicit: bool) -> Reading:
    readings, errors = [], []
    for s in sources:
        try:
            readings += _readings(dd, s, t, engine_version)
        except EaglewireError as e:
            if explicit or len(sources) == 1:
                raise
            errors.append(f"{s}: {e}")
    if not readings:
        raise UsageError(f"{dd.path}: no reading fits ({why}): " + " | ".join(errors))
    if len({r.key() for r in readings}) > 1:
        each = "; ".join(f"{r.source} ({r.convention}): taps {list(r.contract.taps)}, "
                         f"norm_output={r.config.norm_output}, norm_before_residual={r.config.norm_before_residual}"
                         for r in readings)
        hint = "--engine-version" if {r.source for r in readings} == {"sglang"} else "--source"
        raise UsageError(f"{dd.path}: {why}; the files alone do not say which, and the readings differ: {each}. "
                         f"Pass {hint} to say which one produced this directory")
    agree = sorted({f"{r.source} ({r.convention})" for r in readings})
    if len(agree) > 1:
        chosen = readings[0]
        note = f"{why}: {', '.join(agree)} read this directory alike; no --source needed"
        return Reading(**{**chosen.__dict__, "notes": chosen.notes + (note,)})
    return readings[0]


def read_foreign(path, source: str | None, target: TargetInfo | None, engine_version: str | None
                 ) -> tuple[Reading, dict]:
    """How a draft directory (a path or a DraftDir) reads, without building the draft: (the Reading, the
    target fingerprint it is for)."""
    dd = path if isinstance(path, DraftDir) else read_dir(path)
    t = _target_for(dd, target)
    block = dd.config.get(PROVENANCE_KEY) if isinstance(dd.config.get(PROVENANCE_KEY), dict) else None
    if source is None:
        sources, why = detect(dd)
    else:
        if source not in FORMATS:
            raise UsageError(f"--source {source!r}: one of {', '.join(FORMATS)}")
        sources, why = [source], f"--source {source}"
    if block and engine_version is None and sources == ["sglang"]:
        engine_version = block.get("engine_version")
    reading = _choose(dd, sources, why, t, engine_version, explicit=source is not None)
    if block and isinstance(block.get("taps"), dict):
        recorded = TapContract.from_dict(block["taps"])
        if recorded != reading.contract:
            raise EaglewireError(f"{dd.path}: eaglewire exported taps {list(recorded.taps)} but the engine-visible "
                                 f"ids {reading.ids} now mean taps {list(reading.contract.taps)} "
                                 "(config.json edited after export?)")
    return reading, t.fingerprint or reading.target


def load_any(path, source: str | None = None, target: TargetInfo | str | None = None,
             engine_version: str | None = None) -> tuple[Eagle3Draft, ImportMeta]:
    """Any draft directory -> (Eagle3Draft, ImportMeta). Native checkpoints load as they are.

    target: a TargetInfo, a --target spec (loaded on the CPU), or None.
    """
    p = Path(path)
    if checkpoint.is_checkpoint(p):
        model, meta = checkpoint.load_draft(p)
        return model, ImportMeta(path=p, source="native", convention="canonical", contract=meta.contract,
                                 target=meta.target, config=meta.config)
    t = load_target_info(target) if isinstance(target, str) else target
    reading, fingerprint = read_foreign(p, source, t, engine_version)
    fingerprint = {**_partial_fingerprint(reading), **(fingerprint or {})}
    model = build_draft(reading, embedding=t.embedding if t is not None else None)
    return model, ImportMeta(path=p, source=reading.source, convention=reading.convention, contract=reading.contract,
                             target=fingerprint, engine_version=engine_version, ids=reading.ids,
                             ids_where=reading.ids_where, notes=reading.notes, config=reading.config)


def _partial_fingerprint(r: Reading) -> dict:
    return {"num_layers": r.contract.num_layers, "hidden_size": r.config.target_hidden_size,
            "vocab_size": r.config.vocab_size}


def read_engine_view(path, engine: str, engine_version: str | None = None, *, model_type: str | None = None,
                     num_layers: int | None = None) -> EngineView:
    """What `engine` (sglang, vllm, speculators) really reads from a draft directory, as data.

    model_type / num_layers: the target's, to resolve captured taps; taken from an eaglewire
    export's provenance block when not given.
    """
    dd = read_dir(path)
    block = dd.config.get(PROVENANCE_KEY) if isinstance(dd.config.get(PROVENANCE_KEY), dict) else {}
    recorded = block.get("target") or {}
    model_type = model_type or recorded.get("model_type")
    num_layers = num_layers or recorded.get("num_layers") or (block.get("taps") or {}).get("num_layers")
    if engine == "sglang":
        return sglang.engine_view(dd, engine_version, model_type, num_layers)
    if engine in ("vllm", "speculators"):
        return vllm.engine_view(dd, engine, num_layers)
    raise UsageError(f"engine {engine!r}: one of {', '.join(ENGINES)}")


# --- export and import ----------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ExportResult:
    out: Path
    format: str
    ids: list[int]
    convention: str
    serve_text: str
    notes: list[str] = field(default_factory=list)


def export_draft(draft, fmt: str, out, *, engine_version: str | None = None, spec: serve.SpecArgs | None = None,
                 target_path: str | None = None) -> ExportResult:
    """Export a native checkpoint to `fmt`; atomic, and verified by reloading it with our importer."""
    if fmt not in EXPORT_FORMATS:
        raise UsageError(f"--format {fmt!r}: one of {', '.join(EXPORT_FORMATS)}")
    if engine_version is not None and fmt != "sglang":
        raise UsageError("--engine-version applies to --format sglang (vLLM's reading does not depend on it here)")
    spec = spec or serve.SpecArgs()
    model, meta = checkpoint.load_draft(draft)
    out = Path(out)
    target = dict(meta.target)
    target.setdefault("num_layers", meta.contract.num_layers)
    if fmt == "sglang":
        cfg, tensors, ids, conv, notes = sglang.export(model, meta.contract, target, engine_version)
        text = serve.sglang_text(str(out), ids, conv, meta.contract, target, engine_version or sglang.LATEST, spec,
                                 target_path, notes)
    else:
        cfg, tensors, ids, conv, notes = vllm.export(model, meta.contract, target, fmt, spec.num_steps, target_path)
        text = serve.vllm_text(str(out), ids, meta.contract, target, spec.num_steps, fmt, target_path, notes)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out}: exists and is not empty; choose a new --out directory")
    with files.atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / SERVE).write_text(text)
        reloaded, rmeta = load_any(tmp, target=TargetInfo(fingerprint=target))
        if rmeta.contract != meta.contract:
            raise EaglewireError(f"export check: {fmt} ids {ids} read back as taps {list(rmeta.contract.taps)}, "
                                 f"not {list(meta.contract.taps)}")
        assert_same_draft(model, reloaded, f"export check ({fmt})")
    return ExportResult(out=out, format=fmt, ids=ids, convention=conv, serve_text=text, notes=notes)


def import_draft(src, out, *, source: str | None = None, target: str | TargetInfo | None = None,
                 engine_version: str | None = None) -> tuple[Path, ImportMeta]:
    """Import any supported directory into a native checkpoint at `out`, then reload it and compare."""
    model, meta = load_any(src, source=source, target=target, engine_version=engine_version)
    if meta.source == "native":
        raise UsageError(f"{src} is already an eaglewire checkpoint; nothing to import")
    if Path(out).exists():
        raise UsageError(f"{out}: exists; choose a new --out directory")
    path = checkpoint.save_draft(model, out, contract=meta.contract, target_fingerprint=meta.target,
                                 training={"imported_from": meta.to_dict()})
    try:
        reloaded, _ = checkpoint.load_draft(path)
        assert_same_draft(model, reloaded, "import check")
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # nothing is left behind
        raise
    return path, meta


__all__ = ["FORMATS", "EXPORT_FORMATS", "ENGINES", "EngineView", "FlagView", "ImportMeta", "TargetInfo",
           "ExportResult", "detect", "export_draft", "import_draft", "load_any", "read_engine_view", "read_foreign",
           "load_target_info", "CONVENTIONS"]
