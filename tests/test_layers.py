"""The package imports only downward (docs/ARCHITECTURE.md, "Layers"): every `import` and `from ... import`
in src/eaglewire, at module level or inside a function, names a module of a lower layer, or of the same
layer where the layer is the core or both sit in one package. A stage that reaches up (the data stage into
the benchmarks, the core into a stage) fails here, with the line that does it."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "src" / "eaglewire"

# Layer of each top-level module or package of eaglewire, lowest first. Copied in docs/ARCHITECTURE.md.
LAYERS = {
    **dict.fromkeys(["errors", "files", "registry", "taps", "parallel", "stats"], 0),  # foundations
    **dict.fromkeys(["targets", "capture", "chat", "prompts", "vocab", "draft_config", "draft", "checkpoint",
                     "cli_args"], 1),  # the core: the target, the draft, the artefacts
    "runtime": 2,  # running models at fixed shapes, sampling: what decode and data both stand on
    "decode": 3,
    "interop": 4,
    "data": 5,
    **dict.fromkeys(["train", "bench"], 6),
    "doctor": 7,
    "engines": 8,
    **dict.fromkeys(["recipes", "demo", "commands", "cli"], 9),  # the command line
    "__init__": 0,  # the package's face holds its version only
}
APP = 9
SAME_LAYER_OK = {0, 1, APP}  # the foundations, the core and the command line are flat: they may share a layer


def _layer(dotted: str) -> int:
    """A package's `cli` module (its command line) sits on top with the app, whatever its package's layer."""
    return APP if dotted.split(".")[-1] == "cli" else LAYERS[_top(dotted)]


def _top(dotted: str) -> str:
    return dotted.split(".")[0] if dotted else "__init__"


def _module(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    p = PKG.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _imports(path: Path):
    """(line, eaglewire module imported) for every import of an eaglewire module in the file ("" = the package
    eaglewire itself, which is the command line's layer)."""
    me = _module(path)
    pkg = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    pkg = [p for p in pkg if p]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "eaglewire":
                mod = node.module.removeprefix("eaglewire").lstrip(".")
            else:
                continue
            subs = [f"{mod}.{a.name}" if mod else a.name for a in node.names]
            for sub in subs:  # `from pkg import x`: x a module of pkg, or a name defined in pkg
                yield node.lineno, sub if _is_module(sub) else mod
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("eaglewire."):
                    yield node.lineno, a.name.removeprefix("eaglewire.")


def test_every_module_has_a_layer():
    tops = {_top(_module(p)) for p in PKG.rglob("*.py")}
    assert tops <= set(LAYERS), sorted(tops - set(LAYERS))


def test_imports_point_down():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        me = _module(path)
        mine = _layer(me)
        for line, mod in _imports(path):
            theirs = _layer(mod)
            if theirs < mine or _top(mod) == _top(me) or (theirs == mine and mine in SAME_LAYER_OK):
                continue
            bad.append(f"{path.relative_to(PKG.parent)}:{line}: {me or 'eaglewire'} (layer {mine}) imports "
                       f"{mod} (layer {theirs})")
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule itself: a core module importing a stage is caught (a test that cannot fail is a defect)."""
    fake = PKG / "taps.py"
    src = fake.read_text()
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (src + "\nfrom .bench import run\n")
                        if self == fake else Path.read_bytes(self).decode())
    try:
        test_imports_point_down()
    except AssertionError as e:
        assert "taps (layer 0) imports bench.run (layer 6)" in str(e)
    else:
        raise AssertionError("an upward import went unnoticed")


# Packages that may not import another although it sits below them. The data and training stages borrow the
# runtime (runners, K/V slots, sampling), never the speculative decoder: they must not change when it does.
NEVER = {"data": {"decode"}, "train": {"decode"}}


def test_data_and_train_never_import_the_decoder():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        me = _module(path)
        for line, mod in _imports(path):
            if _top(mod) in NEVER.get(_top(me), ()):
                bad.append(f"{path.relative_to(PKG.parent)}:{line}: {me} imports {mod}")
    assert not bad, "stages that reach into the decoder (use runtime/ instead):\n" + "\n".join(bad)


def test_the_check_sees_data_importing_the_decoder(monkeypatch):
    """The rule itself: a data module importing decode/ is caught, though decode sits below data."""
    fake = PKG / "data" / "shards.py"
    src = fake.read_text()
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (src + "\nfrom ..decode.decoder import SpecDecoder\n")
                        if self == fake else Path.read_bytes(self).decode())
    test_imports_point_down()  # downward, so the layers allow it
    try:
        test_data_and_train_never_import_the_decoder()
    except AssertionError as e:
        assert "data.shards imports decode.decoder" in str(e)
    else:
        raise AssertionError("data importing the decoder went unnoticed")
