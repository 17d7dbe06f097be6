"""`eaglewire demo`: the whole pipeline on the embedded default target, on a CPU, in a few minutes.

prepare -> datagen + train (recipe demo) -> generate -> bench -> export for SGLang and vLLM ->
doctor on each export. Every step is the command a user would type; the demo only chains them.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path

from . import cli_args, targets
from .errors import EaglewireError
from .recipes import DEMO_PROMPTS

PROMPT = "Give me three tips for writing clear Python code."


def _step(title: str, argv: list[str], ok_codes=(0,)) -> int:
    from .cli import main

    print(f"\n=== {title}\n$ eaglewire {shlex.join(argv)}", flush=True)
    code = main(argv)
    sys.stdout.flush()
    if code not in ok_codes:
        raise EaglewireError(f"demo step '{title}' failed (exit {code}); see the output above")
    return code


def cmd_demo(args) -> int:
    out = Path(args.out)
    if out.exists():
        if not (out / ".eaglewire-demo").exists():
            raise EaglewireError(f"--out {out}: exists and was not made by `eaglewire demo`; choose another directory")
        shutil.rmtree(out)  # the demo's own previous run
    out.mkdir(parents=True)
    (out / ".eaglewire-demo").touch()
    t, run, draft = args.target, out / "recipe", out / "recipe" / "draft"
    prompts = DEMO_PROMPTS

    _step("prepare the embedded default target", ["prepare", t] if t in targets.REGISTRY else ["taps", "--target", t])
    _step("the taps a draft of this target reads, in every engine's words", ["taps", "--target", t])
    _step("regenerate replies, capture taps, train a small draft (CPU)",
          ["recipe", "demo", "--out", str(run), "--target", t, "--no-progress"])
    _step("speculative generation with the demo draft",
          ["generate", "--target", t, "--draft", str(draft), "--prompt", PROMPT, "--max-new-tokens", "48",
           "--device", "cpu"])  # the CPU's default shape (decode.DEFAULT_SHAPES)
    _step("benchmark: HF generate vs eaglewire without and with the draft",
          ["bench", "--target", t, "--draft", str(draft), "--suite", str(prompts), "--max-prompts", "3",
           "--max-new-tokens", "32", "--device", "cpu", "--json", str(out / "bench.json"),
           "--plot", str(out / "acceptance.png")])
    for fmt in ("sglang", "vllm"):
        exported = out / f"export-{fmt}"
        _step(f"export for {fmt} (prints the serve command)",
              ["export", "--draft", str(draft), "--format", fmt, "--out", str(exported)])
        _step(f"doctor: the {fmt} export against the target, with a probe",
              ["doctor", "--draft", str(exported), "--target", t, "--engine", fmt, "--probe", "4",
               "--prompts", str(prompts), "--records", str(draft)])
    print(f"\ndemo done: everything is in {out}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="the whole pipeline on the embedded default target, on a CPU, in minutes")
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    cli_args.add_target(p, required=False, help=cli_args.DEFAULT_TARGET_HELP)
    p.set_defaults(func=cmd_demo)
