"""Reading any draft directory: what it is (`detect`), how it reads (`read_foreign`: every adapter's
plausible readings, one chosen or a UsageError saying which flag decides), the draft it holds
(`load_any`), and what an engine would read from it (`read_engine_view`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import checkpoint, targets
from ..draft import Eagle3Draft
from ..errors import EaglewireError, UsageError
from ..taps import TapContract
from . import modelopt, sglang, vllm
from .adapters import ADAPTERS, Facts
from .common import PROVENANCE_KEY, DraftDir, Reading, build_draft, read_dir
from .engine_view import EngineView

# name -> (can export, description); the CLI's choices derive from it.
FORMATS: dict[str, dict] = {name: {"export": a.export is not None, "what": a.what} for name, a in ADAPTERS.items()}
EXPORT_FORMATS = [k for k, v in FORMATS.items() if v["export"]]
ENGINES = tuple(name for name, a in ADAPTERS.items() if a.view is not None)


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
    carried: dict = field(default_factory=dict)  # Reading.carried: written back by an export to the same format
    target_from: str | None = None  # where the target came from when no --target was given (recorded_target)

    def to_dict(self) -> dict:
        return {"path": str(self.path), "source": self.source, "convention": self.convention,
                "engine_version": self.engine_version, "ids": self.ids, "ids_where": self.ids_where,
                "taps": list(self.contract.taps), "num_layers": self.contract.num_layers, "notes": list(self.notes),
                "carried": self.carried, "target_from": self.target_from}


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
    adapter = ADAPTERS.get(source)
    if adapter is None:
        raise UsageError(f"--source {source!r}: one of {', '.join(FORMATS)}")
    return adapter.read(dd, Facts(num_layers=n, vocab_size=t.fingerprint.get("vocab_size"),
                                  model_type=t.fingerprint.get("model_type"), engine_version=engine_version))


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
    dd, target_from, extra = read_dir(p), None, ()
    if t is None:
        spec, where = recorded_target(dd)
        if spec is not None:
            if _readable(spec):
                t, target_from = load_target_info(spec), f"{spec} (config.json {where}; --target overrides it)"
            else:
                extra = (f"config.json {where} names the target {spec!r}, which is not a model directory or .gguf "
                         "file here: pass --target to check the draft against it",)
    reading, fingerprint = read_foreign(dd, source, t, engine_version)
    fingerprint = {**_partial_fingerprint(reading), **(fingerprint or {})}
    model = build_draft(reading, embedding=t.embedding if t is not None else None)
    return model, ImportMeta(path=p, source=reading.source, convention=reading.convention, contract=reading.contract,
                             target=fingerprint, engine_version=engine_version, ids=reading.ids,
                             ids_where=reading.ids_where, notes=reading.notes + extra, config=reading.config,
                             carried=reading.carried, target_from=target_from)


def recorded_target(dd: DraftDir) -> tuple[str | None, str | None]:
    """(the target a directory names, the config key naming it), or (None, None). speculators records its
    verifier (config.py VerifierConfig.name_or_path: "Used to dynamically load the verifier")."""
    verifier = (dd.config.get("speculators_config") or {}).get("verifier") if vllm.is_speculators(dd.config) else None
    spec = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    if isinstance(spec, str) and spec:
        return spec, "speculators_config.verifier.name_or_path"
    return None, None


def _readable(spec: str) -> bool:
    """A local model directory or .gguf file: a recorded hub id is never fetched behind the user's back."""
    p = Path(spec).expanduser()
    return (p.is_dir() and (p / "config.json").is_file()) or (p.suffix == ".gguf" and p.is_file())


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
    adapter = ADAPTERS.get(engine)
    if adapter is None or adapter.view is None:
        raise UsageError(f"engine {engine!r}: one of {', '.join(ENGINES)}")
    return adapter.view(dd, Facts(num_layers=num_layers, model_type=model_type, engine_version=engine_version))
