"""`eaglewire export` and `eaglewire import`."""

from __future__ import annotations

import sys

from .. import cli_args
from . import EXPORT_FORMATS, FORMATS, export_draft, import_draft
from .serve import SpecArgs


def cmd_export(args) -> int:
    spec = SpecArgs(num_steps=args.num_steps, topk=args.topk, draft_tokens=args.draft_tokens)
    res = export_draft(args.draft, args.format, args.out, engine_version=args.engine_version, spec=spec,
                       target_path=args.target_path)
    print(f"exported {args.draft} -> {res.out} ({res.format}; ids {res.ids}, convention {res.convention}; "
          "reloaded and compared: identical logits)")
    for n in res.notes:
        print(f"note: {n}", file=sys.stderr)
    print()
    print(res.serve_text)
    return 0


def cmd_import(args) -> int:
    path, meta = import_draft(args.src, args.out, source=args.source, target=args.target,
                              engine_version=args.engine_version)
    print(f"imported {args.src} ({meta.source}, convention {meta.convention}) -> {path}")
    if meta.target_from:
        print(f"target {meta.target_from}")
    print(f"taps {list(meta.contract.taps)} of {meta.contract.num_layers} layers"
          + (f" (ids {meta.ids} from {meta.ids_where})" if meta.ids is not None else ""))
    for n in meta.notes:
        print(f"note: {n}", file=sys.stderr)
    return 0


def register(sub) -> None:
    p = sub.add_parser("export", help="export a draft for SGLang, vLLM or speculators (verified by reloading it)")
    cli_args.add_draft(p, required=True, help="native eaglewire draft checkpoint directory")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    p.add_argument("--out", required=True, help="new output directory (written atomically)")
    p.add_argument("--engine-version", default=None,
                   help="SGLang release the export is for (default: latest; DeepSeek-family ids change at 0.5.13)")
    p.add_argument("--num-steps", type=cli_args.positive_int, default=3,
                   help="draft steps per round (vLLM: num_speculative_tokens)")
    p.add_argument("--topk", type=cli_args.positive_int, default=1,
                   help="SGLang --speculative-eagle-topk (1 = a chain)")
    p.add_argument("--draft-tokens", type=cli_args.positive_int, default=None,
                   help="SGLang --speculative-num-draft-tokens (default and required value for topk 1: steps + 1)")
    p.add_argument("--target-path", default=None, help="the target model path/id to write into SERVE.md")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="import an SGLang/vLLM/speculators/SpecForge/EAGLE/ModelOpt draft")
    p.add_argument("--from", dest="src", required=True, help="draft directory in a foreign format")
    p.add_argument("--out", required=True, help="new native checkpoint directory")
    p.add_argument("--source", choices=list(FORMATS), default=None,
                   help="the format's origin, when the files alone do not tell (the error says when)")
    cli_args.add_target(p, required=False, default=None,
                        help="target (registry name, HF dir, .gguf): layer count, fingerprint and embedding")
    p.add_argument("--engine-version", default=None, help="SGLang release the directory was made for")
    p.set_defaults(func=cmd_import)
