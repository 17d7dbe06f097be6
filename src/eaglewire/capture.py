"""Capture taps from one target forward pass with hooks, without materialising all N+1 states.

tap k < N is the input of decoder layer k (a forward pre-hook); tap N is the output of the last
layer, i.e. the input of the final norm (pre-norm). The final-norm output and the logits are
captured on request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .errors import UnknownArchitectureError
from .taps import TapContract

# Where decoder stacks live, in the order tried. A multimodal wrapper (Kimi-K2.5, Llava, ...) keeps
# its language model one attribute down; a causal-LM head keeps the base model one more down.
_ROOTS = ("", "model", "transformer", "language_model", "model.language_model", "language_model.model",
          "model.text_model", "text_model")
_LAYERS = ("layers", "h", "blocks", "decoder.layers")
_EMBED = ("embed_tokens", "wte", "embeddings", "word_embeddings")
_NORM = ("norm", "ln_f", "final_layernorm", "final_norm")
_HEAD = ("lm_head", "language_model.lm_head", "output")


def _get(obj, dotted: str):
    for part in filter(None, dotted.split(".")):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@dataclass
class DecoderStack:
    """The parts of a target the draft cares about."""

    base: nn.Module  # runs embedding -> layers -> final norm
    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module | None

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def locate(model: nn.Module) -> DecoderStack:
    """Find the decoder stack of a HF causal LM (or a multimodal wrapper). Never guesses."""
    tried = []
    for root in _ROOTS:
        base = _get(model, root)
        if base is None:
            continue
        for name in _LAYERS:
            layers = _get(base, name)
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                embed = next((m for n in _EMBED if isinstance(m := _get(base, n), nn.Module)), None)
                norm = next((m for n in _NORM if isinstance(m := _get(base, n), nn.Module)), None)
                head = next((m for n in _HEAD if isinstance(m := _get(model, n), nn.Module)), None)
                if embed is None or norm is None:
                    missing = [w for w, m in (("token embedding", embed), ("final norm", norm)) if m is None]
                    raise UnknownArchitectureError(
                        f"{type(model).__name__}: found decoder layers at '{root or '.'}.{name}' but no "
                        f"{' or '.join(missing)} (looked for {_EMBED if embed is None else _NORM})")
                return DecoderStack(base, embed, layers, norm, head)
            tried.append(f"{root + '.' if root else ''}{name}")
    raise UnknownArchitectureError(
        f"{type(model).__name__}: no decoder layer list found (looked for {', '.join(tried) or 'any of ' + str(_ROOTS)}); "
        "eaglewire supports HF decoder LLMs whose layers sit in a ModuleList")


class _Stop(Exception):
    """Raised inside a hook once everything asked for is captured, to skip the remaining layers."""


def _first_tensor(x):
    return x[0] if isinstance(x, (tuple, list)) else x


class TapHooks:
    """Context manager that records the contract's taps during any forward of the target.

    with TapHooks(stack, contract) as hooks:
        model(input_ids, ...)
    hooks.taps  # (B, T, len(taps) * H), in contract order
    """

    def __init__(self, stack: DecoderStack, contract: TapContract, final_norm: bool = False,
                 stop_early: bool = False):
        if contract.num_layers != stack.num_layers:
            raise UnknownArchitectureError(f"tap contract is for {contract.num_layers} layers, target has "
                                           f"{stack.num_layers}")
        self.stack, self.contract, self.want_final = stack, contract, final_norm
        # Stopping early is only safe when nothing after the last tap is needed.
        self.stop_at = max(contract.taps) if stop_early and not final_norm and max(contract.taps) < stack.num_layers else None
        self._handles = []
        self._states: dict[int, torch.Tensor] = {}
        self.final: torch.Tensor | None = None

    def _pre(self, k):
        def hook(module, args, kwargs):
            self._states[k] = args[0] if args else kwargs["hidden_states"]
            if k == self.stop_at:
                raise _Stop
        return hook

    def _post_last(self, module, args, output):
        self._states[self.stack.num_layers] = _first_tensor(output)

    def _post_norm(self, module, args, output):
        self.final = _first_tensor(output)

    def __enter__(self):
        n = self.stack.num_layers
        for k in self.contract.taps:
            if k < n:
                self._handles.append(self.stack.layers[k].register_forward_pre_hook(self._pre(k), with_kwargs=True))
        if n in self.contract.taps:
            self._handles.append(self.stack.layers[n - 1].register_forward_hook(self._post_last))
        if self.want_final:
            self._handles.append(self.stack.norm.register_forward_hook(self._post_norm))
        self._states.clear()
        self.final = None
        return self

    def __exit__(self, exc_type, exc, tb):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return exc_type is _Stop  # swallow our own early stop

    @property
    def taps(self) -> torch.Tensor:
        missing = [k for k in self.contract.taps if k not in self._states]
        if missing:
            raise RuntimeError(f"taps {missing} were not captured: the forward did not run those layers")
        return torch.cat([self._states[k] for k in self.contract.taps], dim=-1)


@dataclass
class Captured:
    taps: torch.Tensor  # (B, T, len(taps) * H)
    final_hidden: torch.Tensor | None = None  # post-norm last hidden state (B, T, H)
    logits: torch.Tensor | None = None  # (B, T, V)


@torch.no_grad()
def capture(model: nn.Module, input_ids: torch.Tensor, contract: TapContract, attention_mask=None,
            final_norm: bool = False, logits: bool = False, stack: DecoderStack | None = None) -> Captured:
    """One forward pass of the target, returning the contract's taps (and, if asked, more)."""
    stack = stack or locate(model)
    with TapHooks(stack, contract, final_norm=final_norm or logits, stop_early=not logits) as hooks:
        if logits:
            out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        else:
            stack.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return Captured(hooks.taps, hooks.final, out.logits if logits else None)

