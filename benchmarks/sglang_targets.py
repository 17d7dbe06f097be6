"""Which target classes an SGLang release can run an EAGLE-3 draft on, read from its source.

    python benchmarks/sglang_targets.py SITE [--json FILE]

SITE is a folder holding the `sglang` package (a venv's site-packages, or an unpacked wheel). SGLang loads the
class its registry names for the target's architectures (an unknown one through TransformersForCausalLM) and calls
`set_eagle3_layers_to_capture` on it for any EAGLE-3 draft; a class without that method stops SGLang at start-up.
This walks srt/models/*.py without importing it (SGLang needs CUDA) and prints each EntryClass with the file
whose setter it runs, its own or inherited. eaglewire.interop.sglang.EAGLE3_TARGETS holds 0.5.17's list; run this on
a new release before changing it. It lists only the method: how each family reads the ids is in eaglewire.taps.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

SETTER = "set_eagle3_layers_to_capture"


def scan(models: Path) -> dict[str, str | None]:
    """EntryClass name -> the module whose class defines the setter it runs (None: no setter)."""
    classes: dict[str, list[tuple[str, list[str], bool]]] = {}
    entries: list[str] = []
    for path in sorted(models.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8-sig"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", None) for b in node.bases]
                own = any(isinstance(f, ast.FunctionDef) and f.name == SETTER for f in node.body)
                classes.setdefault(node.name, []).append((path.stem, bases, own))
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EntryClass" for t in node.targets):
                value = node.value
                items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
                entries += [item.id for item in items if isinstance(item, ast.Name)]

    def setter(name: str, seen: tuple[str, ...] = ()) -> str | None:
        for module, bases, own in classes.get(name, []) if name not in seen else []:
            if own:
                return module
            for base in bases:
                found = setter(base, seen + (name,)) if base else None
                if found:
                    return found
        return None

    return {name: setter(name) for name in entries}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("site", type=Path, help="a folder holding the sglang package")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = ap.parse_args(argv)
    models = args.site / "sglang" / "srt" / "models"
    if not models.is_dir():
        print(f"{args.site}: no sglang/srt/models in it; pass the folder that holds the sglang package",
              file=sys.stderr)
        return 2
    found = scan(models)
    width = max(map(len, found), default=0)
    for name, module in sorted(found.items(), key=lambda kv: (kv[1] is None, kv[0])):
        print(f"{name:<{width}}  {'models/' + module + '.py' if module else 'no ' + SETTER}")
    print(f"{sum(m is not None for m in found.values())} of {len(found)} target classes have {SETTER}")
    if args.json:
        args.json.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
