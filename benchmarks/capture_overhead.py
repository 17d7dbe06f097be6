"""What tap capture costs: a plain forward of the target's base model vs eaglewire's hook capture
(`eaglewire.capture.capture`, one forward, final norm included) vs `output_hidden_states=True`.

    python benchmarks/capture_overhead.py --target smollm2-135m --device cpu --seq-len 256 --iters 5 --json out.json

Prints a table (milliseconds per forward, overhead against the plain forward, peak GPU memory)
and writes the same numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from eaglewire import __version__, targets
from eaglewire.capture import capture, locate
from eaglewire.taps import TapContract


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def timed(modes: dict, device: torch.device, warmup: int, iters: int) -> list[dict]:
    """Per mode: times of `iters` calls, the modes interleaved so that machine load hits all alike."""
    for fn in modes.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in modes}
    peaks = dict.fromkeys(modes, 0.0)
    for _ in range(iters):
        for name, fn in modes.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            times[name].append((time.perf_counter() - t) * 1e3)
            if device.type == "cuda":
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device) / 2**20)
    return [{"mode": name, "mean_ms": statistics.fmean(ts), "median_ms": statistics.median(ts), "min_ms": min(ts),
             "peak_mem_mib": peaks[name] if device.type == "cuda" else None} for name, ts in times.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=targets.DEFAULT_TARGET)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="auto: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--taps", default=None, help="canonical taps (default 2,N//2,N-3)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    target = targets.load_target(args.target, dtype=dtype, device=args.device)
    model, device, stack = target.model, target.device, locate(target.model)
    contract = TapContract.parse(target.num_layers, args.taps)
    # output_hidden_states has no pre-norm state after the last layer: tap N is not comparable there.
    hs_taps = [k for k in contract.taps if k < target.num_layers]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (args.batch, args.seq_len), generator=g).to(device)

    def plain():
        stack.base(input_ids=ids, use_cache=False)

    def hooks():
        return capture(model, ids, contract, final_norm=True, stack=stack)

    def hidden_states():
        hs = stack.base(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
        return torch.cat([hs[k] for k in hs_taps], dim=-1), hs[-1]

    modes = {"plain forward": plain, "hook capture (eaglewire)": hooks, "output_hidden_states=True": hidden_states}
    results = timed(modes, device, args.warmup, args.iters)
    base = results[0]["median_ms"]
    for r in results:
        r["overhead_pct"] = 100 * (r["median_ms"] / base - 1)

    with torch.no_grad():  # the two ways must capture the same states
        cap, (hs_cat, hs_final) = hooks(), hidden_states()
        width = target.config.hidden_size
        cols = [contract.taps.index(k) for k in hs_taps]
        ours = torch.cat([cap.taps[..., c * width:(c + 1) * width] for c in cols], dim=-1)
        diff = max((ours - hs_cat).abs().max().item(), (cap.final_hidden - hs_final).abs().max().item())

    report = {"target": args.target, "device": str(device), "dtype": str(next(model.parameters()).dtype),
              "seq_len": args.seq_len, "batch": args.batch, "iters": args.iters, "warmup": args.warmup,
              "taps": list(contract.taps), "num_layers": target.num_layers, "hidden_size": target.config.hidden_size,
              "torch": torch.__version__, "eaglewire": __version__, "machine": platform.machine(),
              "threads": torch.get_num_threads(), "max_abs_diff_hooks_vs_hidden_states": diff, "results": results}
    print(f"{args.target} on {device} ({report['dtype']}), batch {args.batch} x {args.seq_len} tokens, "
          f"taps {list(contract.taps)}, {args.iters} iterations")
    print(f"{'mode':<28} {'median ms':>10} {'mean ms':>10} {'min ms':>10} {'overhead':>9} {'peak MiB':>9}")
    for r in results:
        peak = f"{r['peak_mem_mib']:.0f}" if r["peak_mem_mib"] is not None else "-"
        print(f"{r['mode']:<28} {r['median_ms']:>10.2f} {r['mean_ms']:>10.2f} {r['min_ms']:>10.2f} "
              f"{r['overhead_pct']:>+8.1f}% {peak:>9}")
    print(f"max |hook - hidden_states| over the shared taps and the final norm: {diff:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
