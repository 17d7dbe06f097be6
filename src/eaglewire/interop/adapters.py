"""One adapter per source format, every one of the same signature (the way speculators'
convert/entrypoints.py picks one converter per algorithm):

    read(dd, facts)                          -> every plausible Reading of the directory
    export(model, contract, target, request) -> Exported (config, tensors, ids, SERVE.md), or None: import only
    view(dd, facts)                          -> EngineView, for the formats an engine serves, else None

`facts` is the same for every source; an adapter uses what its format needs (SGLang: the target's
model_type and the engine version; the others: the layer count and vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import EaglewireError
from . import eagle, modelopt, serve, sglang, specforge, vllm
from .common import DraftDir, Reading
from .engine_view import EngineView


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What an adapter is told about the target (and the engine release), the same for every source."""

    num_layers: int | None
    vocab_size: int | None = None
    model_type: str | None = None
    engine_version: str | None = None


@dataclass(frozen=True, kw_only=True)
class ExportRequest:
    fmt: str
    out: Path
    engine_version: str | None
    spec: serve.SpecArgs
    target_path: str | None
    carried: dict = field(default_factory=dict)  # Reading.carried of the draft's import, if it was imported


@dataclass(frozen=True, kw_only=True)
class Exported:
    """What an export writes (config.json, the weights, SERVE.md) and says (ids, convention, notes)."""

    config: dict
    tensors: dict
    ids: list[int]
    convention: str
    notes: list[str] = field(default_factory=list)
    serve_text: str = ""


@dataclass(frozen=True)
class Adapter:
    what: str
    read: Callable[[DraftDir, Facts], list[Reading]]
    export: Callable | None = None  # (model, contract, target, ExportRequest) -> Exported
    view: Callable[[DraftDir, Facts], EngineView] | None = None


# --- SGLang: its reading of ids depends on the release ---------------------------------------------

def _sglang_read(dd: DraftDir, f: Facts) -> list[Reading]:
    def at(version):
        return sglang.read(dd, model_type=f.model_type, num_layers=f.num_layers, vocab_size=f.vocab_size,
                           version=version)

    if f.engine_version:
        return [at(f.engine_version)]
    out, first_error = [], None
    for v in ("latest", "0.5.12"):  # the newest rules, and the last release before PR #25454
        try:
            out.append(at(v))
        except EaglewireError as e:
            first_error = first_error or e
    if not out:
        raise first_error
    return out


def _sglang_export(model, contract, target: dict, r: ExportRequest) -> Exported:
    cfg, tensors, ids, conv, notes = sglang.export(model, contract, target, r.engine_version, r.carried)
    text = serve.sglang_text(str(r.out), ids, conv, contract, target, r.engine_version or sglang.LATEST, r.spec,
                             r.target_path, notes, window=model.config.sliding_window)
    return Exported(config=cfg, tensors=tensors, ids=ids, convention=conv, notes=notes, serve_text=text)


def _sglang_view(dd: DraftDir, f: Facts) -> EngineView:
    return sglang.engine_view(dd, f.engine_version, f.model_type, f.num_layers)


# --- vLLM and the speculators library: one module, two readers of the same files ---------------------

def _vllm(engine: str) -> dict:
    def read(dd: DraftDir, f: Facts) -> list[Reading]:
        return [vllm.read(dd, engine=engine, num_layers=f.num_layers, vocab_size=f.vocab_size)]

    def export(model, contract, target: dict, r: ExportRequest) -> Exported:
        cfg, tensors, ids, conv, notes = vllm.export(model, contract, target, r.fmt, r.spec.num_steps, r.target_path,
                                                     r.carried)
        text = serve.vllm_text(str(r.out), ids, contract, target, r.spec.num_steps, r.fmt, r.target_path, notes)
        return Exported(config=cfg, tensors=tensors, ids=ids, convention=conv, notes=notes, serve_text=text)

    def view(dd: DraftDir, f: Facts) -> EngineView:
        return vllm.engine_view(dd, engine, f.num_layers)

    return dict(read=read, export=export, view=view)


# --- trainers' formats: read only ------------------------------------------------------------------

def _reader(mod) -> Callable[[DraftDir, Facts], list[Reading]]:
    def read(dd: DraftDir, f: Facts) -> list[Reading]:
        return [mod.read(dd, num_layers=f.num_layers, vocab_size=f.vocab_size)]

    return read


ADAPTERS: dict[str, Adapter] = {
    "sglang": Adapter("SGLang LlamaForCausalLMEagle3 (midlayer.*, nested eagle_config ids)", _sglang_read,
                      _sglang_export, _sglang_view),
    "vllm": Adapter("vLLM: speculators Eagle3Speculator config (top-level ids) served by vLLM; imports also read "
                    "vLLM's plain Eagle3LlamaForCausalLM configs", **_vllm("vllm")),
    "speculators": Adapter("vllm-project/speculators Eagle3Speculator (the library's loader)", **_vllm("speculators")),
    "specforge": Adapter("SpecForge LlamaForCausalLMEagle3 draft (output-of-layer ids)", _reader(specforge)),
    "eagle": Adapter("SafeAILab/EAGLE reference draft (hard-coded taps)", _reader(eagle)),
    "modelopt": Adapter("NVIDIA ModelOpt EAGLE-3 export (layers.0.*, d2t only)", _reader(modelopt)),
}
