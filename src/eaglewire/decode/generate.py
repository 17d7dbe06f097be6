"""`eaglewire generate`: one prompt or conversation through `SpecDecoder`, streamed to stdout.

The text goes to stdout as it is verified; a one-line summary (tokens, speed, acceptance length)
goes to stderr. `--no-spec` runs the same engine without the draft.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

from ..errors import UsageError
from ..parallel import pick_device
from ..targets import DTYPES, eos_ids
from .decoder import SpecConfig, SpecDecoder, default_shape_text, fill_shape
from .speedups import Speedups


def read_messages(path: str) -> list[dict]:
    """A conversation from FILE: a JSON list of {role, content}, or the first record of any prompt file."""
    from ..prompts import ROLES, load_conversations

    p = Path(path)
    try:
        obj = json.loads(p.read_text())
    except (OSError, ValueError):
        obj = None
    if isinstance(obj, list) and obj and all(isinstance(m, dict) and "role" in m for m in obj):
        bad = [m.get("role") for m in obj if m.get("role") not in ROLES or not isinstance(m.get("content"), str)]
        if bad:
            roles = ", ".join(sorted(set(ROLES.values())))
            raise UsageError(f"--messages {path}: every message needs a role ({roles}) and a string content; "
                             f"found role(s) {bad[:3]}")
        messages = [{"role": ROLES[m["role"]], "content": m["content"]} for m in obj]
    else:
        messages = load_conversations(p, need_assistant=False, limit=1).conversations[0]
    if messages[-1]["role"] == "assistant":
        raise UsageError(f"--messages {path}: the conversation ends with an assistant turn; end it with the user "
                         "turn the model should answer")
    return messages


def encode(tokenizer, *, prompt: str | None = None, messages: list[dict] | None = None,
           raw: bool = False) -> torch.Tensor:
    """Prompt ids (P,): under the chat template (generation prompt added) unless raw or there is none."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if messages is None and (raw or not has_template):
        return torch.tensor(tokenizer(prompt).input_ids, dtype=torch.long)
    if not has_template:
        raise UsageError("--messages needs a chat template, and the target's tokenizer has none: use --prompt "
                         "(plain text) or an instruct/chat model")
    messages = messages or [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template already wrote the special tokens (BOS, turn markers).
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)


class TextStream:
    """Prints decoded text as tokens arrive; holds back an incomplete UTF-8 character."""

    def __init__(self, tokenizer, out=None):
        self.tok, self.out, self.ids, self.shown = tokenizer, out or sys.stdout, [], 0

    def __call__(self, new: list[int]) -> None:
        self.ids += new
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)

    def close(self) -> None:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        self.out.write(text[self.shown:] + "\n")
        self.out.flush()


def draft_shape(args, device: torch.device) -> dict:
    """SpecConfig.for_device keywords from --chain K | --tree --depth --topk --budget; the rest, the device's."""
    tree = ("depth", "topk", "budget")
    tree_flags = [f"--{k}" for k in tree if getattr(args, k) is not None]
    if not args.tree and tree_flags:
        raise UsageError(f"{', '.join(tree_flags)} shape a tree: add --tree (or drop them for a chain)")
    given = {k: getattr(args, k) for k in tree} if args.tree else {"K": args.chain}
    return {"mode": "tree" if args.tree else "chain", **fill_shape(device, **given)}


def cmd_generate(args) -> int:
    from .. import targets
    from ..runtime.sampling import SamplingParams

    device = pick_device(args.device)
    shape = draft_shape(args, device)
    spec = SpecConfig.for_device(device, **shape)  # bad shapes fail before anything loads
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.draft is None and not args.no_spec:
        raise UsageError("--draft CKPT is required (or --no-spec to decode with the target alone)")
    messages = read_messages(args.messages) if args.messages else None
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("--prompt is empty: give the text to continue or answer")
    dtype = DTYPES[args.dtype] if args.dtype else None
    target = targets.load_target(args.target, dtype=dtype, device=device)
    draft = meta = None
    if not args.no_spec:
        from ..checkpoint import load_draft

        draft, meta = load_draft(args.draft, device=device, dtype=next(target.model.parameters()).dtype)
    ids = encode(target.tokenizer, prompt=args.prompt, messages=messages, raw=args.raw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # printed below, one line each
        speedups = Speedups(cuda_graphs=device.type == "cuda" and not args.no_cuda_graphs, compile=args.compile,
                            prepack=False if args.no_prepack else None)
        dec = SpecDecoder(target, draft, meta, shape=spec, speedups=speedups,
                          strict=args.strict)
    for w in dec.warnings:
        print(f"eaglewire generate: warning: {w}", file=sys.stderr)
    stream = TextStream(target.tokenizer)
    res = dec.generate(ids, args.max_new_tokens, sampling, eos_ids(target), stream=stream, seed=args.seed)
    stream.close()
    print(summary(res, shape if draft is not None else None, compiled=args.compile), file=sys.stderr)
    return 0


def summary(res, shape: dict | None, compiled: bool = False) -> str:
    t = res.timings
    # one generation is the first run: --compile's minutes of compiling land in its timings
    line = (f"eaglewire generate: {len(res.tokens)} tokens ({res.stop}), prefill {t['prefill_s'] * 1e3:.0f} ms, "
            f"decode {t['decode_tokens_per_s']:.1f} tok/s{' (compiling included)' if compiled else ''}, "
            f"{res.num_steps} target steps")
    if shape is None:
        return line + ", no speculation"
    what = f"chain K={shape['K']}" if shape["mode"] == "chain" else \
        f"tree depth={shape['depth']} topk={shape['topk']} budget={shape['budget']}"
    return line + f", acceptance length {res.acceptance_length:.2f} ({what})"


def register(sub) -> None:
    from .. import cli_args

    p = sub.add_parser("generate", help="generate with the target and an EAGLE-3 draft (speculative decoding)")
    cli_args.add_target(p, required=False)
    cli_args.add_draft(p, required=False, metavar="CKPT", help="native draft checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="a user message (chat template applied if the model has one)")
    src.add_argument("--messages", metavar="FILE", help="a conversation: a JSON list of {role, content}, or the "
                     "first record of a ShareGPT / OpenAI-messages / prompt file")
    p.add_argument("--raw", action="store_true", help="feed --prompt as plain text, without the chat template")
    p.add_argument("--max-new-tokens", type=cli_args.positive_int, default=256, metavar="N", help="default 256")
    cli_args.add_sampling(p)
    g = p.add_argument_group(f"drafting (default: a chain of {default_shape_text('K')})")
    shape = g.add_mutually_exclusive_group()
    shape.add_argument("--chain", type=cli_args.positive_int, default=None, metavar="K",
                       help="a chain of K draft tokens per step")
    shape.add_argument("--tree", action="store_true", help="EAGLE-2 dynamic tree")
    g.add_argument("--depth", type=cli_args.positive_int, default=None,
                   help=f"tree depth (default {default_shape_text('depth')})")
    g.add_argument("--topk", type=cli_args.positive_int, default=None,
                   help=f"children per node (default {default_shape_text('topk')})")
    g.add_argument("--budget", type=cli_args.positive_int, default=None,
                   help=f"draft tokens verified per step (default {default_shape_text('budget')})")
    g.add_argument("--no-spec", action="store_true", help="no draft: the same engine, one target step per token")
    p.add_argument("--seed", type=cli_args.nonneg_int, default=None,
                   help="sampling seed, an integer >= 0 (default: unseeded)")
    p.add_argument("--strict", action="store_true", help="a target fingerprint mismatch is an error, not a warning")
    cli_args.add_device(p)
    cli_args.add_dtype(p, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--no-cuda-graphs", action="store_true", help="on CUDA, run every step eagerly")
    p.add_argument("--no-prepack", action="store_true",
                   help="plain nn.Linear on a CPU (default: oneDNN-packed weights in fp32)")
    p.add_argument("--compile", action="store_true", help="torch.compile the forwards (fused kernels, on CUDA "
                   "autotuned matmuls in a plain step; the first steps of each size compile, minutes on CUDA: "
                   "worth it for long outputs; on a CPU a C++ compiler is needed, and steps can be ~20%% faster: "
                   "measure both)")
    p.set_defaults(func=cmd_generate)
