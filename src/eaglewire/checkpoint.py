"""The native draft checkpoint: a directory with `model.safetensors` and `config.json`.

config.json = {"format": "eaglewire-draft", "format_version": 1, "eaglewire_version", "git_commit",
"draft": DraftConfig.to_dict(), "taps": TapContract.to_dict(), "target": fingerprint,
"data_manifest_hash", "training", "metrics", "tap_stats"}. Weights are safetensors only: nothing
here ever unpickles. A checkpoint is written to a temporary directory and renamed into place, so
a directory that looks complete is complete.
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import __version__, files
from .draft import DraftConfig, Eagle3Draft
from .errors import TapError, UsageError
from .taps import TapContract
from .targets import compare_fingerprints
from .vocab import validate_vocab

FORMAT = "eaglewire-draft"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


@dataclass(frozen=True)
class DraftMeta:
    """Everything in a checkpoint's config.json, plus the parsed config and tap contract."""

    path: Path
    format: str
    format_version: int
    eaglewire_version: str | None
    git_commit: str | None
    draft: dict
    taps: dict
    target: dict
    data_manifest_hash: str | None
    training: dict | None
    metrics: dict | None
    tap_stats: dict | None
    config: DraftConfig
    contract: TapContract


def tap_stats(taps: torch.Tensor, num_taps: int) -> dict:
    """Per-tap activation statistics of (N, num_taps*H) (or (..., num_taps*H)) captured taps.

    A draft fed the wrong layers sees statistics unlike these (residual-stream magnitude grows
    with depth), which `doctor` can compare against a live capture.
    """
    x = taps.detach().reshape(-1, taps.shape[-1])
    if x.shape[-1] % num_taps:
        raise UsageError(f"tap statistics: width {x.shape[-1]} is not a multiple of {num_taps} taps")
    H = x.shape[-1] // num_taps
    per_tap = []
    for i in range(num_taps):
        s = sq = tok_rms = 0.0
        amax = 0.0
        for chunk in x[:, i * H:(i + 1) * H].split(65536):  # bounded fp32 memory on long captures
            c = chunk.float()
            s += c.sum(dtype=torch.float64).item()
            sq += c.pow(2).sum(dtype=torch.float64).item()
            tok_rms += c.pow(2).mean(-1).sqrt().sum(dtype=torch.float64).item()
            amax = max(amax, c.abs().max().item())
        n = max(x.shape[0] * H, 1)
        mean = s / n
        per_tap.append({"mean": mean, "std": math.sqrt(max(sq / n - mean * mean, 0.0)), "rms": math.sqrt(sq / n),
                        "abs_max": amax, "token_rms_mean": tok_rms / max(x.shape[0], 1)})
    return {"num_tokens": x.shape[0], "hidden_size": H, "per_tap": per_tap}


def _git_commit() -> str | None:
    """The source checkout's commit, only when eaglewire runs from its own git checkout."""
    pkg = Path(__file__).resolve().parent
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=pkg, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = top.stdout.split()
    if top.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() / "src" / "eaglewire" != pkg:
        return None  # an installed copy inside some other repository
    return lines[1]


def _jsonable(obj, field: str):
    """JSON-safe copy: tensors/numpy scalars to numbers, NaN/inf to null, tuples to lists."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v, f"{field}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v, field) for v in obj]
    if torch.is_tensor(obj):
        return _jsonable(obj.tolist(), field)
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        obj = obj.item()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    if isinstance(obj, Path):
        return str(obj)
    raise UsageError(f"checkpoint field {field}: {type(obj).__name__} is not JSON-serialisable")


def is_checkpoint(p: Path) -> bool:
    """Whether `p` holds a native checkpoint's config.json (its "format" says so); never raises."""
    try:
        raw = files.read_json(Path(p) / CONFIG, fix="")
    except UsageError:
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT


def _is_checkpoint_dir(p: Path) -> bool:
    return p.is_dir() and (not any(p.iterdir()) or is_checkpoint(p))


def _unwrap(model) -> Eagle3Draft:
    for attr in ("module", "_orig_mod"):  # DDP, torch.compile
        model = getattr(model, attr, model)
    if not isinstance(model, Eagle3Draft):
        raise UsageError(f"save_draft needs an Eagle3Draft, got {type(model).__name__}")
    return model


def save_draft(model, out_dir, *, contract: TapContract, target_fingerprint: dict,
               data_manifest_hash: str | None = None, training: dict | None = None,
               metrics: dict | None = None, tap_stats: dict | None = None) -> Path:
    """Write the draft to `out_dir` atomically (replacing an existing eaglewire checkpoint there)."""
    model = _unwrap(model)
    cfg = model.config
    out = Path(out_dir)
    if len(contract.taps) != cfg.num_taps:
        raise UsageError(f"tap contract has {len(contract.taps)} taps {list(contract.taps)}, the draft's fc reads "
                         f"num_taps={cfg.num_taps}")
    _check_target(target_fingerprint or {}, cfg, contract, str(out))
    validate_vocab(model.d2t, model.t2d, cfg.vocab_size, where=f"{out}: d2t/t2d")
    if out.exists() and not _is_checkpoint_dir(out):
        raise UsageError(f"{out}: exists and is not an eaglewire draft checkpoint; refusing to overwrite it")
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "eaglewire_version": __version__,
            "git_commit": _git_commit(), "draft": cfg.to_dict(), "taps": contract.to_dict(),
            "target": target_fingerprint or {}, "data_manifest_hash": data_manifest_hash, "training": training,
            "metrics": metrics, "tap_stats": tap_stats}
    text = json.dumps(_jsonable(meta, "config"), indent=2, allow_nan=False) + "\n"
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}

    with files.atomic_dir(out) as tmp:  # a failed rename puts the previous checkpoint back
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(text)
    return out


def _check_target(target: dict, cfg: DraftConfig, contract: TapContract, where: str) -> None:
    for key, want, what in (("hidden_size", cfg.target_hidden_size, "draft.target_hidden_size"),
                            ("vocab_size", cfg.vocab_size, "draft.vocab_size"),
                            ("num_layers", contract.num_layers, "taps.num_layers")):
        if target.get(key) is not None and target[key] != want:
            raise UsageError(f"{where}: target.{key} is {target[key]} but {what} is {want}: the draft and its "
                             "target fingerprint disagree")


def _err(where: str, field: str, msg: str) -> UsageError:
    return UsageError(f"{where}: {field}: {msg}")


def load_meta(path) -> DraftMeta:
    """Read and validate a checkpoint's config.json (no weights)."""
    root = Path(path)
    root = root.parent if root.name in (CONFIG, WEIGHTS) else root
    cfile = root / CONFIG
    if not cfile.is_file():
        raise UsageError(f"{root}: not an eaglewire draft checkpoint (no {CONFIG}); engine-format drafts must be "
                         "imported first")
    raw = files.read_json(cfile, fix="fix or replace the file (save or import the draft again)")
    if not isinstance(raw, dict):
        raise _err(str(cfile), "top level", f"expected a JSON object, got {type(raw).__name__}")
    if raw.get("format") != FORMAT:
        raise _err(str(cfile), "format", f"is {raw.get('format')!r}, expected {FORMAT!r} (an engine-format draft "
                   "must be imported first)")
    version = raw.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise _err(str(cfile), "format_version", f"is {version!r}; this eaglewire reads version {FORMAT_VERSION} "
                   "(upgrade eaglewire for newer checkpoints)")
    missing = [k for k in ("draft", "taps", "target") if not isinstance(raw.get(k), dict)]
    if missing:
        raise _err(str(cfile), ", ".join(missing), "missing or not an object")
    try:
        config = DraftConfig.from_dict(raw["draft"])
    except UsageError as e:
        raise _err(str(cfile), "draft", str(e)) from None
    try:
        contract = TapContract.from_dict(raw["taps"])
    except TapError as e:
        raise _err(str(cfile), "taps", str(e)) from None
    if len(contract.taps) != config.num_taps:
        raise _err(str(cfile), "taps", f"{len(contract.taps)} taps {list(contract.taps)} but draft.num_taps is "
                   f"{config.num_taps} (the fc input holds num_taps x target_hidden_size)")
    _check_target(raw["target"], config, contract, str(cfile))
    return DraftMeta(path=root, format=FORMAT, format_version=version,
                     eaglewire_version=raw.get("eaglewire_version"), git_commit=raw.get("git_commit"),
                     draft=raw["draft"], taps=raw["taps"], target=raw["target"],
                     data_manifest_hash=raw.get("data_manifest_hash"), training=raw.get("training"),
                     metrics=raw.get("metrics"), tap_stats=raw.get("tap_stats"), config=config, contract=contract)


def expected_shapes(config: DraftConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Eagle3Draft(config).state_dict().items()}


def draft_from_tensors(config: DraftConfig, tensors: dict[str, torch.Tensor], *, where: str,
                       config_name: str = "config.json", check_vocab: bool = True) -> Eagle3Draft:
    """An Eagle3Draft (eval mode) holding exactly `tensors`, not copied. The names must be the draft's and
    the shapes fit `config`, else one UsageError naming `where` and the tensors (`config_name` says where
    the config came from). With `check_vocab`, d2t/t2d are validated too (a foreign reader validates its
    own).
    Every native checkpoint and every imported draft is built here."""
    want = expected_shapes(config)
    missing, unexpected = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or unexpected:
        raise UsageError(f"{where}: tensors do not match {config_name}: missing {missing or 'none'}, "
                         f"unexpected {unexpected or 'none'}")
    c = config
    if tuple(tensors["fc.weight"].shape) != want["fc.weight"]:  # the tap count is the likeliest mistake: say so
        raise UsageError(f"{where}: fc.weight has shape {tuple(tensors['fc.weight'].shape)}, {config_name} says "
                         f"({c.hidden_size}, {c.fc_in_features}) = (hidden_size, num_taps {c.num_taps} x "
                         f"target_hidden_size {c.target_hidden_size})")
    wrong = [f"{k} {tuple(t.shape)} != {want[k]}" for k, t in tensors.items() if tuple(t.shape) != want[k]]
    if wrong:
        raise UsageError(f"{where}: tensor shapes disagree with {config_name}: {'; '.join(wrong)}")
    if check_vocab:
        validate_vocab(tensors["d2t"], tensors["t2d"], c.vocab_size, where=f"{where}: d2t/t2d")
    with torch.device("meta"):
        model = Eagle3Draft(c)
    model.load_state_dict(tensors, strict=True, assign=True)  # keeps each parameter's requires_grad
    return model.eval()


def load_draft(path, device="cpu", dtype: torch.dtype | None = None) -> tuple[Eagle3Draft, DraftMeta]:
    """Load and validate a native checkpoint. dtype casts the floating weights (None: as stored)."""
    meta = load_meta(path)
    wfile = meta.path / WEIGHTS
    if not wfile.is_file():
        raise UsageError(f"{meta.path}: no {WEIGHTS} (eaglewire reads safetensors weights only, never pickle)")
    tensors = files.read_safetensors(wfile, fix="save or import the draft again")
    model = draft_from_tensors(meta.config, tensors, where=str(wfile))
    model.to(device=device, dtype=dtype)  # dtype None: as stored; integer buffers are never cast
    return model, meta


# Whether a draft fits a target is a question about the two checkpoints, asked by the decoder, the trainer
# (a draft trained further) and the recipes alike: it lives with the checkpoint, not in any one of them.

# Fingerprint fields a draft can differ in and still run (a fine-tuned or re-quantized target, another
# chat template): a warning, an error with strict. Any other difference is always an error.
SOFT_FIELDS = ("weights_hash", "chat_template_hash", "architecture", "model_type", "tokenizer_hash")


def check_pair(target, draft, meta, strict: bool = False) -> list[str]:
    """Raise UsageError if the draft cannot run on the target; return the softer differences."""
    where = f"draft {meta.path}"
    c, tcfg = draft.config, target.config
    if meta.contract.num_layers != target.num_layers:
        raise UsageError(f"{where} reads taps {list(meta.contract.taps)} of a {meta.contract.num_layers}-layer "
                         f"target, but target {target.spec} has {target.num_layers} layers: wrong target for "
                         "this draft")
    for name, want, found in (("target_hidden_size", c.target_hidden_size, tcfg.hidden_size),
                              ("vocab_size", c.vocab_size, tcfg.vocab_size)):
        if want != found:
            raise UsageError(f"{where}: draft.{name} is {want} but target {target.spec} has {found}: "
                             "wrong target for this draft")
    soft = []
    for key, want in meta.target.items():
        for line in compare_fingerprints({key: want}, target.fingerprint, where):
            if key not in SOFT_FIELDS:
                raise UsageError(f"{line}: wrong target for this draft")
            soft.append(line)
    if soft and strict:
        raise UsageError(soft[0] + " (strict: a fingerprint mismatch is an error)")
    return soft
