"""`eaglewire datagen`: prompts -> (optional regeneration by the target) -> tap capture -> shards.

The prompt set is processed in chunks of `shard_size` conversations, in file order. A chunk is
regenerated (if asked), encoded with the chat template, captured in length-sorted batches (one
forward each) and committed as one shard together with the position it reaches. A rerun of the same
command resumes from the manifest's position, so a killed run loses and repeats nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from .. import chat, prompts, targets
from ..capture import capture, locate
from ..errors import EaglewireError, UsageError
from ..parallel import Dist
from ..runtime.sampling import SamplingParams, logits_to_probs
from ..taps import TapContract
from . import batchgen, shards


@dataclass(frozen=True, kw_only=True)
class GenConfig:
    """How the target rewrites the assistant turns (EAGLE-3 practice: the draft learns the target's own replies)."""

    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    batch_size: int = 64
    # prompt + reply tokens per generate call: long prompts get fewer rows (the KV cache is what fills memory)
    batch_tokens: int | None = None
    cache: str = "auto"  # "static" (transformers compiles its decode step on CUDA), "dynamic"; auto: static on CUDA
    engine: str = "auto"  # "hf": transformers generate; "slots": batchgen.py (CUDA graphs, grouped-query attention)
    seed: int = 0  # sampling is seeded per chunk, so a resumed run writes what an unbroken one would

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise UsageError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UsageError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.batch_size < 1:
            raise UsageError(f"--gen-batch-size must be >= 1, got {self.batch_size}")
        if self.batch_tokens is not None and self.batch_tokens < self.max_new_tokens + 1:
            raise UsageError(f"--gen-batch-tokens {self.batch_tokens}: must leave room for one prompt token and "
                             f"--max-new-tokens {self.max_new_tokens}")
        if self.cache not in ("auto", "static", "dynamic"):
            raise UsageError(f"--gen-cache must be auto, static or dynamic, got {self.cache!r}")
        if self.engine not in ("auto", "hf", "slots"):
            raise UsageError(f"--gen-engine must be auto, hf or slots, got {self.engine!r}")

    def static(self, device: torch.device) -> bool:
        return self.cache == "static" or (self.cache == "auto" and device.type == "cuda")

    def engine_for(self, model, device: torch.device) -> str:
        """auto: slots on CUDA, where batchgen's graphs regenerate about twice as fast as generate; hf elsewhere,
        where slots lose (no graphs there, and every row padded to the width grid)."""
        if self.engine != "auto":
            return self.engine
        return "slots" if device.type == "cuda" and batchgen.supports(model) else "hf"


@dataclass(frozen=True, kw_only=True)
class DatagenConfig:
    regen: bool = False
    max_samples: int | None = None
    max_len: int = 2048
    overlong: str = "truncate"  # or "skip"
    batch_size: int = 8  # capture batch
    dtype: str = "bf16"  # storage dtype of taps and final_hidden
    shard_size: int = 64  # samples per shard = conversations per resumable step
    gen: GenConfig = field(default_factory=GenConfig)

    def __post_init__(self):
        if self.max_samples is not None and self.max_samples < 1:
            raise UsageError(f"--max-samples must be >= 1, got {self.max_samples}")
        if self.max_len < 2:
            raise UsageError(f"--max-len must be >= 2, got {self.max_len}")
        if self.overlong not in ("truncate", "skip"):
            raise UsageError(f"--overlong must be 'truncate' or 'skip', got {self.overlong!r}")
        if self.batch_size < 1 or self.shard_size < 1:
            raise UsageError(f"--batch-size and --shard-size must be >= 1, got {self.batch_size}, {self.shard_size}")
        if self.dtype not in shards.DTYPES:
            raise UsageError(f"--dtype must be one of {list(shards.DTYPES)}, got {self.dtype!r}")

    def identity(self) -> dict:
        """The arguments that change what a sample holds (a resumed run must repeat them)."""
        out = {"regen": self.regen, "max_len": self.max_len, "overlong": self.overlong}
        if self.regen:
            out["generation"] = {k: v for k, v in asdict(self.gen).items()
                                 if k not in ("batch_size", "batch_tokens", "cache", "engine")}
        return out


# ---- regeneration -------------------------------------------------------------------------------

def pad_id(tokenizer) -> int:
    pid = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pid) if pid is not None else 0


# A static cache compiles one decode step per (rows, cache length): prompts are left-padded to a
# multiple of this width and every batch of a width gets the same number of rows, so a whole
# regeneration compiles a few shapes instead of one per batch.
STATIC_WIDTH_STEP = 256


@dataclass(frozen=True)
class Batch:
    prompts: list[int]  # indices into the prompt list
    width: int  # left-padded prompt width
    rows: int  # rows generated (>= len(prompts); the rest repeat a prompt and are dropped)


# The share of the GPU memory free after the target loaded that a batch's K/V cache may take: the rest holds the
# prefill's activations (batchgen.PREFILL_TOKENS) and the step's logits, about 3 GB at 2,048 rows of Qwen2.5-1.5B.
KV_SHARE = 0.6


@torch.no_grad()
def kv_bytes_per_token(model) -> int:
    """The K/V cache one token takes across the target's layers: measured by a one-token forward into the cache
    transformers makes for it. Read off the config it would be wrong for MLA (DeepSeek-V3, Kimi), whose cache
    transformers releases lay out differently (full heads, or the compressed latent)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    one = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    model(input_ids=one, use_cache=True, **{targets.cache_kwarg(model): cache})
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def fit_to_memory(gen: GenConfig, model, free_bytes: int) -> GenConfig:
    """`gen` with batch_tokens cut to what KV_SHARE of `free_bytes` holds (K/V, not activations): a recipe's
    1.5M tokens fit an H200 for SmolLM2 but not an 80 GB GPU for a 7B target."""
    fit = max(gen.max_new_tokens + 1, int(KV_SHARE * free_bytes) // kv_bytes_per_token(model))
    if gen.batch_tokens is not None and gen.batch_tokens <= fit:
        return gen
    if gen.batch_tokens is not None and gen.batch_tokens not in _CUT:  # once a process, not once a turn or shard
        _CUT.add(gen.batch_tokens)
        print(f"eaglewire: regeneration batches hold at most {fit} tokens, the K/V that {KV_SHARE:.0%} of the "
              f"{free_bytes / 2**30:.1f} GiB free holds (asked: {gen.batch_tokens})", file=sys.stderr)
    return replace(gen, batch_tokens=fit)


_CUT: set[int] = set()


def plan_batches(lengths: list[int], gen: GenConfig, static: bool) -> list[Batch]:
    """Length-sorted batches of at most `batch_size` rows and `batch_tokens` (width + new tokens) x rows."""
    def rows_for(width: int) -> int:
        if gen.batch_tokens is None:
            return gen.batch_size
        return max(1, min(gen.batch_size, gen.batch_tokens // (width + gen.max_new_tokens)))

    step = STATIC_WIDTH_STEP if static else 1
    batches, todo = [], sorted(range(len(lengths)), key=lambda k: lengths[k])
    while todo:
        # the batch's width is its longest prompt's, so take rows while they still fit that width's budget
        n = 1
        while n < len(todo) and n < rows_for(-(-lengths[todo[n]] // step) * step):
            n += 1
        batches.append((todo[:n], -(-lengths[todo[n - 1]] // step) * step))
        todo = todo[n:]
    rows: dict[int, int] = {}  # static: one row count per width, the largest batch's
    for ks, width in batches:
        rows[width] = max(rows.get(width, 0), len(ks))
    return [Batch(ks, width, rows[width] if static else len(ks)) for ks, width in batches]


def generate_batched(target: targets.Target, prompts_ids: list[list[int]], gen: GenConfig,
                     on_batch: Callable[[dict], None] | None = None, strip: bool = True) -> list[str]:
    """Replies to tokenized prompts as text (`generate_ids`, decoded without the stop token).
    strip=False keeps the reply's leading space, for text that continues the prompt's."""
    stops, out = set(targets.eos_ids(target)), []
    for new in generate_ids(target, prompts_ids, gen, on_batch):
        text = target.tokenizer.decode(new[:-1] if new and new[-1] in stops else new, skip_special_tokens=True)
        out.append(text.strip() if strip else text.rstrip())
    return out


@torch.no_grad()
def generate_ids(target: targets.Target, prompts_ids: list[list[int]], gen: GenConfig,
                 on_batch: Callable[[dict], None] | None = None) -> list[list[int]]:
    """The new tokens for tokenized prompts, up to and including the first stop token: length-sorted,
    left-padded batches through `model.generate` (or batchgen's slots on CUDA).
    `on_batch` gets one record per batch (shape, steps, seconds): where a regeneration's time goes."""
    from torch._dynamo.utils import counters  # graphs compiled per batch: a first shape compiles (seconds)
    from transformers import GenerationConfig

    tok, model = target.tokenizer, target.model
    stops, pad = targets.eos_ids(target), pad_id(tok)  # generate and batchgen test membership: order is moot
    kw = {"do_sample": True, "temperature": gen.temperature, "top_p": gen.top_p} if gen.temperature > 0 else \
        {"do_sample": False}
    device = torch.device(target.device)
    if device.type == "cuda":
        gen = fit_to_memory(gen, model, torch.cuda.mem_get_info(device)[0])
    slots = gen.engine_for(model, device) == "slots"
    if slots and not batchgen.supports(model):
        raise UsageError(f"--gen-engine slots runs {sorted(batchgen.SUPPORTED)} targets (grouped K/V heads), this one "
                         f"is {model.config.model_type}: use --gen-engine hf")
    static = slots or gen.static(device)  # both want few shapes: one graph (or compiled step) per width
    if static and not slots:
        kw["cache_implementation"] = "static"
    cfg = GenerationConfig(max_new_tokens=gen.max_new_tokens, eos_token_id=stops, pad_token_id=pad, **kw)
    sampling = SamplingParams(temperature=gen.temperature, top_p=gen.top_p)
    choose = (lambda logits: logits.argmax(-1)) if sampling.greedy else \
        (lambda logits: torch.multinomial(logits_to_probs(logits, sampling), 1).squeeze(1))
    engine = None  # slots: one batch shape's generator (its KV cache and graph) at a time
    replies: list[list[int]] = [[] for _ in prompts_ids]
    for batch in plan_batches([len(p) for p in prompts_ids], gen, static):
        t0, graphs = time.perf_counter(), counters["stats"]["unique_graphs"]
        rows = batch.prompts + batch.prompts[:1] * (batch.rows - len(batch.prompts))
        ids = torch.full((len(rows), batch.width), pad, dtype=torch.long)  # (B, L), left-padded
        mask = torch.zeros_like(ids)
        for r, k in enumerate(rows):
            n = len(prompts_ids[k])
            ids[r, batch.width - n:] = torch.tensor(prompts_ids[k])
            mask[r, batch.width - n:] = 1
        if slots:
            if engine is None or (engine.rows, engine.width) != (batch.rows, batch.width):
                engine = None  # frees the last shape's cache before the next is made
                engine = batchgen.BatchGenerator(model, batch.rows, batch.width, gen.max_new_tokens,
                                                 cuda_graphs=device.type == "cuda")
            ids = ids.to(device)
            new = batchgen.generate(engine, ids, (mask == 0).sum(1).to(device), stops, choose)
            out = torch.cat([ids, new], 1)  # generate's layout: prompt then new tokens
        else:
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=cfg)
        for r, k in enumerate(batch.prompts):
            new = out[r, batch.width:].tolist()
            cut = next((i + 1 for i, t in enumerate(new) if t in stops), len(new))
            replies[k] = new[:cut]
        if on_batch is not None:
            on_batch({"width": batch.width, "rows": batch.rows, "prompts": len(batch.prompts),
                      "steps": out.shape[1] - batch.width, "seconds": round(time.perf_counter() - t0, 3),
                      "compiled": counters["stats"]["unique_graphs"] - graphs})
    return replies


def regenerate(target: targets.Target, convs: list[list[dict]], gen: GenConfig, max_len: int,
               on_batch: Callable[[dict], None] | None = None) -> list[list[dict] | prompts.Skip]:
    """Each conversation with its assistant turns rewritten by the target, turn by turn.

    Turn t of every conversation is generated in one batched pass, after the target's own replies
    to turns < t; a prompt that already fills `max_len` ends its conversation there.
    """
    if not convs:
        return []
    system = [[m for m in c if m["role"] == "system"] for c in convs]
    users = [[m for m in c if m["role"] == "user"] for c in convs]
    out: list[list[dict] | prompts.Skip] = [list(s) for s in system]
    live = set(range(len(convs)))  # conversations still being extended
    for t in range(max(len(u) for u in users)):
        todo, ids = [], []
        for k in sorted(live):
            if t >= len(users[k]):
                live.discard(k)
                continue
            msgs = out[k] + [users[k][t]]
            try:
                text = chat.render(target.tokenizer, msgs, add_generation_prompt=True)
            except chat.ChatTemplateError as e:
                out[k] = prompts.Skip(e.reason, str(e))
                live.discard(k)
                continue
            p = target.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(p) >= max_len:  # no room left for a reply: the conversation ends here
                live.discard(k)
                continue
            todo.append((k, msgs))
            ids.append(p)
        tell = None if on_batch is None else lambda b, turn=t + 1: on_batch({"turn": turn, **b})
        for (k, msgs), reply in zip(todo, generate_batched(target, ids, gen, tell)):
            out[k] = msgs + [{"role": "assistant", "content": reply}]
    return [c if isinstance(c, prompts.Skip) or any(m["role"] == "assistant" for m in c)
            else prompts.Skip("prompt longer than --max-len") for c in out]


def regenerate_ranks(target: targets.Target, convs: list[list[dict]], gen: GenConfig, max_len: int, dist: Dist,
                     on_batch: Callable[[dict], None] | None = None) -> list[list[dict] | prompts.Skip]:
    """regenerate() under torchrun: conversations dealt round-robin over the ranks (so a run of long
    or many-turn ones is shared out), then gathered back in order; every rank returns them all."""
    if dist.world == 1:
        return regenerate(target, convs, gen, max_len, on_batch)
    out: list = [None] * len(convs)
    for r, part in enumerate(dist.gather(regenerate(target, convs[dist.rank::dist.world], gen, max_len, on_batch))):
        out[r::dist.world] = part
    return out


MIN_PROMPT_WORDS = 3  # shorter self-written prompts ("Hi", half a word) teach the draft little


# Words a steered self-written prompt opens with, in turn ("" leaves it to the target). Unsteered, SmolLM2-135M
# writes mostly requests for help and plans: "Can you provide" / "help" / "suggest" and
# "I'm planning" / "looking for" / "considering" open a quarter of the prompts it writes, while tasks to write,
# solve, extract from, role-play or code are rare. A draft is weakest on prompts unlike its data, whatever the
# target's confidence, so the last ten widen the kinds of task.
OPENERS = ("", "Write", "Explain", "Solve", "Imagine", "Describe", "Compare", "Summarize", "Extract", "Rewrite",
           "Calculate", "Implement", "Pretend", "Given", "Why", "How", "What", "Create", "List", "Analyze",
           "Translate", "Design", "Classify", "Evaluate",
           "Compose", "Draft", "Act as", "Suppose", "Discuss", "Find", "Identify", "Edit", "Debug", "Convert")


def self_prompts(target: targets.Target, n: int, gen: GenConfig, dist: Dist | None = None,
                 openers: tuple[str, ...] = ("",)) -> list[str]:
    """Up to n distinct user prompts written by the target itself (Magpie, Xu et al. 2024): sampled
    continuations of the chat template's opening of a user turn, cut at the end of that turn.
    They follow the target's instruction-tuning data, which a prompt file may not (ShareGPT is
    heavy on greetings and repeats). With openers, prompt i starts with openers[i % len(openers)]
    and the target writes the rest (e.g. OPENERS: more kinds of task)."""
    if gen.temperature <= 0:
        raise UsageError("self-written prompts must be sampled (temperature > 0): greedy writes one prompt n times")
    header = chat.user_header(target.tokenizer)
    if dist is not None:  # each rank its share (and its own seed), then gathered: every rank returns them all
        n = n // dist.world + (dist.rank < n % dist.world)
    starts = [openers[i % len(openers)] for i in range(n)]
    ids = {o: target.tokenizer(header + o, add_special_tokens=False)["input_ids"] for o in set(starts)}
    texts = generate_batched(target, [ids[o] for o in starts], gen, strip=False)
    written = [t for t in ((o + c).strip() for o, c in zip(starts, texts)) if len(t.split()) >= MIN_PROMPT_WORDS]
    return sorted({t for part in (dist.gather(written) if dist is not None else [written]) for t in part})


# ---- encoding and capture -----------------------------------------------------------------------

def _policy(enc, cfg: DatagenConfig) -> tuple[torch.Tensor, torch.Tensor, bool] | prompts.Skip:
    if isinstance(enc, chat.ChatTemplateError):
        return prompts.Skip(enc.reason, str(enc))
    ids, mask, truncated = enc
    if truncated and cfg.overlong == "skip":
        return prompts.Skip("longer than --max-len")
    if not mask.any():
        return prompts.Skip("no assistant token within --max-len" if truncated else "no assistant token")
    return ids, mask, truncated


def encode(tokenizer, conv: list[dict], cfg: DatagenConfig) -> tuple[torch.Tensor, torch.Tensor, bool] | prompts.Skip:
    """(input_ids, loss_mask, truncated) of one conversation under the --max-len policy, or why not."""
    return _policy(chat.encode_many(tokenizer, [conv], cfg.max_len)[0], cfg)


def encode_chunk(tokenizer, convs: list, cfg: DatagenConfig) -> list:
    """encode() of many conversations (Skips pass through), tokenized in one batch."""
    todo = [c for c in convs if not isinstance(c, prompts.Skip)]
    encs = iter(chat.encode_many(tokenizer, todo, cfg.max_len))
    return [c if isinstance(c, prompts.Skip) else _policy(next(encs), cfg) for c in convs]


@torch.no_grad()
def capture_batched(target: targets.Target, contract: TapContract, seqs: list[torch.Tensor], batch_size: int,
                    dtype: torch.dtype, stack=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(taps (T, n*H), final_hidden (T, H)) per sequence, on the CPU in `dtype`, unpadded.

    Sequences are grouped by length and right-padded: with the attention mask, padding sits after
    every real token and cannot change it.
    """
    stack = stack or locate(target.model)
    pad = pad_id(target.tokenizer)
    order = sorted(range(len(seqs)), key=lambda k: seqs[k].numel())
    out: list = [None] * len(seqs)
    for b in range(0, len(order), batch_size):
        batch = order[b:b + batch_size]
        width = max(seqs[k].numel() for k in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)  # (B, L)
        mask = torch.zeros_like(ids)
        for r, k in enumerate(batch):
            ids[r, :seqs[k].numel()] = seqs[k]
            mask[r, :seqs[k].numel()] = 1
        cap = capture(target.model, ids.to(target.device), contract, attention_mask=mask.to(target.device),
                      final_norm=True, stack=stack)
        taps, final = cap.taps.to("cpu", dtype), cap.final_hidden.to("cpu", dtype)  # (B, L, n*H), (B, L, H)
        for r, k in enumerate(batch):
            n = seqs[k].numel()
            out[k] = (taps[r, :n].clone(), final[r, :n].clone())
    return out


# ---- the run ------------------------------------------------------------------------------------

def manifest_base(target: targets.Target, contract: TapContract, pset: prompts.PromptPool,
                  cfg: DatagenConfig) -> dict:
    fp = target.fingerprint or targets.fingerprint(target.model, target.tokenizer)
    model_dtype = next(target.model.parameters()).dtype
    return {
        "format": shards.FORMAT,
        "contract": contract.to_dict(),
        "final_hidden": "post-norm",
        "storage_dtype": cfg.dtype,
        "hidden_size": target.config.hidden_size,
        "target": fp,
        "tokenizer_hash": fp.get("tokenizer_hash"),
        "chat_template_hash": fp.get("chat_template_hash"),
        "prompts_sha256": pset.sha256,
        "prompts": pset.summary(),
        "args": {**cfg.identity(), "target_dtype": str(model_dtype).removeprefix("torch.")},
        "run": {"target": target.spec, "max_samples": cfg.max_samples, "batch_size": cfg.batch_size,
                "shard_size": cfg.shard_size, "gen_batch_size": cfg.gen.batch_size if cfg.regen else None},
    }


def _room(writer: shards.ShardWriter, cfg: DatagenConfig) -> int | None:
    return None if cfg.max_samples is None else cfg.max_samples - writer.samples


def _chunk(target, contract, convs, i: int, j: int, cfg: DatagenConfig, writer: shards.ShardWriter, stack) -> None:
    """Conversations i..j-1 -> (regenerated) -> encoded -> captured -> one committed shard."""
    if cfg.regen:
        torch.manual_seed(cfg.gen.seed + i)  # the same chunk samples the same replies on a rerun
        chunk = regenerate(target, convs[i:j], cfg.gen, cfg.max_len)
    else:
        chunk = convs[i:j]
    kept, truncated = [], 0
    for src, enc in enumerate(encode_chunk(target.tokenizer, chunk, cfg), i):
        if isinstance(enc, prompts.Skip):
            writer.skip(enc.reason)
        else:
            kept.append((src, enc[0], enc[1]))
            truncated += enc[2]
    states = capture_batched(target, contract, [ids for _, ids, _ in kept], cfg.batch_size,
                             shards.DTYPES[cfg.dtype], stack)
    for (src, ids, mask), (taps, final) in zip(kept, states):
        writer.add(shards.Sample(source=src, input_ids=ids, loss_mask=mask, taps=taps, final_hidden=final))
    writer.commit(next_source=j, truncated=truncated)


def run_datagen(target: targets.Target, prompts_path: str | Path | list, out_dir: str | Path, contract: TapContract,
                regen: bool = False, max_samples: int | None = None, max_len: int = 2048, *,
                gen: GenConfig | None = None, progress: bool = True, **options) -> dict:
    """Build (or resume) a training-data directory from one or more prompt files (pooled, repeats dropped);
    returns its manifest.

    options: DatagenConfig fields (overlong, batch_size, dtype, shard_size).
    """
    from tqdm import tqdm

    cfg = DatagenConfig(regen=regen, max_samples=max_samples, max_len=max_len, gen=gen or GenConfig(), **options)
    chat.require_chat_template(target.tokenizer, f"--target {target.spec}")
    if contract.num_layers != target.num_layers:
        raise UsageError(f"tap contract is for {contract.num_layers} layers, --target {target.spec} has "
                         f"{target.num_layers}")
    pset = prompts.load_pool(prompts_path, need_assistant=not regen)
    convs = pset.conversations
    writer = shards.ShardWriter(out_dir, manifest_base(target, contract, pset, cfg), cfg.shard_size)
    start = writer.next_source
    room = _room(writer, cfg)
    if start and start < len(convs) and (room is None or room > 0):
        print(f"eaglewire datagen: resuming at conversation {start} of {len(convs)} ({writer.samples} samples "
              f"in {len(writer.manifest['shards'])} shards)", file=sys.stderr)
    stack = locate(target.model)
    bar = tqdm(total=len(convs), initial=start, unit="conv", desc="datagen", file=sys.stderr, disable=not progress)
    i = start
    while i < len(convs) and (_room(writer, cfg) is None or _room(writer, cfg) > 0):
        # A chunk never yields more samples than there is room for, so max_samples needs no cut.
        j = min(len(convs), i + min(cfg.shard_size, _room(writer, cfg) or cfg.shard_size))
        _chunk(target, contract, convs, i, j, cfg, writer, stack)
        bar.update(j - i)
        bar.set_postfix(samples=writer.samples)
        i = j
    bar.close()
    manifest = writer.finish(complete=True)
    if manifest["counts"]["samples"] == 0:
        raise EaglewireError(f"--prompts {pset.label}: no usable sample (skipped: {manifest['counts']['skipped']})")
    return manifest
