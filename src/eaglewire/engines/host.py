"""The target as this process knows it when an engine runs it elsewhere: its config, tokenizer, fingerprint
and final norm, without its weights in memory.

A target that does not fit one GPU (the Kimi-K2.5 class) is only ever loaded by the engine, across GPUs. What
eaglewire itself needs of it is small. It needs the tokenizer (chat templates, loss masks) and the
fingerprint every artefact records (`targets.fingerprint`). That is computed here from the weight files
tensor by tensor, so it equals the one a loaded model gives. It needs the final norm, which turns the
engine's pre-norm last state into the post-norm state the shards store. The model is built on the meta
device: names and shapes, no memory.
"""

from __future__ import annotations

import hashlib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import targets
from ..capture import locate
from ..errors import UsageError


class WeightFiles:
    """Tensors by name from a model directory's safetensors files, read one at a time."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise UsageError(f"--target {path}: no *.safetensors weights (the engine path reads them by name)")
        self._stack = ExitStack()
        self._where = {}
        for f in files:
            h = self._stack.enter_context(safe_open(str(f), framework="pt"))
            self._where.update({k: h for k in h.keys()})

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def close(self) -> None:
        self._stack.close()


@dataclass
class HostTarget(targets.Target):
    """A targets.Target whose model lives on the meta device; `norm` is the real final norm on the CPU."""

    norm: torch.nn.Module | None = None


def _source_names(model: torch.nn.Module) -> dict[str, list[str]]:
    """state_dict name -> every name of the same tensor (tied weights are stored under one of them)."""
    by_id: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), []).append(name)
    return {n: names for names in by_id.values() for n in names}


def weights_hash(model: torch.nn.Module, files: WeightFiles) -> str:
    """targets.weights_hash of the model these files hold, read tensor by tensor."""
    h, aliases = hashlib.sha256(), _source_names(model)
    for name, p in sorted(model.state_dict().items()):
        if not p.is_floating_point():
            continue
        stored = next((a for a in aliases[name] if a in files), None)
        if stored is None:
            raise UsageError(f"the target's weight files hold no {name!r}: not a complete model directory")
        h.update(name.encode())
        targets._hash_tensor(h, files.get(stored))
    return h.hexdigest()[:16]


def host_target(spec: str) -> HostTarget:
    """The target `spec` (registry name or model directory) without loading its weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = targets.resolve(spec)
    if path.suffix == ".gguf":
        raise UsageError(f"--target {spec}: an engine loads Hugging Face model directories; `eaglewire prepare` "
                         "writes one for a registry target")
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()
    tok = AutoTokenizer.from_pretrained(path)
    files = WeightFiles(path)
    try:
        fp = targets.fingerprint(model, tok, weights=weights_hash(model, files))
        norm_name = next(n for n, m in model.named_modules() if m is locate(model).norm)
        norm = locate(model).norm.to_empty(device="cpu")
        state = {k: files.get(next(a for a in _source_names(model)[f"{norm_name}.{k}"] if a in files)).float()
                 for k in norm.state_dict()}
        norm.load_state_dict(state)
    finally:
        files.close()
    return HostTarget(spec=spec, model=model, tokenizer=tok, fingerprint=fp, norm=norm.float().eval())
