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

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import checkpoint, interop, targets
from ..draft import DraftConfig, Eagle3Draft
from ..errors import EaglewireError, TapError, UsageError
from ..interop.common import IDS_KEY, PROVENANCE_KEY, DraftDir, Reading, build_draft, read_dir
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


def load_target(spec, device: str | None = None) -> TargetFacts:
    """--target: a spec string (loaded on `device`, default cuda if available) or an already loaded targets.Target."""
    t = spec if isinstance(spec, targets.Target) else targets.load_target(spec, device=device)
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


def draft_dir(path) -> Path:
    """--draft as a directory, or a one-line error: checked before the target loads (seconds to minutes)."""
    p = Path(path)
    if p.is_file():
        raise UsageError(f"--draft {p}: a file; pass the directory that holds it ({p.parent})")
    if not p.is_dir():
        raise UsageError(f"--draft {p}: no such directory")
    return p


def load_subject(path, *, source: str | None, target: TargetFacts | None, engine_version: str | None,
                 records: str | None = None) -> Subject:
    p = Path(path)  # diagnose checked it (draft_dir) before loading the target
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
    ids_error = None
    try:
        reading, _ = interop.read_foreign(dd, source, info, engine_version)
    except EaglewireError as e:
        # Ids its source's convention cannot read (taps it cannot reach) leave the rest readable: the draft is
        # still examined and measured, and the tap checks say what is wrong with the ids.
        bare = _without_ids(dd)
        try:
            reading, _ = interop.read_foreign(bare, source, info, engine_version) if bare else (None, None)
        except EaglewireError:
            reading = None
        if reading is None:
            return Subject(path=p, dd=dd, kind=source or "unknown", contract=None, recorded=False,
                           contract_from="unknown (the directory could not be read as any format)", config=None,
                           load_error=str(e))
        ids_error = str(e)
    if ids_error:
        contract, where = None, "unknown: its layer ids do not read as taps (DRAFT_UNREADABLE says why)"
    elif reading.ids is not None:
        contract, where = reading.contract, (f"inferred from the {reading.source} convention '{reading.convention}' "
                                             f"(ids {reading.ids} at {reading.ids_where})")
    else:
        contract, where = reading.contract, (f"unknown: no layer ids in config.json (the {reading.source} default "
                                             f"taps {list(reading.contract.taps)} assumed)")
    c = reading.config
    s = Subject(path=p, dd=dd, kind=reading.source, contract=contract, recorded=False, contract_from=where, config=c,
                recorded_target={"hidden_size": c.target_hidden_size, "vocab_size": c.vocab_size},
                notes=[n for n in reading.notes if not (ids_error and IDS_KEY in n)], load_error=ids_error)
    try:
        s.draft = build_draft(reading, embedding=info.embedding if info else None)
    except EaglewireError as e:
        if target is not None and target.hidden_size not in (None, c.target_hidden_size):  # TARGET_MISMATCH says it
            s.notes.append(f"the draft is not built on this target: it reads hidden states {c.target_hidden_size} "
                           f"wide, the target's are {target.hidden_size}")
        else:
            s.load_error = "; ".join(x for x in (ids_error, str(e)) if x)
    return s


def _without_ids(dd: DraftDir) -> DraftDir | None:
    """The directory as read with its layer ids removed (None: it has none)."""
    cfg = json.loads(json.dumps(dd.config))
    nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    if IDS_KEY not in cfg and IDS_KEY not in nested:
        return None
    cfg.pop(IDS_KEY, None)
    nested.pop(IDS_KEY, None)
    return dataclasses.replace(dd, config=cfg)
