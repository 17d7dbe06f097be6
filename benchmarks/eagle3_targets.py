"""Which target classes an SGLang or vLLM release can run an EAGLE-3 draft on, read from its source.

    python benchmarks/eagle3_targets.py sglang|vllm SITE [--json FILE]

SITE is a folder holding the `sglang` or `vllm` package (a venv's site-packages, or an unpacked wheel). The source
is walked without importing it (both engines need CUDA); each class's bases are followed across files by name.
- SGLang loads the class its registry names for the target's architectures (an unknown one through
  TransformersForCausalLM) and calls `set_eagle3_layers_to_capture` on it for any EAGLE-3 draft: a class without
  that method stops SGLang at start-up. Listed: each srt/models EntryClass, with the file whose setter it runs.
- vLLM loads the class model_executor/models/registry.py names (an unregistered one through its Transformers
  backend, which has EAGLE-3) and refuses an EAGLE-3 draft on a class that is not SupportsEagle3. Listed: each
  text-generation and multimodal architecture, with the file whose class supports it.
eaglewire.interop.sglang.EAGLE3_TARGETS and eaglewire.interop.vllm.NO_EAGLE3 hold 0.5.17's and 0.26.0's answers;
run this on a new release before changing them. How each family reads the ids is in eaglewire.taps.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

SGLANG_SETTER = "set_eagle3_layers_to_capture"
VLLM_MARKS = ("SupportsEagle3",)  # the protocol vLLM's supports_eagle3() checks (models/interfaces.py)
VLLM_TABLES = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS")  # registry.py: the targets a draft can serve


def _classes(files) -> dict[str, list[tuple[str, list[str], set[str]]]]:
    """Class name -> [(file stem, base names, method names)] over `files`."""
    out: dict[str, list] = {}
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8-sig"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", None) for b in node.bases]
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                out.setdefault(node.name, []).append((path.stem, bases, methods))
    return out


def _found(classes, name: str, has, seen: tuple[str, ...] = ()) -> str | None:
    """The file of the first class in `name`'s bases (itself first) for which has(bases, methods) holds."""
    for module, bases, methods in classes.get(name, []) if name not in seen else []:
        if has(bases, methods):
            return module
        for base in bases:
            hit = _found(classes, base, has, seen + (name,)) if base else None
            if hit:
                return hit
    return None


def scan_sglang(site: Path) -> dict[str, str | None]:
    """EntryClass name -> the module whose class defines the setter it runs (None: no setter)."""
    models = site / "sglang" / "srt" / "models"
    files = sorted(models.glob("*.py"))
    entries: list[str] = []
    for path in files:
        for node in ast.parse(path.read_text(encoding="utf-8-sig")).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EntryClass" for t in node.targets):
                items = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                entries += [item.id for item in items if isinstance(item, ast.Name)]
    classes = _classes(files)
    return {name: _found(classes, name, lambda bases, methods: SGLANG_SETTER in methods) for name in entries}


def scan_vllm(site: Path) -> dict[str, str | None]:
    """Registered architecture -> the module whose class makes it SupportsEagle3 (None: not supported)."""
    registry = (site / "vllm" / "model_executor" / "models" / "registry.py").read_text()
    archs: dict[str, str] = {}
    for table in VLLM_TABLES:
        body = registry[registry.index(f"{table} = {{"):]
        body = body[:body.index("\n}\n")]
        archs.update((a, c) for a, _, c in re.findall(r'"(\w+)":\s*\(\s*"([\w.]+)",\s*"(\w+)"', body))
    classes = _classes(sorted((site / "vllm").rglob("*.py")))

    def marked(bases, methods) -> bool:
        return any(b in VLLM_MARKS for b in bases)

    return {arch: _found(classes, cls, marked) for arch, cls in archs.items()}


SCANS = {"sglang": (scan_sglang, ("sglang", "srt", "models"), "set_eagle3_layers_to_capture"),
         "vllm": (scan_vllm, ("vllm", "model_executor", "models"), "SupportsEagle3")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", choices=sorted(SCANS))
    ap.add_argument("site", type=Path, help="a folder holding the engine's package")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = ap.parse_args(argv)
    scan, where, what = SCANS[args.engine]
    if not args.site.joinpath(*where).is_dir():
        print(f"{args.site}: no {'/'.join(where)} in it; pass the folder that holds the {args.engine} package",
              file=sys.stderr)
        return 2
    found = scan(args.site)
    width = max(map(len, found), default=0)
    for name, module in sorted(found.items(), key=lambda kv: (kv[1] is None, kv[0])):
        print(f"{name:<{width}}  {module + '.py' if module else 'no ' + what}")
    print(f"{sum(m is not None for m in found.values())} of {len(found)} target classes have {what}")
    if args.json:
        args.json.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
