"""The flags several commands share, each added one way: name, type, choices and default live here, and the
argparse types every numeric flag of every command takes.

A command passes its own help text where the flag means something narrower there (bench's --device,
doctor's --target); the defaults below are what most commands say.
"""

from __future__ import annotations

import argparse
import math

from . import targets

TARGET_HELP = f"registry name ({', '.join(targets.REGISTRY)}), HF model directory or .gguf file"
DEFAULT_TARGET_HELP = f"target (default {targets.DEFAULT_TARGET})"
DEVICE_HELP = "cuda, cuda:1, cpu (default: cuda if available)"
TAPS_HELP = "canonical taps, comma-separated (default: 2,N//2,N-3)"


def _checked(kind: type, ok, must: str):
    """An argparse type: `kind` of the text, refused (a usage error naming the flag, exit 2) unless ok(value)."""
    def check(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or (kind is float and not math.isfinite(v)) or not ok(v):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be {must}")
        return v
    return check


# Every count, size, budget or rate flag takes one of these (tests/test_cli_args.py walks the parsers), so a
# value that cannot make sense stops at parse time, not after the target has loaded.
positive_int = _checked(int, lambda v: v >= 1, "an integer >= 1")
nonneg_int = _checked(int, lambda v: v >= 0, "an integer >= 0")  # where 0 has a meaning its help gives
positive_float = _checked(float, lambda v: v > 0, "a number > 0")
nonneg_float = _checked(float, lambda v: v >= 0, "a number >= 0")
fraction = _checked(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
ratio = _checked(float, lambda v: 0 <= v < 1, "a number in [0, 1)")


def int_at_least(low: int):
    return _checked(int, lambda v: v >= low, f"an integer >= {low}")


_gpu_share = _checked(float, lambda v: 0 < v <= 1, "the share of the GPU's memory the engine may take, in (0, 1]")


def add_target(p, *, required: bool = True, default: str | None = targets.DEFAULT_TARGET,
               help: str = TARGET_HELP) -> None:
    """--target: a registry name, model directory or .gguf file. Not required: `default` (the embedded
    default target unless a command has none)."""
    p.add_argument("--target", required=required, default=None if required else default, help=help)


def add_device(p, help: str = DEVICE_HELP) -> None:
    p.add_argument("--device", default=None, help=help)


def add_dtype(p, help: str) -> None:
    """--dtype the models run in, a name of targets.DTYPES; None: the device's default (targets.dtype_of)."""
    p.add_argument("--dtype", choices=list(targets.DTYPES), default=None, help=help)


def add_taps(p, help: str = TAPS_HELP) -> None:
    """--taps: canonical taps as taps.parse_taps reads them; None: the default."""
    p.add_argument("--taps", default=None, help=help)


def add_draft(p, *, required: bool, help: str, metavar: str | None = None) -> None:
    p.add_argument("--draft", required=required, default=None, metavar=metavar, help=help)


def add_suite(p, *, default: str | None, help: str, metavar: str | None = None) -> None:
    """--suite: a bench suite's name (suites.SUITES) or a prompt FILE."""
    p.add_argument("--suite", default=default, metavar=metavar, help=help)


def add_max_prompts(p, *, help: str | None = None, metavar: str | None = None) -> None:
    p.add_argument("--max-prompts", type=positive_int, default=None, metavar=metavar, help=help)


def add_sampling(p, *, top_k: bool = True, top_p_help: str = "1 = off (default)",
                 top_k_help: str = "0 = off (default)") -> None:
    """--temperature (0: greedy), --top-p (1: off) and, with top_k, --top-k (0: off), as SamplingParams reads them."""
    p.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=fraction, default=1.0, help=top_p_help)
    if top_k:
        p.add_argument("--top-k", type=nonneg_int, default=0, help=top_k_help)


def add_gpu_memory(p, *, help: str) -> None:
    """--gpu-memory-utilization, vLLM's own flag and meaning (SGLang's mem_fraction_static under serve-check); None:
    the job's default (engines/vllm.py, engines/sglang.py)."""
    p.add_argument("--gpu-memory-utilization", type=_gpu_share, default=None, metavar="F", help=help)
