"""`eaglewire prepare` and `eaglewire taps`: the target side's small commands."""

from __future__ import annotations

import json
from pathlib import Path

from . import cli_args, targets
from .taps import CONVENTIONS, TapContract, sglang_eras, sglang_releases
from .errors import TapError, UsageError


def cmd_prepare(args) -> int:
    if args.gguf and len(args.names) != 1:
        raise UsageError("--gguf installs one target: name exactly one")
    for name in args.names:
        prepared = targets.prepare(name, Path(args.gguf) if args.gguf else None)
        print(f"{name}: {prepared.path}")
    return 0


def engine_table(contract: TapContract, model_type: str) -> list[dict]:
    """Each engine's ids and config key for a contract; unsupported ones say why."""
    rows = []
    # every SGLang rule the family has had, newest first (taps.SGLANG_FAMILIES), with the releases it holds for
    eras = sglang_eras(model_type)
    releases = {conv: sglang_releases([(since, conv)], eras) for since, conv in eras}
    names = ["hf", "vllm", "vllm-legacy", "speculators", *releases, "specforge", "eagle"]
    for name in names:
        conv = CONVENTIONS[name]
        try:
            ids = conv.to_ids(contract.taps, contract.num_layers)
        except TapError as e:
            ids = None
            why = str(e)
        rows.append({"convention": name, "ids": ids, "where": conv.where, "meaning": conv.meaning,
                     "unsupported": None if ids is not None else why,
                     **({"sglang_releases": releases[name]} if name in releases else {})})
    return rows


def cmd_taps(args) -> int:
    cfg = targets.config_of(args.target)
    n = cfg.num_hidden_layers
    contract = TapContract.parse(n, args.taps)
    rows = engine_table(contract, cfg.model_type)
    if args.json:
        print(json.dumps({"target": args.target, "model_type": cfg.model_type, "num_layers": n,
                          "hidden_size": cfg.hidden_size, "default_taps": list(TapContract.default(n).taps),
                          "contract": contract.to_dict(), "engines": rows}, indent=2))
        return 0
    print(f"target      {args.target} ({cfg.model_type}, {n} layers, hidden {cfg.hidden_size})")
    print(f"tap k       residual stream entering decoder layer k (0 = embedding, {n} = last layer before final norm)")
    print(f"default     {list(TapContract.default(n).taps)} (EAGLE-3: 2, N//2, N-3)")
    print(f"taps        {list(contract.taps)}  -> fc input width {len(contract.taps)} x {cfg.hidden_size} = "
          f"{len(contract.taps) * cfg.hidden_size}")
    print()
    w = max(len(r["convention"]) for r in rows)
    for r in rows:
        ids = str(r["ids"]) if r["ids"] is not None else "UNSUPPORTED"
        releases = r.get("sglang_releases", "every release")
        when = f" (SGLang {releases})" if releases != "every release" else ""
        print(f"{r['convention']:<{w}}  {ids:<16} {r['where']}{when}")
        if r["unsupported"]:
            print(f"{'':<{w}}  {r['unsupported']}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("prepare", help="install a registry target into the cache ($EAGLEWIRE_HOME)")
    p.add_argument("names", nargs="*", default=[targets.DEFAULT_TARGET], metavar="NAME",
                   help=f"registry targets (default {targets.DEFAULT_TARGET})")
    p.add_argument("--gguf", default=None, help="install from a local copy of the published GGUF (md5-checked)")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("taps", help="print a target's layer count, default taps and each engine's ids for them")
    cli_args.add_target(p)
    cli_args.add_taps(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_taps)
