"""Export and import: a native checkpoint out to an engine's format through its adapter, any format in
to a native checkpoint; each verified by reading the result back with our own importer.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import save_file

from .. import checkpoint, files
from ..errors import EaglewireError, UsageError
from . import serve
from .adapters import ADAPTERS, ExportRequest
from .common import CONFIG, SERVE, WEIGHTS, assert_same_draft
from .readers import EXPORT_FORMATS, ImportMeta, TargetInfo, load_any


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
    model, meta = checkpoint.load_draft(draft)
    if model.config.hidden_act != "silu":  # SGLang llama.py:104-107, vLLM llama.py:109-111: LlamaMLP refuses others
        raise UsageError(f"--draft {draft}: hidden_act {model.config.hidden_act!r}: SGLang and vLLM build an EAGLE-3 "
                         "draft's MLP with silu only and refuse it at load; retrain with silu")
    out = Path(out)
    target = dict(meta.target)
    target.setdefault("num_layers", meta.contract.num_layers)
    imported = (meta.training or {}).get("imported_from") if isinstance(meta.training, dict) else None
    carried = (imported or {}).get("carried") if isinstance(imported, dict) else None
    request = ExportRequest(fmt=fmt, out=out, engine_version=engine_version, spec=spec or serve.SpecArgs(),
                            target_path=target_path, carried=carried if isinstance(carried, dict) else {})
    x = ADAPTERS[fmt].export(model, meta.contract, target, request)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out}: exists and is not empty; choose a new --out directory")
    with files.atomic_dir(out) as tmp:
        save_file(x.tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(x.config, indent=2) + "\n")
        (tmp / SERVE).write_text(x.serve_text)
        reloaded, rmeta = load_any(tmp, target=TargetInfo(fingerprint=target))  # read back as an importer would
        if rmeta.contract != meta.contract:
            raise EaglewireError(f"export check: {fmt} ids {x.ids} read back as taps {list(rmeta.contract.taps)}, "
                                 f"not {list(meta.contract.taps)}")
        assert_same_draft(model, reloaded, f"export check ({fmt})")
    return ExportResult(out=out, format=fmt, ids=x.ids, convention=x.convention, serve_text=x.serve_text,
                        notes=x.notes)


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
