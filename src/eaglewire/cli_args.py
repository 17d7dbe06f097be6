"""The flags several commands share, each added one way: name, type, choices and default live here.

A command passes its own help text where the flag means something narrower there (bench's --device,
doctor's --target); the defaults below are what most commands say.
"""

from __future__ import annotations

import argparse

from . import targets

TARGET_HELP = f"registry name ({', '.join(targets.REGISTRY)}), HF model directory or .gguf file"
DEFAULT_TARGET_HELP = f"target (default {targets.DEFAULT_TARGET})"
DEVICE_HELP = "cuda, cuda:1, cpu (default: cuda if available)"
TAPS_HELP = "canonical taps, comma-separated (default: 2,N//2,N-3)"


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
    p.add_argument("--max-prompts", type=int, default=None, metavar=metavar, help=help)


def add_sampling(p, *, top_k: bool = True, top_p_help: str | None = None, top_k_help: str | None = None) -> None:
    """--temperature (0: greedy), --top-p (1: off) and, with top_k, --top-k (0: off), as SamplingParams reads them."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help=top_p_help)
    if top_k:
        p.add_argument("--top-k", type=int, default=0, help=top_k_help)


def _fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        f = -1.0
    if not 0.0 < f <= 1.0:
        raise argparse.ArgumentTypeError(f"{text}: give the share of the GPU's memory the engine may take, in (0, 1]")
    return f


def add_gpu_memory(p, *, help: str) -> None:
    """--gpu-memory-utilization, vLLM's own flag and meaning (SGLang's mem_fraction_static under serve-check); None:
    the job's default (engines/vllm.py, engines/sglang.py)."""
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="F", help=help)
