"""Interop: export native drafts to SGLang / vLLM / speculators, import drafts from every ecosystem format.

FORMATS (a plain dict; the CLI's choices derive from it) maps a format name to what eaglewire can
do with it. Detection looks at config.json and the weight names. The files may admit several
readings: a plain config with top-level ids could be vLLM or SpecForge-style, and SGLang's meaning
of ids for DeepSeek-family targets depends on its version. Then every plausible reading is computed,
and `--source` (or `--engine-version`) is required only when they disagree.

Layout: one adapter per format, all of one signature (adapters.py over sglang.py, vllm.py,
specforge.py, eagle.py, modelopt.py); readers.py detects, reads and chooses; convert.py exports and
imports; common.py is what they share. This module only names the public API.
"""

from __future__ import annotations

from ..taps import CONVENTIONS
from . import common, serve, sglang, vllm
from .convert import ExportResult, export_draft, import_draft
from .engine_view import EngineView, FlagView
from .readers import (ENGINES, EXPORT_FORMATS, FORMATS, ImportMeta, TargetInfo, detect, load_any, load_target_info,
                      read_engine_view, read_foreign)

__all__ = ["FORMATS", "EXPORT_FORMATS", "ENGINES", "EngineView", "FlagView", "ImportMeta", "TargetInfo",
           "ExportResult", "detect", "export_draft", "import_draft", "load_any", "read_engine_view", "read_foreign",
           "load_target_info", "CONVENTIONS", "common", "serve", "sglang", "vllm"]
