"""The training-data format: `manifest.json` + `shard-NNNNN.safetensors`, written resumably.

Each shard packs whole samples, concatenated along tokens:
    input_ids    int32  (N,)          N = tokens in the shard
    loss_mask    uint8  (N,)          1 on assistant tokens (the draft's loss positions)
    taps         bf16|fp32 (N, n*H)   the tap contract's taps, in contract order
    final_hidden bf16|fp32 (N, H)     POST-norm last hidden state: target logits = lm_head(final_hidden)
    offsets      int64  (S+1,)        sample s is rows offsets[s]:offsets[s+1]

Crash safety: a shard is written to a temporary file and renamed into place, then the manifest
(also renamed into place) lists it together with the progress it completes. A shard file the
manifest does not list is the remains of a killed run: the writer deletes it on resume and the
reader never looks at it. So every listed shard is complete, and resuming from the manifest's
progress repeats and loses nothing.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from .. import __version__, files, targets
from ..errors import EaglewireError, UsageError
from ..files import file_digest
from ..taps import TapContract
from ..targets import compare_fingerprints

FORMAT = "eaglewire-data/1"
MANIFEST = "manifest.json"
SHARD_RE = re.compile(r"^shard-(\d{5,})\.safetensors$")
DTYPES = {k: targets.DTYPES[k] for k in ("bf16", "fp32")}  # the storage dtypes, of the one table
# Manifest fields that define the data; a resumed run must agree on every one of them.
IDENTITY = ("format", "contract", "final_hidden", "storage_dtype", "hidden_size", "target", "tokenizer_hash",
            "chat_template_hash", "prompts_sha256", "args")


def manifest_hash(manifest: dict) -> str:
    """What identifies a dataset (checkpoints record it): a hash of its canonical JSON."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _dumps(manifest: dict) -> str:
    # Indented for people, except the long token-frequency list, kept on one line at the end.
    body = {k: v for k, v in manifest.items() if k != "token_freqs"}
    text = json.dumps(body, indent=2)
    if "token_freqs" in manifest:
        text = text[:-2] + ',\n  "token_freqs": ' + json.dumps(manifest["token_freqs"], separators=(",", ":")) + "\n}"
    return text + "\n"


def read_manifest(out_dir: str | Path) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise UsageError(f"{out_dir}: no {MANIFEST} (not an eaglewire dataset; make one with `eaglewire datagen`)")
    manifest = files.read_json(path, fix="delete the directory and run datagen again")
    if manifest.get("format") != FORMAT:
        raise EaglewireError(f"{path}: format {manifest.get('format')!r}, this eaglewire reads {FORMAT!r}")
    return manifest


def _differences(old: dict, new: dict) -> list[str]:
    diffs = []
    for key in IDENTITY:
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            # plain fields first: the contract's taps say more than its derived per-engine table
            keys = sorted(set(a) | set(b), key=lambda k: (isinstance(a.get(k, b.get(k)), dict), k))
            diffs += [f"{key}.{k}: {a.get(k)!r} there, {b.get(k)!r} now" for k in keys if a.get(k) != b.get(k)]
        else:
            diffs.append(f"{key}: {a!r} there, {b!r} now")
    return diffs


@dataclass(frozen=True, kw_only=True)
class Sample:
    source: int  # index of the conversation in the prompt set (resume position)
    input_ids: torch.Tensor  # (T,) long
    loss_mask: torch.Tensor  # (T,) bool
    taps: torch.Tensor  # (T, n*H)
    final_hidden: torch.Tensor  # (T, H)


class ShardWriter:
    """Appends samples to a dataset directory, creating it or resuming a killed run in it.

    `manifest_base` holds the fields in IDENTITY (and any other provenance); an existing manifest
    that differs in any of them is refused with the differences listed, and nothing is touched.
    """

    def __init__(self, out_dir: str | Path, manifest_base: dict, shard_size: int):
        if shard_size < 1:
            raise UsageError(f"--shard-size must be >= 1, got {shard_size}")
        missing = [k for k in IDENTITY if k not in manifest_base]
        assert not missing, f"manifest_base lacks {missing}"
        self.dir, self.shard_size = Path(out_dir), shard_size
        self.dtype = DTYPES[manifest_base["storage_dtype"]]
        self._pending: list[Sample] = []
        self._skipped: Counter = Counter()
        self._freqs: Counter = Counter()  # assistant-token frequencies, all shards so far
        if (self.dir / MANIFEST).exists():
            self.manifest = self._resume(manifest_base)
        else:
            self._refuse_foreign_files()
            self.dir.mkdir(parents=True, exist_ok=True)
            self.manifest = {**manifest_base, "created_by": f"eaglewire {__version__}",
                             "progress": {"next_source": 0, "complete": False},
                             "counts": {"samples": 0, "tokens": 0, "assistant_tokens": 0, "truncated": 0,
                                        "skipped": {}},
                             "shards": [], "token_freqs": []}
            self._save()
        self._freqs.update({int(t): int(c) for t, c in self.manifest["token_freqs"]})
        self._start_samples, self._submitted = self.manifest["counts"]["samples"], 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eaglewire-shards")
        self._inflight: Future | None = None

    def _refuse_foreign_files(self) -> None:
        if not self.dir.exists():
            return
        if not self.dir.is_dir():
            raise UsageError(f"--out {self.dir}: exists and is not a directory")
        foreign = [p.name for p in self.dir.iterdir() if not p.name.endswith(".tmp")]
        if foreign:
            raise UsageError(f"--out {self.dir}: not empty and holds no {MANIFEST} ({', '.join(sorted(foreign)[:3])}"
                             f"{', ...' if len(foreign) > 3 else ''}): choose an empty or new directory")

    def _resume(self, base: dict) -> dict:
        old = read_manifest(self.dir)
        diffs = _differences(old, base)
        if diffs:
            raise EaglewireError(f"--out {self.dir} already holds data made differently ({'; '.join(diffs[:4])}"
                                 f"{'; ...' if len(diffs) > 4 else ''}): use a new --out directory, or delete "
                                 "this one to start over")
        listed = {s["file"] for s in old["shards"]}
        for s in old["shards"]:
            p = self.dir / s["file"]
            if not p.is_file() or p.stat().st_size != s["bytes"]:
                raise EaglewireError(f"{p}: listed in the manifest but missing or of the wrong size: the dataset "
                                     "is damaged; delete the directory and run datagen again")
        for p in self.dir.iterdir():  # remains of a killed run: unlisted shards, temporary files
            if p.name.endswith(".tmp") or (SHARD_RE.match(p.name) and p.name not in listed):
                p.unlink()
        return {**old, **{k: v for k, v in base.items() if k not in IDENTITY}}  # refresh provenance

    @property
    def next_source(self) -> int:
        return self.manifest["progress"]["next_source"]

    @property
    def samples(self) -> int:
        """Samples in the dataset once everything added so far is committed."""
        return self._start_samples + self._submitted + len(self._pending)

    def add(self, sample: Sample) -> None:
        t = sample.input_ids.numel()
        assert sample.loss_mask.shape == (t,) and sample.taps.shape[0] == t and sample.final_hidden.shape[0] == t
        if not (torch.isfinite(sample.taps).all() and torch.isfinite(sample.final_hidden).all()):
            raise EaglewireError(f"prompt record {sample.source}: the target produced NaN/inf hidden states; "
                                 "load the target in fp32 or check its weights")
        self._pending.append(sample)

    def skip(self, reason: str, n: int = 1) -> None:
        self._skipped[reason] += n

    def commit(self, next_source: int, truncated: int = 0) -> None:
        """Write the pending samples (one shard per `shard_size`) and record progress up to `next_source`.

        The writing happens on a background thread, overlapping the caller's next chunk (on a GPU,
        serializing, hashing and writing a shard takes longer than capturing it); at most one commit
        is in flight, and commits land in order.
        """
        batch, skipped = self._pending, self._skipped
        self._pending, self._skipped = [], Counter()
        self.wait()
        self._submitted += len(batch)
        self._inflight = self._pool.submit(self._commit_now, batch, skipped, next_source, truncated)

    def wait(self) -> None:
        """Block until the commit in flight is on disk; re-raise its error if it failed."""
        if self._inflight is not None:
            f, self._inflight = self._inflight, None
            f.result()

    def _commit_now(self, batch: list[Sample], skipped: Counter, next_source: int, truncated: int) -> None:
        new = []
        for i in range(0, len(batch), self.shard_size):
            new.append(self._write_shard(len(self.manifest["shards"]) + len(new), batch[i:i + self.shard_size]))
        c = self.manifest["counts"]
        for s in batch:
            c["samples"] += 1
            c["tokens"] += s.input_ids.numel()
            c["assistant_tokens"] += int(s.loss_mask.sum())
            self._freqs.update(s.input_ids[s.loss_mask].tolist())
        c["truncated"] += truncated
        c["skipped"] = dict(Counter(c["skipped"]) + skipped)
        self.manifest["shards"] += new
        self.manifest["progress"] = {"next_source": next_source, "complete": False}
        self._save()  # only now do the new shards exist as far as any reader is concerned

    def finish(self, complete: bool = True) -> dict:
        assert not self._pending, "commit() before finish()"
        self.wait()
        self._pool.shutdown()
        self.manifest["progress"]["complete"] = complete
        self._save()
        return self.manifest

    def _write_shard(self, index: int, samples: list[Sample]) -> dict:
        lengths = [s.input_ids.numel() for s in samples]
        offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        tensors = {
            "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32),
            "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
            "taps": torch.cat([s.taps for s in samples]).to(self.dtype).contiguous(),
            "final_hidden": torch.cat([s.final_hidden for s in samples]).to(self.dtype).contiguous(),
            "offsets": offsets,
        }
        name = f"shard-{index:05d}.safetensors"
        data = save(tensors, metadata={"format": FORMAT, "samples": str(len(samples))})
        files.atomic_write(self.dir / name, data)
        return {"file": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                "samples": len(samples), "tokens": int(offsets[-1]),
                "sources": [samples[0].source, samples[-1].source + 1]}

    def _save(self) -> None:
        self.manifest["token_freqs"] = [[t, c] for t, c in sorted(self._freqs.items(), key=lambda tc: (-tc[1], tc[0]))]
        files.atomic_write(self.dir / MANIFEST, _dumps(self.manifest).encode())


class ShardDataset(torch.utils.data.Dataset):
    """Random access to the samples of a dataset directory (memory-mapped, shard by shard)."""

    def __init__(self, out_dir: str | Path, manifest: dict, verify: str):
        self.dir, self.manifest, self.verify = Path(out_dir), manifest, verify
        self.contract = TapContract.from_dict(manifest["contract"])
        self.hidden_size = int(manifest["hidden_size"])
        self._ends = []
        for s in manifest["shards"]:
            self._ends.append((self._ends[-1] if self._ends else 0) + s["samples"])
        self._open: dict[int, tuple] = {}  # shard -> (safe_open handle, offsets)
        self._verified: set[int] = set()
        if verify == "open":
            for k in range(len(manifest["shards"])):
                self._check_sha(k)

    def __getstate__(self):  # DataLoader workers reopen the files themselves
        return {**self.__dict__, "_open": {}}

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @property
    def token_freqs(self) -> list[tuple[int, int]]:
        """(token_id, count) over assistant tokens, most frequent first."""
        return [(int(t), int(c)) for t, c in self.manifest["token_freqs"]]

    def _check_sha(self, k: int) -> None:
        if k in self._verified:
            return
        s = self.manifest["shards"][k]
        path = self.dir / s["file"]
        if not path.is_file():
            raise EaglewireError(f"{path}: listed in the manifest but missing; run datagen again")
        if file_digest(path) != s["sha256"]:
            raise EaglewireError(f"{path}: sha256 differs from the manifest (corrupt or replaced shard); "
                                 "delete the directory and run datagen again")
        self._verified.add(k)

    def _shard(self, k: int):
        if k not in self._open:
            if self.verify != "off":
                self._check_sha(k)
            s = self.manifest["shards"][k]
            f = safe_open(str(self.dir / s["file"]), framework="pt")
            offsets = f.get_tensor("offsets")
            width = len(self.contract.taps) * self.hidden_size
            shapes = {n: f.get_slice(n).get_shape() for n in ("input_ids", "taps", "final_hidden")}
            if (len(offsets) != s["samples"] + 1 or int(offsets[-1]) != s["tokens"]
                    or shapes["taps"] != [s["tokens"], width] or shapes["final_hidden"] != [s["tokens"], self.hidden_size]):
                raise EaglewireError(f"{self.dir / s['file']}: shapes {shapes} disagree with the manifest "
                                     f"({s['samples']} samples, {s['tokens']} tokens, taps width {width})")
            self._open[k] = (f, offsets)
        return self._open[k]

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range 0..{len(self) - 1}")
        k = bisect.bisect_right(self._ends, i)
        f, offsets = self._shard(k)
        j = i - (self._ends[k - 1] if k else 0)
        a, b = int(offsets[j]), int(offsets[j + 1])
        item = {"input_ids": f.get_slice("input_ids")[a:b].long(),
                "loss_mask": f.get_slice("loss_mask")[a:b].bool(),
                "taps": f.get_slice("taps")[a:b],  # (T, n*H)
                "final_hidden": f.get_slice("final_hidden")[a:b]}  # (T, H)
        if not (torch.isfinite(item["taps"]).all() and torch.isfinite(item["final_hidden"]).all()):
            raise EaglewireError(f"{self.dir / self.manifest['shards'][k]['file']}: sample {j} holds NaN/inf")
        return item

    def lengths(self) -> list[int]:
        """Token count of every sample (for length-grouped batching), from the shards' offsets."""
        out = []
        for k in range(len(self.manifest["shards"])):
            out += self._shard(k)[1].diff().tolist()
        return out


def open_dataset(out_dir: str | Path, expect_fingerprint: dict | None = None,
                 expect_contract: TapContract | None = None, verify: str = "lazy",
                 allow_incomplete: bool = False) -> ShardDataset:
    """Open a dataset for training. verify: "open" (hash every shard now), "lazy" (on first use), "off"."""
    if verify not in ("open", "lazy", "off"):
        raise UsageError(f"verify must be 'open', 'lazy' or 'off', got {verify!r}")
    manifest = read_manifest(out_dir)
    if not manifest["progress"]["complete"] and not allow_incomplete:
        raise EaglewireError(f"{out_dir}: datagen has not finished ({manifest['counts']['samples']} samples so far): "
                             "rerun the same datagen command to complete it")
    if expect_fingerprint is not None:
        diffs = compare_fingerprints(expect_fingerprint, manifest["target"], f"{out_dir}")
        if diffs:
            raise EaglewireError(f"{out_dir} was made with another target: {'; '.join(diffs)}")
    if expect_contract is not None:
        found = TapContract.from_dict(manifest["contract"])
        if found != expect_contract:
            raise EaglewireError(f"{out_dir} holds taps {list(found.taps)} of a {found.num_layers}-layer target, "
                                 f"expected taps {list(expect_contract.taps)} of {expect_contract.num_layers} layers")
    ds = ShardDataset(out_dir, manifest, verify)
    if len(ds) == 0:
        raise EaglewireError(f"{out_dir}: the dataset holds no samples (skipped: {manifest['counts']['skipped']})")
    return ds
