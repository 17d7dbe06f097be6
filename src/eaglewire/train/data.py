"""What the trainer reads: samples offline (datagen shards) or online (conversations whose taps the
target computes on the fly), the held-out split, and length-grouped micro-batches.

Both corpora expose the same samples in the same order when built from the same prompts with the
same max_len (online uses datagen's own encoding and regeneration), so a run is the same whichever
way its taps arrive.
"""

from __future__ import annotations

import hashlib
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .. import chat, checkpoint, prompts
from ..capture import capture
from ..data import datagen, shards
from ..errors import EaglewireError, UsageError
from ..parallel import Dist
from ..taps import TapContract

SCAN_ROWS = 1 << 16  # rows per finiteness check: bounded memory on big shards
PAD_MULTIPLE = 64  # micro-batch widths rounded up: few distinct shapes for the allocator, cuDNN plans and kernels


@dataclass
class Corpus:
    """Samples the trainer can index. `item(i)` -> input_ids (T,), loss_mask (T,) [, taps, final_hidden]."""

    mode: str  # "offline" | "online"
    contract: TapContract
    lengths: list[int]  # tokens per sample (after max_len)
    loss_tokens: list[int]  # loss positions of TTT step 1 per sample: assistant tokens from index 2 on
    token_freqs: list[tuple[int, int]]  # (token id, count) over assistant tokens
    data_hash: str | None  # the dataset's manifest hash (offline)
    keys: list[bytes] = field(default_factory=list)  # content_key per sample: what the held-out split reads
    provenance: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.lengths)

    def item(self, i: int) -> dict:
        raise NotImplementedError

    def token_freqs_of(self, indices: list[int]) -> list[tuple[int, int]]:
        """(token id, count) over the assistant tokens of these samples (after max_len), most frequent first."""
        raise NotImplementedError


class OfflineCorpus(Corpus):
    def __init__(self, ds: shards.ShardDataset, max_len: int):
        self.ds, self.max_len = ds, max_len
        lengths, loss_tokens, keys = _scan_shards(ds, max_len)
        m = ds.manifest
        super().__init__(mode="offline", contract=ds.contract, lengths=lengths, loss_tokens=loss_tokens,
                         token_freqs=ds.token_freqs, data_hash=shards.manifest_hash(m), keys=keys,
                         provenance={"mode": "offline", "dir": ds.dir.name, "manifest_hash": shards.manifest_hash(m),
                                     "samples": len(lengths), "storage_dtype": m.get("storage_dtype"),
                                     "datagen_args": m.get("args"), "prompts": m.get("prompts")})

    def item(self, i: int) -> dict:
        x = self.ds[i]
        return {k: v[:self.max_len] for k, v in x.items()}

    def token_freqs_of(self, indices: list[int]) -> list[tuple[int, int]]:
        # the token ids alone, shard by shard: item() would read every hidden state too
        want = set(indices)
        return _freqs(ids[mask] for i, (ids, mask) in enumerate(_tokens(self.ds.dir, self.ds.manifest, self.max_len))
                      if i in want)


def _tokens(data_dir: Path, manifest: dict, max_len: int):
    """(input_ids, loss_mask) of every sample, cut at max_len, in order: read from the token ids alone."""
    for s in manifest["shards"]:
        with safe_open(str(Path(data_dir) / s["file"]), framework="pt") as f:
            offsets, mask = f.get_tensor("offsets").tolist(), f.get_tensor("loss_mask").bool()
            ids = f.get_tensor("input_ids")
        for a, b in zip(offsets[:-1], offsets[1:]):
            b = min(b, a + max_len)
            yield ids[a:b], mask[a:b]


def index_offline(data_dir: str | Path, max_len: int) -> tuple[list[int], list[int], list[bytes]]:
    """Per-sample lengths, step-1 loss positions (assistant tokens from index 2 on) and content keys of a datagen
    directory, as the trainer counts them, from the token ids alone: what the split and its counts need without
    reading a hidden state (nothing is verified here; training verifies)."""
    return _index(Path(data_dir), shards.read_manifest(data_dir), max_len)


def _index(data_dir: Path, manifest: dict, max_len: int) -> tuple[list[int], list[int], list[bytes]]:
    lengths, loss_tokens, keys = [], [], []
    for ids, mask in _tokens(data_dir, manifest, max_len):
        lengths.append(ids.numel())
        loss_tokens.append(int(mask[2:].sum()))
        keys.append(content_key(ids))
    return lengths, loss_tokens, keys


def _freqs(masked_ids) -> list[tuple[int, int]]:
    freqs = Counter()
    for ids in masked_ids:
        freqs.update(ids.tolist())
    return sorted(freqs.items(), key=lambda tc: (-tc[1], tc[0]))


def _scan_shards(ds: shards.ShardDataset, max_len: int) -> tuple[list[int], list[int], list[bytes]]:
    """Per-sample lengths, step-1 loss positions and content keys (index_offline), and a finiteness check of every
    hidden state, before training starts (a NaN found mid-run would cost the run)."""
    for s in ds.manifest["shards"]:
        path = ds.dir / s["file"]
        with safe_open(str(path), framework="pt") as f:
            offsets = f.get_tensor("offsets").tolist()
            for name in ("taps", "final_hidden"):
                sl = f.get_slice(name)
                for a in range(0, offsets[-1], SCAN_ROWS):
                    rows = sl[a:a + SCAN_ROWS]
                    if not torch.isfinite(rows).all():
                        bad = a + int((~torch.isfinite(rows)).any(-1).nonzero()[0])
                        j = max(k for k in range(len(offsets) - 1) if offsets[k] <= bad)
                        raise EaglewireError(f"{path}: sample {j} holds NaN/inf in {name}: this data cannot train a "
                                             "draft; run datagen again (with --target-dtype fp32 if the target "
                                             "overflows in bf16)")
    return _index(ds.dir, ds.manifest, max_len)


class OnlineCorpus(Corpus):
    def __init__(self, samples: list[tuple[torch.Tensor, torch.Tensor]], contract: TapContract, provenance: dict):
        self.samples = samples
        super().__init__(mode="online", contract=contract, lengths=[int(ids.numel()) for ids, _ in samples],
                         loss_tokens=[int(mask[2:].sum()) for _, mask in samples],
                         token_freqs=_freqs(ids[mask] for ids, mask in samples), data_hash=None,
                         keys=[content_key(ids) for ids, _ in samples], provenance=provenance)

    def item(self, i: int) -> dict:
        ids, mask = self.samples[i]
        return {"input_ids": ids, "loss_mask": mask}

    def token_freqs_of(self, indices: list[int]) -> list[tuple[int, int]]:
        return _freqs(self.samples[i][0][self.samples[i][1]] for i in indices)


def open_offline(data_dir: str | Path, fingerprint: dict, contract: TapContract | None, max_len: int) -> OfflineCorpus:
    """A datagen directory checked against the target (fingerprint) and the requested taps."""
    # verify="open": a corrupt shard is refused before anything is trained or written
    ds = shards.open_dataset(data_dir, expect_fingerprint=fingerprint, expect_contract=contract, verify="open")
    return OfflineCorpus(ds, max_len)


ENCODE_CHUNK = 1024  # conversations per tokenizer call


def build_online(target, prompt_files: str | Path | list, contract: TapContract, max_len: int,
                 regen: datagen.GenConfig | None, dist: Dist, progress: bool = False) -> OnlineCorpus:
    """Conversations of one or more files -> (regenerated) -> encoded samples, exactly as datagen would keep
    them; a conversation repeated in the files is used once."""
    from tqdm import tqdm
    chat.require_chat_template(target.tokenizer, f"--target {target.spec}")
    pset = prompts.load_pool(prompt_files, need_assistant=regen is None)
    convs: list = pset.conversations
    if dist.main and pset.whole_file is None:
        print(f"eaglewire train: --prompts: {len(convs)} conversations from {len(pset.sets)} file(s), "
              f"{pset.duplicates} repeats dropped", file=sys.stderr)
    if regen is not None:
        torch.manual_seed(regen.seed)
        convs = datagen.regenerate_ranks(target, convs, regen, max_len, dist)
    cfg = datagen.DatagenConfig(regen=regen is not None, max_len=max_len, overlong="truncate")
    samples, skipped = [], Counter()
    encoded = []  # a chunk per tokenizer call: about twice as fast as encoding replies one by one
    with tqdm(total=len(convs), unit="conv", desc="encode", file=sys.stderr, disable=not (progress and dist.main),
              dynamic_ncols=True) as bar:
        for i in range(0, len(convs), ENCODE_CHUNK):
            chunk = convs[i:i + ENCODE_CHUNK]
            encoded += datagen.encode_chunk(target.tokenizer, chunk, cfg)
            bar.update(len(chunk))
    for enc in encoded:
        if isinstance(enc, prompts.Skip):
            skipped[enc.reason] += 1
        else:
            samples.append((enc[0], enc[1]))
    if not samples:
        raise EaglewireError(f"--prompts {pset.label}: no usable sample (skipped: {dict(skipped)})")
    prov = {"mode": "online", "prompts": pset.summary(), "samples": len(samples), "skipped": dict(skipped),
            "regen": None if regen is None else {k: v for k, v in vars(regen).items() if k != "batch_size"}}
    return OnlineCorpus(samples, contract, prov)


# ---- split and batches --------------------------------------------------------------------------

SPLIT_RULE = "content-hash"  # in a resume state's identity: a run split by a seeded permutation resumes no more


def content_key(ids: torch.Tensor) -> bytes:
    """A sample's identity for the held-out split: a hash of its tokens (after max_len)."""
    return hashlib.blake2b(ids.to(torch.int64).numpy().tobytes(), digest_size=16).digest()


def split(keys: list[bytes], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) sample indices, each sorted. A sample is held out by its content alone: a seeded hash
    of its key below eval_fraction. So a sample held out once stays held out when the data grows (new
    replies for an --init-from run would otherwise reshuffle the split into what the draft trained on),
    and copies of one sample never straddle the split. At least one sample lands on each side."""
    n = len(keys)
    if eval_fraction == 0:
        return list(range(n)), []
    if n < 2:
        raise EaglewireError(f"the data holds {n} sample(s): too few to hold out an eval split "
                             "(pass --eval-fraction 0, or use more data)")
    salt = str(seed).encode()
    u = [int.from_bytes(hashlib.blake2b(k, digest_size=8, key=salt).digest(), "little") / 2.0 ** 64 for k in keys]
    held = {i for i in range(n) if u[i] < eval_fraction}
    if not held:
        held = {min(range(n), key=u.__getitem__)}
    if len(held) == n:
        held.discard(max(range(n), key=u.__getitem__))
    return [i for i in range(n) if i not in held], sorted(held)


def padded(t: int) -> int:
    return -(-t // PAD_MULTIPLE) * PAD_MULTIPLE


def group(indices: list[int], lengths: list[int], batch_tokens: int | None, batch_size: int | None) -> list[list[int]]:
    """Cut indices (longest first) into micro-batches of <= batch_size samples or <= batch_tokens padded tokens."""
    out, cur = [], []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        width = padded(lengths[cur[0]] if cur else lengths[i])  # the first is the longest
        full = (batch_size is not None and len(cur) >= batch_size) or \
               (batch_tokens is not None and (len(cur) + 1) * width > batch_tokens)
        if cur and full:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def plan_epoch(indices: list[int], lengths: list[int], epoch: int, seed: int, batch_tokens: int | None,
               batch_size: int | None, window: int = 64) -> list[list[int]]:
    """This epoch's micro-batches: a seeded shuffle, length-grouped within windows of ~`window`
    micro-batches (little padding, yet varied batches), then the micro-batches shuffled."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = [indices[i] for i in torch.randperm(len(indices), generator=g).tolist()]
    mean = max(1, sum(lengths[i] for i in indices) // max(1, len(indices)))
    per_batch = batch_size or max(1, batch_tokens // padded(mean))
    chunk = window * per_batch
    batches = []
    for c in range(0, len(order), chunk):
        batches += group(order[c:c + chunk], lengths, batch_tokens, batch_size)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def collate(items: list[dict]) -> dict:
    """Right-padded (B, T) batch; T rounded up to PAD_MULTIPLE. Padding sits after every real token."""
    T = padded(max(x["input_ids"].numel() for x in items))
    B = len(items)
    out = {"input_ids": torch.zeros(B, T, dtype=torch.long), "loss_mask": torch.zeros(B, T, dtype=torch.bool),
           "attention_mask": torch.zeros(B, T, dtype=torch.long)}
    for name in ("taps", "final_hidden"):
        if name in items[0]:
            out[name] = torch.zeros(B, T, items[0][name].shape[-1], dtype=items[0][name].dtype)
    for r, x in enumerate(items):
        n = x["input_ids"].numel()
        out["input_ids"][r, :n] = x["input_ids"]
        out["loss_mask"][r, :n] = x["loss_mask"]
        out["attention_mask"][r, :n] = 1
        for name in ("taps", "final_hidden"):
            if name in x:
                out[name][r, :n] = x[name]
    return out


class Schedule:
    """Which micro-batches each optimizer step trains on: every epoch's plan cut into groups of
    `micro` (= grad_accum x ranks); an epoch's leftover micro-batches are dropped."""

    def __init__(self, indices: list[int], lengths: list[int], seed: int, batch_tokens: int | None,
                 batch_size: int | None, micro: int):
        self.indices, self.lengths, self.seed, self.micro = indices, lengths, seed, micro
        self.batch_tokens, self.batch_size = batch_tokens, batch_size
        self._plan: tuple[int, list] | None = None  # the last epoch planned

    def plan(self, epoch: int) -> list[list[int]]:
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, plan_epoch(self.indices, self.lengths, epoch, self.seed, self.batch_tokens,
                                            self.batch_size))
        return self._plan[1]

    def steps_in(self, epoch: int) -> int:
        n = len(self.plan(epoch)) // self.micro
        if n == 0:
            raise UsageError(f"the training split ({len(self.indices)} samples) gives {len(self.plan(epoch))} "
                             f"micro-batches, fewer than one step needs (grad_accum x ranks = {self.micro}): lower "
                             "--batch-tokens/--batch-size or --grad-accum, or use more data")
        return n

    def total_steps(self, epochs: int, steps: int | None) -> int:
        return steps or sum(self.steps_in(e) for e in range(epochs))

    def steps(self, start: int, total: int):
        """(step, epoch, the step's micro-batches on all ranks) for steps start..total-1."""
        step, epoch = 0, 0
        while step < total:
            n = self.steps_in(epoch)
            if step + n > start:
                plan = self.plan(epoch)
                for s in range(max(0, start - step), min(n, total - step)):
                    yield step + s, epoch, plan[s * self.micro:(s + 1) * self.micro]
            step += n
            epoch += 1


def rank_batches(corpus: "Corpus", steps, rank: int, grad_accum: int, workers: int, pin_memory: bool):
    """(step, epoch, all ranks' micro-batches, this rank's collated batches) along the schedule; one
    loader per epoch reads this rank's micro-batches (rank r takes the r-th grad_accum of each step)."""
    cur, buf = None, []
    for step, epoch, group in steps:
        if epoch != cur and buf:
            yield from _load(corpus, buf, workers, pin_memory)
            buf = []
        cur = epoch
        buf.append((step, epoch, group, group[rank * grad_accum:(rank + 1) * grad_accum]))
    if buf:
        yield from _load(corpus, buf, workers, pin_memory)


def _load(corpus, steps, workers, pin_memory):
    it = loader(corpus, [mb for *_, mine in steps for mb in mine], workers, pin_memory)
    for step, epoch, group, mine in steps:
        yield step, epoch, group, [next(it) for _ in mine]


class _Items(torch.utils.data.Dataset):
    def __init__(self, corpus: Corpus):
        self.corpus = corpus

    def __len__(self):
        return len(self.corpus)

    def __getitem__(self, i):
        return self.corpus.item(i)


def loader(corpus: Corpus, batches: list[list[int]], num_workers: int, pin_memory: bool):
    """Iterates the given micro-batches in order (workers read shards ahead while the GPU trains)."""
    if not batches:
        return iter(())
    workers = num_workers if corpus.mode == "offline" else 0  # online items are tiny: no workers
    return iter(torch.utils.data.DataLoader(
        _Items(corpus), batch_sampler=batches, collate_fn=collate, num_workers=workers, pin_memory=pin_memory,
        prefetch_factor=4 if workers else None, persistent_workers=False))


@torch.no_grad()
def tap_stats(corpus: Corpus, indices: list[int], model, stack, max_tokens: int) -> dict:
    """checkpoint.tap_stats over the taps of the first samples of `indices` (captured when online)."""
    rows, n = [], 0
    device = next(model.parameters()).device
    for i in indices:
        x = corpus.item(i)
        taps = x["taps"] if "taps" in x else capture(model, x["input_ids"][None].to(device), corpus.contract,
                                                     stack=stack).taps[0]
        rows.append(taps.float().cpu())
        n += taps.shape[0]
        if n >= max_tokens:
            break
    return checkpoint.tap_stats(torch.cat(rows)[:max_tokens], len(corpus.contract.taps))
