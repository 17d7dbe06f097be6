"""The kernels of a decode round, by kind: plain decoding, a greedy chain and an EAGLE-2 tree, compiled as the
decoder runs them but not captured, so that torch.profiler sees every kernel (a CUDA graph replays the same ones).

    python benchmarks/round_kernels.py --draft CKPT --json out.json
    python benchmarks/round_kernels.py --random-draft --modes chain --top 20

A round's share is a long generation's profile less a short one's, divided by the rounds between them, so the
prefill and the first round drop out. Kinds: matmul (cuBLAS, CUTLASS, Inductor's matmul kernels), attention,
selection (argmax, top-k, sort, softmax), reduction and pointwise (Inductor's other fused kernels), copy
(memcpy, memset, index and cat kernels), other. On a GPU, time is each kernel's own device time; the table says
where a round's time goes and how many launches it takes, next to decode_steps.py's graph and host split.
On a CPU the same accounting runs over operators (their self time). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import re
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_steps import decoder_args, load_pair  # noqa: E402

from eaglewire import __version__  # noqa: E402
from eaglewire.decode.decoder import SpecConfig, SpecDecoder  # noqa: E402
from eaglewire.decode.speedups import Speedups  # noqa: E402

KINDS = (  # the first pattern a kernel's name matches decides its kind
    ("pointwise", r"^triton_poi"),  # Inductor's pointwise kernels, whatever ops their names list
    ("attention", r"flash|fmha|attention|sdpa"),
    ("matmul", r"gemm|nvjet|cutlass|cublas|^triton_tem|(^|_)b?mm(_|$)|aten::(mm|bmm|addmm|matmul)|linear"),
    ("selection", r"argmax|topk|sort|softmax"),
    ("reduction", r"^triton_(red|per)"),  # Inductor's other reductions (norms), whatever they fused
    ("copy", r"memcpy|memset|copy|index|cat|clone|fill"),
    ("reduction", r"reduce|sum|mean"),
    ("pointwise", r"elementwise|aten::"),
)
KIND_NAMES = list(dict.fromkeys(k for k, _ in KINDS)) + ["other"]


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, pattern in KINDS if re.search(pattern, low)), "other")


def kernels(run, cuda: bool) -> dict[str, tuple[int, float]]:
    """{kernel or operator name: (calls, self time in us)} over run()."""
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    out: dict[str, tuple[int, float]] = {}
    for e in prof.key_averages():
        if e.device_type.name == ("CUDA" if cuda else "CPU"):
            us = e.self_device_time_total if cuda else e.self_cpu_time_total
            calls, total = out.get(e.key, (0, 0.0))
            out[e.key] = (calls + e.count, total + us)
    return out


def per_round(dec: SpecDecoder, ids: torch.Tensor, short: int, long: int, plain: bool) -> dict:
    """{kernel: (calls, us)} a round: the long generation's profile less the short one's, over the rounds between."""
    gen = dec.generate_plain if plain else dec.generate
    cuda = dec.device.type == "cuda"
    counts, rounds = [], []
    for n in (short, long):
        result = {}
        counts.append(kernels(lambda: result.setdefault("r", gen(ids, n)), cuda))
        rounds.append(len(result["r"].tokens) if plain else result["r"].num_steps)
    between = rounds[1] - rounds[0]
    if between <= 0:
        raise SystemExit(f"round_kernels: {long} new tokens took no more rounds than {short}: raise --new")
    short_run, long_run = counts
    diff = {k: (c - short_run.get(k, (0, 0.0))[0], us - short_run.get(k, (0, 0.0))[1])
            for k, (c, us) in long_run.items()}
    return {"rounds": between, "kernels": {k: (c / between, us / between) for k, (c, us) in diff.items()}}


def by_kind(row: dict) -> dict[str, dict[str, float]]:
    out = collections.defaultdict(lambda: {"calls": 0.0, "us": 0.0})
    for name, (calls, us) in row["kernels"].items():
        out[kind(name)]["calls"] += calls
        out[kind(name)]["us"] += us
    return dict(out)


def ms_cell(us: float) -> str:
    """A kind's ms a round for the table: "-" where the two profiles' difference is noise around nothing (a
    plain step's attention, fused into Inductor's kernels, once printed as -0.000)."""
    return "-" if us < 0.5 else f"{us / 1e3:.3f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    decoder_args(p, 64, "new tokens of the long generation (the short one: a quarter)")
    p.add_argument("--no-compile", action="store_true", help="eager forwards (the default compiles on CUDA)")
    p.add_argument("--modes", default="plain,chain,tree", help="which of plain, chain, tree to profile")
    p.add_argument("--top", type=int, default=12, help="kernels listed by time for each mode")
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    t, draft, meta, ids, shapes = load_pair(a, device)
    rows = {}
    for name, shape in shapes.items():
        if name.split()[0] not in a.modes.split(","):
            continue
        dec = SpecDecoder(t, None if shape is None else draft, None if shape is None else meta,
                          shape=SpecConfig.for_device(device, **(shape or {})),
                          speedups=Speedups(static_shapes=True, compile=cuda and not a.no_compile))
        plain = shape is None
        for _ in range(2):  # every size compiled before anything is profiled
            (dec.generate_plain if plain else dec.generate)(ids, a.new)
        rows[name] = per_round(dec, ids, max(2, a.new // 4), a.new, plain)
        rows[name]["by_kind"] = by_kind(rows[name])

    unit = "kernels" if cuda else "operators"
    print(f"round kernels: {a.target} {str(next(t.model.parameters()).dtype).split('.')[-1]} on "
          f"{torch.cuda.get_device_name(device) if cuda else platform.processor() or 'cpu'}, compiled="
          f"{cuda and not a.no_compile}, no CUDA graphs; {unit} and their own time a round")
    print(f"{'mode':<24}{unit:>9}{'ms':>8}" + "".join(f"{k:>11}" for k in KIND_NAMES))
    for name, row in rows.items():
        bk = row["by_kind"]
        calls, us = sum(v["calls"] for v in bk.values()), sum(v["us"] for v in bk.values())
        print(f"{name:<24}{calls:>9.0f}{us / 1e3:>8.3f}" + "".join(f"{ms_cell(bk.get(k, {}).get('us', 0)):>11}"
                                                                 for k in KIND_NAMES))
    for name, row in rows.items():
        print(f"\n{name}: the {a.top} longest ({row['rounds']} rounds profiled)")
        for k, (calls, us) in sorted(row["kernels"].items(), key=lambda kv: -kv[1][1])[:a.top]:
            print(f"  {us:9.1f} us {calls:6.1f}x  {kind(k):<10} {k[:90]}")
    if a.json:
        out = {"eaglewire": __version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "target": a.target,
               "device": str(device), "torch": torch.__version__, "settings": vars(a), "rows": rows}
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
