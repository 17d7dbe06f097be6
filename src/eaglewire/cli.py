"""The `eaglewire` command line. Each subcommand lives in its own module, listed in COMMANDS.

A command module exposes `register(subparsers)`, which adds its parser and sets `func` to a
callable taking the parsed args and returning an exit code. User mistakes raise EaglewireError
and are printed here as one line, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import __version__
from .errors import EaglewireError

# name -> module; the CLI's choices derive from this table.
COMMANDS: dict[str, str] = {
    "prepare": "eaglewire.commands",
    "taps": "eaglewire.commands",
    "datagen": "eaglewire.data.cli",
    "train": "eaglewire.train.cli",
    "generate": "eaglewire.decode.generate",
    "bench": "eaglewire.bench.cli",
    "export": "eaglewire.interop.cli",
    "import": "eaglewire.interop.cli",
    "doctor": "eaglewire.doctor",
    "serve-check": "eaglewire.engines.serve_check",
    "demo": "eaglewire.demo",
    "recipe": "eaglewire.recipes",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglewire", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"eaglewire {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in dict.fromkeys(COMMANDS.values()):  # a module may register several commands
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except EaglewireError as e:
        print(f"eaglewire {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"eaglewire {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:  # last: BrokenPipeError is an Exception too
        if not out_of_memory(e):
            raise
        print(f"eaglewire {args.command}: error: {oom_line(e, args.command)}", file=sys.stderr)
        return 1


# What shrinks a command's largest GPU allocation. A GPU shared with another job is the usual cause: two
# `recipe full` regenerations at once outgrow even a large GPU.
OOM_FIXES: dict[str, str] = {
    "recipe": "--gen-batch-tokens T (regeneration; 262144 ran beside two other jobs) or --set batch_tokens=N (training)",
    "datagen": "--gen-batch-tokens T (regeneration), --batch-size B (capture) or --gpu-memory-utilization F (vLLM)",
    "train": "--batch-tokens N",
    "serve-check": "--gpu-memory-utilization F",
}


def out_of_memory(e: BaseException) -> bool:
    torch = sys.modules.get("torch")  # every command that can run out of GPU memory has imported it
    return torch is not None and isinstance(e, torch.OutOfMemoryError)


def oom_line(e: BaseException, command: str) -> str:
    """torch's out-of-memory message cut to its first sentences (what was asked, what was free), and the fix."""
    msg = " ".join(str(e).split())
    cut = msg.find(" is free.")
    head = msg[:cut + len(" is free.")] if cut >= 0 else msg.split(". ")[0]
    fix = OOM_FIXES.get(command)
    return (f"{head} Another process may hold the GPU (nvidia-smi lists them): free it, "
            + (f"or make the batch smaller with {fix}" if fix else "or run with fewer prompts or tokens at once"))


if __name__ == "__main__":
    sys.exit(main())
