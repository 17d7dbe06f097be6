"""Taps captured by vLLM against eaglewire's hooks, on the same tokens; then drafts trained on each, served by vLLM.

    eaglewire datagen --engine vllm --regen --target T --prompts FILE --out VDIR ...
    python benchmarks/capture_engines.py compare --vllm-data VDIR --out HDIR [--json OUT]
    eaglewire train --data VDIR --out DV ...;  eaglewire train --data HDIR --out DH ...   (the same settings)
    python benchmarks/capture_engines.py serve --target T --draft vllm=DV --draft hooks=DH [--json OUT]

`compare` reads every sample of a `datagen --engine vllm` directory and captures the same token ids through the
target's own forward with eaglewire's hooks (datagen's capture), twice: in the target's bf16, as datagen stores
them (written to --out as an ordinary datagen directory of the same samples: only the capture differs), and in
fp32, the reference. bf16 rounds differently in every kernel, so vLLM's taps cannot equal ours bit for bit;
the question is whether vLLM's distance from the fp32 taps is of the order of our own bf16 capture's. Per tap:
max and mean absolute difference, the mean difference relative to the taps' mean magnitude, and the cosine.

`serve` serves each draft in the real vLLM (greedy, batch 1, chain of K, on a suite) and prints the engine's
acceptance length and acceptance by position for each: drafts trained on the two captures should accept alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from eaglewire import cli_args, targets
from eaglewire.data import datagen, shards
from eaglewire.data.suites import load_suite
from eaglewire.taps import TapContract


class Diff:
    """Running |a - b| statistics of one tap over tokens."""

    def __init__(self):
        self.max = 0.0
        self.abs = self.mag = self.cos = 0.0
        self.tokens = 0

    def add(self, a: torch.Tensor, ref: torch.Tensor) -> None:
        a, ref = a.double(), ref.double()
        d = (a - ref).abs()
        self.max = max(self.max, float(d.max()))
        self.abs += float(d.mean(-1).sum())
        self.mag += float(ref.abs().mean(-1).sum())
        self.cos += float(torch.nn.functional.cosine_similarity(a, ref, dim=-1).sum())
        self.tokens += a.shape[0]

    def row(self) -> dict:
        n = max(self.tokens, 1)
        return {"max_abs": self.max, "mean_abs": self.abs / n, "relative": self.abs / max(self.mag, 1e-30),
                "cosine": self.cos / n, "tokens": self.tokens}


def compare(vllm_dir: Path, out: Path, batch_size: int, device: str) -> dict:
    manifest = shards.read_manifest(vllm_dir)
    if (manifest.get("captured_by") or {}).get("engine") != "vllm":
        raise SystemExit(f"{vllm_dir}: not captured by vLLM (its manifest has no captured_by.engine = vllm)")
    contract = TapContract.from_dict(manifest["contract"])
    spec = manifest["run"]["target"]
    ds = shards.open_dataset(vllm_dir, verify="open")
    t16 = targets.load_target(spec, dtype=torch.bfloat16, device=device)
    t32 = targets.load_target(spec, dtype=torch.float32, device=device)
    names = [f"tap {k} (layer {t})" for k, t in enumerate(contract.taps)] + ["final (post-norm)"]
    stats = {pair: [Diff() for _ in names] for pair in ("vllm-fp32", "hooks_bf16-fp32", "vllm-hooks_bf16")}
    base = {k: manifest[k] for k in shards.IDENTITY}
    base["args"] = {k: v for k, v in base["args"].items() if k != "capture_engine"}
    base["run"] = {"target": spec, "tokens_of": str(vllm_dir), "batch_size": batch_size}
    base["captured_by"] = {"engine": "eaglewire hooks", "tokens_of": manifest.get("captured_by")}
    writer = shards.ShardWriter(out, base, manifest["run"].get("shard_size") or 1000)
    H = int(manifest["hidden_size"])
    t0, chunk = time.time(), 256

    def split(taps, final):  # (T, n*H), (T, H) -> each tap's (T, H), then the final state
        return [taps[:, j * H:(j + 1) * H] for j in range(len(contract.taps))] + [final]

    for i in range(0, len(ds), chunk):
        items = [ds[k] for k in range(i, min(len(ds), i + chunk))]
        seqs = [it["input_ids"] for it in items]
        ours16 = datagen.capture_batched(t16, contract, seqs, batch_size, torch.bfloat16)
        ours32 = datagen.capture_batched(t32, contract, seqs, batch_size, torch.float32)
        for k, (it, (tp16, f16), (tp32, f32)) in enumerate(zip(items, ours16, ours32)):
            v, h, r = split(it["taps"], it["final_hidden"]), split(tp16, f16), split(tp32, f32)
            for j in range(len(names)):
                stats["vllm-fp32"][j].add(v[j], r[j])
                stats["hooks_bf16-fp32"][j].add(h[j], r[j])
                stats["vllm-hooks_bf16"][j].add(v[j], h[j])
            writer.add(shards.Sample(source=i + k, input_ids=it["input_ids"], loss_mask=it["loss_mask"],
                                     taps=tp16.to(writer.dtype), final_hidden=f16.to(writer.dtype)))
        writer.commit(next_source=i + len(items))
        print(f"compare: {i + len(items)}/{len(ds)} samples, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    writer.finish(complete=True)
    return {"vllm_data": str(vllm_dir), "hooks_data": str(out), "target": spec, "taps": list(contract.taps),
            "samples": len(ds), "captured_by": manifest.get("captured_by"),
            "rows": {pair: {n: s.row() for n, s in zip(names, per)} for pair, per in stats.items()}}


def render_compare(r: dict) -> str:
    lines = [f"taps of {r['samples']} samples ({next(iter(next(iter(r['rows'].values())).values()))['tokens']} "
             f"tokens) of {r['target']}: vLLM's capture against eaglewire's hooks (bf16) and the fp32 reference",
             f"{'tap':<20}{'pair':<18}{'max abs':>10}{'mean abs':>11}{'relative':>10}{'cosine':>10}"]
    for name in next(iter(r["rows"].values())):
        for pair, rows in r["rows"].items():
            x = rows[name]
            lines.append(f"{name:<20}{pair:<18}{x['max_abs']:>10.4f}{x['mean_abs']:>11.5f}"
                         f"{100 * x['relative']:>9.3f}%{x['cosine']:>10.6f}")
    return "\n".join(lines)


def serve(target: str, drafts: list[tuple[str, str]], suite: str, max_prompts: int, max_new_tokens: int,
          chain: int, gpu_memory_utilization: float | None = None) -> dict:
    from eaglewire.engines import serve_check
    from eaglewire.engines import vllm as engine

    convs = load_suite(suite, max_prompts).conversations
    rows = {}
    with tempfile.TemporaryDirectory(prefix="capture-engines-") as tmp:
        for name, d in drafts:
            p = serve_check.prepare_draft(d, target, Path(tmp) / name, chain)
            print(f"serve: {name} ({p.how}), taps {list(p.taps)}", file=sys.stderr, flush=True)
            r = engine.run_job(engine.Job(target=str(targets.resolve(target)), draft=str(p.engine_dir),
                                          conversations=convs, max_new_tokens=max_new_tokens,
                                          num_speculative_tokens=chain, enforce_eager=True,
                                          **engine.memory_share(gpu_memory_utilization)))
            rows[name] = {"draft": d, "aux_layers": r["aux_layers"],
                          **serve_check.counts(serve_check.engine_rows(r), chain)}
    return {"target": target, "suite": suite, "prompts": len(convs), "max_new_tokens": max_new_tokens,
            "chain": chain, "rows": rows}


def render_serve(r: dict) -> str:
    lines = [f"vLLM serving each draft: {r['suite']}, {r['prompts']} prompts, {r['max_new_tokens']} new tokens, "
             f"chain of {r['chain']}, greedy, batch 1",
             f"{'draft':<12}{'accept-len':>11}  by position"]
    for name, x in r["rows"].items():
        lines.append(f"{name:<12}{x['acceptance_length']:>11.3f}  "
                     + " ".join(f"{a:.2f}" for a in x["rate_by_position"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="vLLM's taps against the hooks' on the same tokens; writes the hooks' dataset")
    c.add_argument("--vllm-data", required=True, type=Path, help="a `datagen --engine vllm` directory")
    c.add_argument("--out", required=True, type=Path, help="the same samples captured by the hooks (bf16)")
    c.add_argument("--batch-size", type=int, default=16)
    c.add_argument("--device", default=None)
    c.add_argument("--json", metavar="OUT")
    s = sub.add_parser("serve", help="each draft served by vLLM: acceptance")
    s.add_argument("--target", default=targets.DEFAULT_TARGET)
    s.add_argument("--draft", action="append", required=True, metavar="NAME=DIR")
    s.add_argument("--suite", default="mt-bench")
    s.add_argument("--max-prompts", type=int, default=20)
    s.add_argument("--max-new-tokens", type=int, default=256)
    s.add_argument("--chain", type=int, default=7)
    s.add_argument("--json", metavar="OUT")
    cli_args.add_gpu_memory(s, help="the share of the GPU's memory vLLM takes")
    a = p.parse_args(argv)
    if a.cmd == "compare":
        r = compare(a.vllm_data, a.out, a.batch_size, a.device)
        print(render_compare(r))
    else:
        drafts = [tuple(x.split("=", 1)) for x in a.draft]
        if any(len(d) != 2 for d in drafts):
            p.error("--draft NAME=DIR")
        r = serve(a.target, drafts, a.suite, a.max_prompts, a.max_new_tokens, a.chain, a.gpu_memory_utilization)
        print(render_serve(r))
    r["date"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
