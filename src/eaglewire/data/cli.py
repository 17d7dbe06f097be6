"""`eaglewire datagen` on the command line: the hook capture (datagen.py) on one device, or the real vLLM
(engines/vllm_datagen.py, --engine vllm) across --tensor-parallel-size GPUs."""

from __future__ import annotations

from .. import cli_args, prompts, targets
from ..errors import UsageError
from ..taps import TapContract
from . import shards
from .datagen import DatagenConfig, GenConfig, run_datagen


def cmd_datagen(args) -> int:
    paths = prompts.require_files(args.prompts)
    gen = GenConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    batch_size=args.gen_batch_size, batch_tokens=args.gen_batch_tokens, cache=args.gen_cache,
                    engine=args.gen_engine, seed=args.seed)
    options = dict(regen=args.regen, max_samples=args.max_samples, max_len=args.max_len, gen=gen,
                   overlong=args.overlong, batch_size=args.batch_size, dtype=args.dtype, shard_size=args.shard_size)
    DatagenConfig(**options)  # refuse bad arguments before loading the target
    contract = TapContract.parse(targets.config_of(args.target).num_hidden_layers, args.taps)
    if args.engine == "vllm":  # vLLM runs the target, across --tensor-parallel-size GPUs
        from ..engines.vllm_datagen import run_vllm_datagen

        m = run_vllm_datagen(args.target, paths, args.out, contract, tensor_parallel_size=args.tensor_parallel_size,
                             gpu_memory_utilization=args.gpu_memory_utilization, **options)
    else:
        if args.tensor_parallel_size != 1:
            raise UsageError("--tensor-parallel-size runs with --engine vllm (the hooks capture runs one device)")
        if args.gpu_memory_utilization is not None:
            raise UsageError("--gpu-memory-utilization runs with --engine vllm (the hooks capture takes what it uses)")
        dtype = None if args.target_dtype == "auto" else targets.DTYPES[args.target_dtype]  # None: load_target's default
        target = targets.load_target(args.target, dtype=dtype, device=args.device)
        m = run_datagen(target, paths, args.out, contract, **options)
    c = m["counts"]
    skipped = ", ".join(f"{n} {r}" for r, n in sorted(c["skipped"].items(), key=lambda rn: -rn[1])) or "none"
    print(f"{args.out}: {c['samples']} samples, {c['tokens']} tokens ({c['assistant_tokens']} assistant) in "
          f"{len(m['shards'])} shards; taps {list(contract.taps)}; truncated {c['truncated']}; skipped: {skipped}")
    if m["prompts"]["skipped"]:
        print(f"prompt file: {m['prompts']['records']} records, skipped {m['prompts']['skipped']}")
    return 0


def add_engine_args(p, defaults: bool) -> None:
    """--gen-batch-size/-tokens, --gen-engine, --gen-cache; defaults=False leaves them None (a recipe
    overrides only what was given)."""
    def d(value):
        return value if defaults else None

    p.add_argument("--gen-batch-size", type=cli_args.positive_int, default=d(64),
                   help="prompts per generate call (datagen: 64)")
    p.add_argument("--gen-batch-tokens", type=cli_args.positive_int, default=None, metavar="T",
                   help="at most T prompt + reply tokens per generate call (fewer rows for long prompts)")
    p.add_argument("--gen-engine", choices=["auto", "hf", "slots"], default=d("auto"),
                   help="hf: transformers generate; slots: our batched engine (CUDA graphs, grouped-query attention, "
                        "no compilation); auto (default): slots on CUDA for the models it runs, hf elsewhere")
    p.add_argument("--gen-cache", choices=["auto", "static", "dynamic"], default=d("auto"),
                   help="KV cache of the hf engine (auto: static on CUDA, where transformers compiles the decode step)")


def register(sub) -> None:
    p = sub.add_parser("datagen", help="capture the target's taps over a prompt set into training shards")
    cli_args.add_target(p)
    p.add_argument("--prompts", required=True, metavar="FILE", nargs="+",
                   help="ShareGPT / OpenAI-messages JSON(L), a JSON list of prompts, or a .txt with one per line; "
                        "several are pooled, a conversation that repeats one before it dropped")
    p.add_argument("--out", required=True, metavar="DIR", help="dataset directory (created, or resumed)")
    p.add_argument("--regen", action="store_true", help="have the target write the assistant turns itself")
    cli_args.add_taps(p)
    p.add_argument("--max-samples", type=cli_args.positive_int, default=None, metavar="N",
                   help="stop after N samples (rerun with a larger N to extend)")
    p.add_argument("--max-len", type=cli_args.positive_int, default=2048, metavar="L",
                   help="tokens per sample (default 2048)")
    p.add_argument("--overlong", choices=["truncate", "skip"], default="truncate",
                   help="what to do with samples longer than --max-len (default truncate)")
    p.add_argument("--batch-size", type=cli_args.positive_int, default=8, metavar="B", help="capture batch (default 8)")
    p.add_argument("--dtype", choices=list(shards.DTYPES), default="bf16", help="stored taps dtype (default bf16)")
    p.add_argument("--shard-size", type=cli_args.positive_int, default=64, metavar="S",
                   help="conversations per shard, the unit of resumption (default 64)")
    p.add_argument("--target-dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="dtype the target runs in (auto: bf16 on CUDA, fp32 on CPU)")
    cli_args.add_device(p)
    p.add_argument("--engine", choices=["hooks", "vllm"], default="hooks",
                   help="what runs the target and captures its taps: hooks (default) on one device in this process, "
                        "or the real vLLM (its extract_hidden_states method; pip install 'eaglewire[vllm]'), for "
                        "targets past one GPU")
    p.add_argument("--tensor-parallel-size", type=cli_args.positive_int, default=1, metavar="N",
                   help="GPUs vLLM spreads the target over")
    cli_args.add_gpu_memory(p, help="with --engine vllm: the share of each GPU's memory vLLM takes (default 0.8; "
                            "lower it to share the GPU with other work)")
    g = p.add_argument_group("regeneration (--regen)")
    g.add_argument("--max-new-tokens", type=cli_args.positive_int, default=512, help="per reply (default 512)")
    cli_args.add_sampling(g, top_k=False)
    add_engine_args(g, defaults=True)
    g.add_argument("--seed", type=cli_args.nonneg_int, default=0, help="sampling seed (default 0)")
    p.set_defaults(func=cmd_datagen)
