"""What the doctor examines: the draft directory as stored, the taps it was TRULY trained on, and
the target it is meant for.

The truth about taps comes from what eaglewire recorded: a native checkpoint's `taps`, or the
`eaglewire` provenance block an export carries. A foreign directory has no record: its taps are
read through its source's convention (interop.load_any) and are flagged as unverified.

A broken directory must still be examinable, so nothing here refuses what interop's loaders
refuse (edited ids, invalid d2t, wrong shapes): the raw tensors and config are always kept, and
the draft module is built only when it can be.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import checkpoint, interop, targets
from ..draft import DraftConfig, Eagle3Draft
from ..errors import EaglewireError, TapError, UsageError
from ..interop.common import PROVENANCE_KEY, DraftDir, Reading, build_draft, read_dir
from ..taps import TapContract

# Which engine reads a format (for --engine defaults).
FORMAT_ENGINE = {"sglang": "sglang", "vllm": "vllm", "speculators": "vllm"}


@dataclass
class TargetFacts:
    """The target as far as it is known: loaded (--target) or from the draft's recorded fingerprint."""

    fingerprint: dict
    loaded: targets.Target | None = None
    spec: str | None = None

    @property
    def num_layers(self) -> int | None:
        return self.fingerprint.get("num_layers")

    @property
    def model_type(self) -> str | None:
        return self.fingerprint.get("model_type")

    @property
    def architecture(self) -> str | None:
        return self.fingerprint.get("architecture")

    @property
    def hidden_size(self) -> int | None:
        return self.fingerprint.get("hidden_size")

    @property
    def vocab_size(self) -> int | None:
        return self.fingerprint.get("vocab_size")

    def embedding(self) -> torch.Tensor | None:
        if self.loaded is None:
            return None
        from ..capture import locate

        return locate(self.loaded.model).embed.weight.detach().float().cpu()


@dataclass
class Subject:
    path: Path
    dd: DraftDir
    kind: str  # "native", an interop format name, or "unknown"
    contract: TapContract | None  # the taps the draft was trained on
    contract_from: str  # where that truth comes from, in words
    recorded: bool  # the contract was recorded by eaglewire (not inferred from a convention)
    config: DraftConfig | None
    recorded_target: dict = field(default_factory=dict)
    provenance: dict | None = None
    metrics: dict | None = None
    tap_stats: dict | None = None
    draft: Eagle3Draft | None = None
    load_error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def engine(self) -> str | None:
        return FORMAT_ENGINE.get(self.kind)


def load_target(spec) -> TargetFacts:
    """--target: a spec string (loaded on the CPU) or an already loaded targets.Target."""
    t = spec if isinstance(spec, targets.Target) else targets.load_target(spec, device="cpu")
    fp = dict(t.fingerprint)
    fp.setdefault("architecture", type(t.model).__name__)
    return TargetFacts(fingerprint=fp, loaded=t, spec=t.spec)


def _native_tensors(kind: str, tensors: dict) -> dict:
    """An engine-format directory's tensors under eaglewire's own names (export naming, reversed)."""
    if kind == "sglang":
        return {interop.sglang.native_name(k) if k not in ("d2t", "t2d") else k: v for k, v in tensors.items()}
    return {("fc_input_norm.weight" if k == "input_norm.weight" else k.replace("midlayer.", "layers.0.")): v
            for k, v in tensors.items()}


def _build(config: DraftConfig, contract: TapContract, kind: str, dd: DraftDir, embedding) -> Eagle3Draft:
    tensors = _native_tensors(kind, dd.tensors)
    if "d2t" in tensors:
        tensors["d2t"] = tensors["d2t"].long()
    reading = Reading(source=kind, convention="recorded", config=config, tensors=tensors, contract=contract,
                      ids=None, ids_where=None)
    return build_draft(reading, embedding=embedding)


def load_subject(path, *, source: str | None, target: TargetFacts | None, engine_version: str | None,
                 records: str | None = None) -> Subject:
    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"--draft {p}: no such directory")
    dd = read_dir(p)  # UsageError for an unreadable directory: nothing to examine
    cfg = dd.config
    block = cfg.get(PROVENANCE_KEY) if isinstance(cfg.get(PROVENANCE_KEY), dict) else None
    if cfg.get("format") == checkpoint.FORMAT:
        s = _native(p, dd)
    elif block is not None and source is None:
        s = _exported(p, dd, block, target)
    else:
        s = _foreign(p, dd, source, target, engine_version)
    if records:
        meta = checkpoint.load_meta(records)
        s.metrics, s.tap_stats = meta.metrics, meta.tap_stats
        s.notes.append(f"training records (metrics, tap statistics) from {records}")
    return s


def _native(p: Path, dd: DraftDir) -> Subject:
    meta = checkpoint.load_meta(p)  # config-level validation only: the tensors are examined raw
    s = Subject(path=p, dd=dd, kind="native", contract=meta.contract, recorded=True,
                contract_from="recorded in the checkpoint (config.json 'taps')", config=meta.config,
                recorded_target=dict(meta.target), metrics=meta.metrics, tap_stats=meta.tap_stats)
    try:
        s.draft, _ = checkpoint.load_draft(p)
    except EaglewireError as e:
        s.load_error = str(e)
    return s


def _exported(p: Path, dd: DraftDir, block: dict, target: TargetFacts | None) -> Subject:
    kind = block.get("format") or "unknown"
    contract = config = None
    try:
        contract = TapContract.from_dict(block.get("taps") or {})
        config = DraftConfig.from_dict(block.get("draft") or {})
    except (TapError, UsageError) as e:
        return Subject(path=p, dd=dd, kind=kind, contract=contract, recorded=contract is not None,
                       contract_from="eaglewire export record (unreadable)", config=config,
                       recorded_target=dict(block.get("target") or {}), provenance=block,
                       load_error=f"config.json '{PROVENANCE_KEY}' block: {e}")
    s = Subject(path=p, dd=dd, kind=kind, contract=contract, recorded=True,
                contract_from=f"recorded by eaglewire at export (config.json '{PROVENANCE_KEY}.taps')", config=config,
                recorded_target=dict(block.get("target") or {}), provenance=block)
    try:
        s.draft = _build(config, contract, kind, dd, target.embedding() if target else None)
    except EaglewireError as e:
        s.load_error = str(e)
    return s


def _foreign(p: Path, dd: DraftDir, source: str | None, target: TargetFacts | None,
             engine_version: str | None) -> Subject:
    info = interop.TargetInfo(fingerprint=target.fingerprint, embedding=target.embedding()) if target else None
    try:
        draft, meta = interop.load_any(p, source=source, target=info, engine_version=engine_version)
    except EaglewireError as e:
        return Subject(path=p, dd=dd, kind=source or "unknown", contract=None, recorded=False,
                       contract_from="unknown (the directory could not be read as any format)", config=None,
                       load_error=str(e))
    where = f"ids {meta.ids} at {meta.ids_where}" if meta.ids is not None else "no ids: the source's default taps"
    return Subject(path=p, dd=dd, kind=meta.source, contract=meta.contract, recorded=False,
                   contract_from=f"inferred from the {meta.source} convention '{meta.convention}' ({where})",
                   config=meta.config, recorded_target=dict(meta.target or {}), draft=draft,
                   notes=list(meta.notes))
