"""One target forward pass per sample, written in every trainer's own feature format.

The three trainers read the same tensors under different names and layouts (../../docs/CONVENTIONS.md
section 2 and the peers' own modules):
    eaglewire     shards: taps (T, 3H) + the POST-norm final state (data/shards.py)
    speculators   hidden_states (T, 4, H): the three taps + the PRE-norm final state (tap N)
    SpecForge     aux_hidden_state (1, T, 3H) + the POST-norm final state
So the pass captures taps (2, N//2, N-3, N) and the post-norm state once, and each writer takes what its
format holds. The tokenization is eaglewire's (the target's chat template, assistant-only loss mask), the
same for all three.

Timing: `forward_s` is the target's work (synchronised on CUDA), each writer's `write_s` its own
serialisation and disk time. A trainer's capture cost is forward_s + its write_s.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from eaglewire import prompts, targets
from eaglewire.capture import locate
from eaglewire.data import datagen, shards
from eaglewire.taps import TapContract


class ShardsWriter:
    """eaglewire's own format, through its ShardWriter (one shard per `shard_size` samples)."""

    def __init__(self, out_dir: Path, *, target: targets.Target, contract: TapContract, pset, cfg):
        self.writer = shards.ShardWriter(out_dir, datagen.manifest_base(target, contract, pset, cfg), cfg.shard_size)
        self.source = 0

    def add(self, input_ids, loss_mask, taps, last, final) -> None:
        T = input_ids.numel()
        self.writer.add(shards.Sample(source=self.source, input_ids=input_ids, loss_mask=loss_mask,
                                      taps=taps.reshape(T, -1), final_hidden=final))
        self.source += 1

    def commit(self) -> None:
        self.writer.commit(next_source=self.source)

    def close(self) -> dict:
        m = self.writer.finish(complete=True)
        return {"samples": m["counts"]["samples"], "tokens": m["counts"]["tokens"],
                "bytes": sum(s["bytes"] for s in m["shards"])}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def capture_all(target: targets.Target, pset: prompts.PromptPool, writers: dict, *, cfg: datagen.DatagenConfig,
                chunk: int = 256, progress=None) -> dict:
    """Encode every conversation of `pset` (replies written) under `cfg` (max_len, capture batch, storage dtype),
    capture once, hand each sample to every writer; -> counts and timings. `writers`: name -> object with
    add(input_ids, loss_mask, taps (T, 3, H), last (T, H) pre-norm, final (T, H) post-norm), optional commit()
    after each chunk, and close() -> dict."""
    N = target.num_layers
    contract = TapContract.default(N)
    wide = TapContract(N, tuple(contract.taps) + (N,))  # + tap N: the pre-norm final state speculators reads
    stack = locate(target.model)
    store = shards.DTYPES[cfg.dtype]
    H = target.config.hidden_size
    timing = {"encode_s": 0.0, "forward_s": 0.0, **{f"{k}_write_s": 0.0 for k in writers}}
    counts = {"conversations": len(pset.conversations), "samples": 0, "tokens": 0, "assistant_tokens": 0,
              "skipped": 0, "truncated": 0}
    convs = pset.conversations
    t_all = time.perf_counter()
    for i in range(0, len(convs), chunk):
        t = time.perf_counter()
        encs = datagen.encode_chunk(target.tokenizer, convs[i:i + chunk], cfg)
        kept = [e for e in encs if not isinstance(e, prompts.Skip)]
        counts["skipped"] += len(encs) - len(kept)
        timing["encode_s"] += time.perf_counter() - t
        _sync(target.device)
        t = time.perf_counter()
        states = datagen.capture_batched(target, wide, [ids for ids, _, _ in kept], cfg.batch_size, store, stack)
        _sync(target.device)
        timing["forward_s"] += time.perf_counter() - t
        for (ids, mask, truncated), (taps, final) in zip(kept, states):
            T = ids.numel()
            taps = taps.view(T, 4, H)
            aux, last = taps[:, :3], taps[:, 3]
            for name, w in writers.items():
                t = time.perf_counter()
                w.add(ids, mask, aux, last, final)
                timing[f"{name}_write_s"] += time.perf_counter() - t
            counts["samples"] += 1
            counts["tokens"] += T
            counts["assistant_tokens"] += int(mask.sum())
            counts["truncated"] += int(truncated)
        for name, w in writers.items():
            if hasattr(w, "commit"):
                t = time.perf_counter()
                w.commit()
                timing[f"{name}_write_s"] += time.perf_counter() - t
        if progress:
            progress(f"capture: {min(i + chunk, len(convs))}/{len(convs)} conversations, {counts['tokens']} tokens")
    written = {}
    for name, w in writers.items():
        t = time.perf_counter()
        written[name] = w.close()
        timing[f"{name}_write_s"] += time.perf_counter() - t
    timing["wall_s"] = time.perf_counter() - t_all
    return {"taps": list(contract.taps), "final_pre_norm_tap": N, "counts": counts, "written": written,
            "timing": {k: round(v, 2) for k, v in timing.items()}}
