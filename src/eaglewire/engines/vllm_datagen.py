"""`eaglewire datagen --engine vllm [--tensor-parallel-size N]`: training data whose taps vLLM captured.

The path for targets that do not fit one GPU (the Kimi-K2.5 class), and the one speculators' data generation
takes. vLLM runs the target (across N GPUs) and writes the assistant turns when --regen asks. It hands back
the residual stream at the taps through its `extract_hidden_states` method (engines/vllm.py, CaptureJob).
This process never loads the weights (engines/host.py). The tap contract becomes vLLM's ids here and nowhere
else: vLLM's id j is tap j. Id N, the last layer's output before the final norm, is added for the
distillation target. The shards store that after the final norm, applied here with the target's own norm.

The shards and the manifest are datagen's usual ones; the manifest says which engine captured
(`captured_by`, and `args.capture_engine`, so that a resumed run captures the same way).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from .. import chat, prompts, targets
from ..data import datagen, shards
from ..errors import EaglewireError, UsageError
from ..taps import CONVENTIONS, TapContract
from . import vllm as engine
from .host import host_target


def vllm_ids(contract: TapContract) -> list[int]:
    """The ids vLLM is asked for: the contract's taps in vLLM's convention, and N for the final state,
    ascending (vLLM concatenates them in layer order whatever order they are listed in)."""
    N = contract.num_layers
    return sorted(set(CONVENTIONS["vllm"].to_ids(contract.taps, N)) | {N})


def split(hidden: torch.Tensor, ids: list[int], contract: TapContract, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, len(ids), H) as vLLM captured them -> (taps (T, n*H) in the contract's order, the post-norm final
    state (T, H)); the final norm runs in fp32."""
    taps = hidden[:, [ids.index(i) for i in CONVENTIONS["vllm"].to_ids(contract.taps, contract.num_layers)]]
    with torch.no_grad():
        final = norm(hidden[:, ids.index(contract.num_layers)].float())
    return taps.reshape(hidden.shape[0], -1), final


def run_vllm_datagen(target: str, prompts_path, out_dir, contract: TapContract, *, regen: bool = False,
                     max_samples: int | None = None, max_len: int = 2048, gen: datagen.GenConfig | None = None,
                     tensor_parallel_size: int = 1, gpu_memory_utilization: float | None = None,
                     progress: bool = True, **options) -> dict:
    """datagen.run_datagen with vLLM doing the target's work; returns the manifest."""
    say = (lambda m: print(f"eaglewire datagen: {m}", file=sys.stderr, flush=True)) if progress else (lambda m: None)
    gen = gen or datagen.GenConfig()
    cfg = datagen.DatagenConfig(regen=regen, max_samples=max_samples, max_len=max_len, gen=gen, **options)
    if tensor_parallel_size < 1:
        raise UsageError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    share = engine.memory_share(gpu_memory_utilization)
    ids = vllm_ids(contract)  # refuses taps vLLM cannot hand over before vLLM is needed
    engine.require()
    t = host_target(target)
    chat.require_chat_template(t.tokenizer, f"--target {t.spec}")
    if contract.num_layers != t.num_layers:
        raise UsageError(f"tap contract is for {contract.num_layers} layers, --target {t.spec} has {t.num_layers}")
    pset = prompts.load_pool(prompts_path, need_assistant=not regen)
    base = datagen.manifest_base(t, contract, pset, cfg)
    base["args"] = {**base["args"], "target_dtype": "bfloat16", "capture_engine": "vllm"}
    base["captured_by"] = {"engine": "vllm", "layer_ids": ids, "tensor_parallel_size": tensor_parallel_size}
    writer = shards.ShardWriter(out_dir, base, cfg.shard_size)
    start = writer.next_source
    convs = pset.conversations[start:]
    path = str(targets.resolve(target))
    room = None if cfg.max_samples is None else cfg.max_samples - writer.samples
    if regen and room is not None:  # replies only for what can be kept, with a margin for prompts skipped later
        convs = convs[:max(0, room + room // 10 + 8)]
    if regen and convs:
        say(f"vLLM writes the replies to {len(convs)} conversations")
        convs, _ = regenerate_replies(path, convs, gen, max_len, tensor_parallel_size, share)
    encoded = _within_room(datagen.encode_chunk(t.tokenizer, convs, cfg), room)
    # one file of vLLM's output per shard: the unit datagen resumes by
    ranges = [(i, min(len(encoded), i + cfg.shard_size)) for i in range(0, len(encoded), cfg.shard_size)]
    chunks = [[e[0].tolist() for e in encoded[a:b] if not isinstance(e, prompts.Skip)] for a, b in ranges]
    with tempfile.TemporaryDirectory(prefix=".vllm-capture-", dir=Path(out_dir)) as work:
        files = [None] * len(chunks)
        if any(chunks):
            say(f"vLLM captures ids {ids} of {sum(map(len, chunks))} sequences")
            files = engine.run_job(engine.CaptureJob(target=path, chunks=chunks, layer_ids=ids, out_dir=work,
                                                     max_model_len=max_len + 1,
                                                     tensor_parallel_size=tensor_parallel_size, **share))["files"]
        for (a, b), name in zip(ranges, files):
            got = load_file(str(Path(work) / name)) if name else None
            truncated = _write_shard(writer, encoded[a:b], start + a, got, ids, contract, t.norm)
            writer.commit(next_source=start + b, truncated=truncated)
    manifest = writer.finish(complete=True)
    if manifest["counts"]["samples"] == 0:
        raise EaglewireError(f"--prompts {pset.label}: no usable sample (skipped: {manifest['counts']['skipped']})")
    return manifest


def regenerate_replies(path: str, convs: list, gen: datagen.GenConfig, max_len: int, tensor_parallel_size: int,
                       share: dict) -> tuple[list, str | None]:
    """The conversations with vLLM's replies as their assistant turns (a prompt longer than max_len comes
    back without one and becomes a Skip), and vLLM's version. datagen --regen and `recipe --regen-engine vllm`."""
    job = engine.RegenJob(target=path, conversations=convs, max_new_tokens=gen.max_new_tokens,
                          temperature=gen.temperature, top_p=gen.top_p, seed=gen.seed, max_len=max_len,
                          tensor_parallel_size=tensor_parallel_size, **share)
    got = engine.run_job(job)
    return ([c if any(m["role"] == "assistant" for m in c) else prompts.Skip("prompt longer than --max-len")
             for c in got["conversations"]], got.get("vllm_version"))


def _within_room(encoded: list, room: int | None) -> list:
    """The encoded conversations up to the one whose sample fills the room (None: all), as run_datagen's
    chunks stop."""
    if room is None:
        return encoded
    kept = [i for i, e in enumerate(encoded) if not isinstance(e, prompts.Skip)]
    if room <= 0:
        return []
    if room < len(kept):
        return encoded[:kept[room - 1] + 1]
    return encoded


def _write_shard(writer: shards.ShardWriter, encoded: list, first: int, got: dict | None, ids: list[int],
                 contract: TapContract, norm) -> int:
    """One shard's samples from vLLM's file `got` (the entries of `encoded` that are not Skips, in order),
    numbered from source `first`; returns how many were truncated."""
    k, truncated = 0, 0
    for src, e in enumerate(encoded, first):
        if isinstance(e, prompts.Skip):
            writer.skip(e.reason)
            continue
        lo, hi = int(got["offsets"][k]), int(got["offsets"][k + 1])
        k += 1
        taps, final = split(got["hidden"][lo:hi], ids, contract, norm)
        writer.add(shards.Sample(source=src, input_ids=e[0], loss_mask=e[1], taps=taps.to(writer.dtype),
                                 final_hidden=final.to(writer.dtype)))
        truncated += e[2]
    return truncated
