"""The training-data format: writing, resuming, reading and refusing damaged or foreign data."""

import hashlib
import json
import pickle
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglewire.data.shards import FORMAT, Sample, ShardWriter, manifest_hash, open_dataset, read_manifest
from eaglewire.errors import EaglewireError, UsageError
from eaglewire.taps import TapContract

H = 8
CONTRACT = TapContract(4, (1, 2, 4))
FP = {"architecture": "LlamaForCausalLM", "model_type": "llama", "num_layers": 4, "hidden_size": H,
      "vocab_size": 100, "weights_hash": "aaaa", "tokenizer_hash": "tttt", "chat_template_hash": "cccc"}


def base(**over):
    b = {"format": FORMAT, "contract": CONTRACT.to_dict(), "final_hidden": "post-norm", "storage_dtype": "fp32",
         "hidden_size": H, "target": dict(FP), "tokenizer_hash": "tttt", "chat_template_hash": "cccc",
         "prompts_sha256": "pppp", "prompts": {"file": "p.jsonl"}, "args": {"max_len": 64}}
    b.update(over)
    return b


def sample(src, n=None):
    g = torch.Generator().manual_seed(src)
    n = n or 3 + src % 5
    return Sample(source=src, input_ids=torch.randint(0, 100, (n,), generator=g),
                  loss_mask=torch.arange(n) >= n // 2, taps=torch.randn(n, 3 * H, generator=g),
                  final_hidden=torch.randn(n, H, generator=g))


def write(out, sources, shard_size=2, finish=True, **over):
    w = ShardWriter(out, base(**over), shard_size)
    for s in sources:
        w.add(sample(s))
    w.commit(next_source=max(sources) + 1 if sources else 0)
    if not finish:
        w.wait()  # the commit is on disk, as after a kill that came later
        return w
    return w.finish()


def test_roundtrip_counts_and_token_freqs(tmp_path):
    m = write(tmp_path / "d", list(range(5)))
    assert [s["samples"] for s in m["shards"]] == [2, 2, 1]
    assert [s["sources"] for s in m["shards"]] == [[0, 2], [2, 4], [4, 5]]
    ds = open_dataset(tmp_path / "d", expect_fingerprint=FP, expect_contract=CONTRACT, verify="open")
    assert len(ds) == 5 and ds.lengths() == [sample(i).input_ids.numel() for i in range(5)]
    freqs = Counter()
    for i in range(5):
        want, got = sample(i), ds[i]
        assert got["input_ids"].dtype == torch.long and got["loss_mask"].dtype == torch.bool
        assert torch.equal(got["input_ids"], want.input_ids) and torch.equal(got["loss_mask"], want.loss_mask)
        assert torch.equal(got["taps"], want.taps) and torch.equal(got["final_hidden"], want.final_hidden)
        freqs.update(want.input_ids[want.loss_mask].tolist())
    c = m["counts"]
    assert (c["samples"], c["tokens"], c["assistant_tokens"]) == (5, sum(ds.lengths()), sum(freqs.values()))
    assert dict(ds.token_freqs) == dict(freqs)
    assert [n for _, n in ds.token_freqs] == sorted(freqs.values(), reverse=True)
    # the manifest on disk is the one returned, and hashes stably
    assert read_manifest(tmp_path / "d") == m and manifest_hash(m) == manifest_hash(json.loads(json.dumps(m)))
    assert manifest_hash({**m, "counts": {**c, "samples": 4}}) != manifest_hash(m)
    # a pickled dataset (DataLoader workers) reopens its files
    assert torch.equal(pickle.loads(pickle.dumps(ds))[3]["taps"], ds[3]["taps"])


def test_bf16_storage(tmp_path):
    write(tmp_path / "d", [0, 1], storage_dtype="bf16")
    item = open_dataset(tmp_path / "d")[1]
    assert item["taps"].dtype == torch.bfloat16 and torch.equal(item["taps"], sample(1).taps.bfloat16())


def test_corrupt_shard_is_refused(tmp_path):
    write(tmp_path / "d", list(range(4)))
    path = tmp_path / "d" / "shard-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(EaglewireError, match="shard-00001.*sha256 differs"):
        open_dataset(tmp_path / "d", verify="open")
    ds = open_dataset(tmp_path / "d", verify="lazy")
    ds[0], ds[1]  # the intact shard reads fine
    with pytest.raises(EaglewireError, match="sha256 differs"):
        ds[2]


def test_nan_is_refused_on_write_and_on_read(tmp_path):
    w = ShardWriter(tmp_path / "w", base(), 2)
    bad = sample(0)
    bad.taps[1, 2] = float("nan")
    with pytest.raises(EaglewireError, match="NaN"):
        w.add(bad)
    # a shard altered after the fact, checksum updated to match: the values are still checked
    write(tmp_path / "d", [0, 1])
    path = tmp_path / "d" / "shard-00000.safetensors"
    t = load_file(path)
    t["final_hidden"][0, 0] = float("inf")
    save_file(t, path)
    m = read_manifest(tmp_path / "d")
    m["shards"][0].update(sha256=hashlib.sha256(path.read_bytes()).hexdigest(), bytes=path.stat().st_size)
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EaglewireError, match="NaN/inf"):
        open_dataset(tmp_path / "d", verify="open")[0]


def test_foreign_target_contract_empty_and_unfinished_are_refused(tmp_path):
    write(tmp_path / "d", [0, 1])
    with pytest.raises(EaglewireError, match="another target: .*weights_hash"):
        open_dataset(tmp_path / "d", expect_fingerprint={**FP, "weights_hash": "bbbb"})
    with pytest.raises(EaglewireError, match=r"holds taps \[1, 2, 4\].*expected taps \[1, 2, 3\]"):
        open_dataset(tmp_path / "d", expect_contract=TapContract(4, (1, 2, 3)))
    write(tmp_path / "e", [])
    with pytest.raises(EaglewireError, match="no samples"):
        open_dataset(tmp_path / "e")
    write(tmp_path / "f", [0, 1], finish=False)
    with pytest.raises(EaglewireError, match="has not finished.*rerun"):
        open_dataset(tmp_path / "f")
    assert len(open_dataset(tmp_path / "f", allow_incomplete=True)) == 2
    with pytest.raises(UsageError, match="no manifest.json"):
        open_dataset(tmp_path)


def test_resume_drops_the_remains_of_a_killed_run(tmp_path):
    d = tmp_path / "d"
    write(d, [0, 1, 2], finish=False)  # shards 0, 1 listed; progress at source 3
    # killed after writing shard 2 but before the manifest listed it, and mid-way through a temp file
    (d / "shard-00002.safetensors").write_bytes(b"half")
    (d / "shard-00003.safetensors.tmp").write_bytes(b"partial")
    (d / "manifest.json.tmp").write_text("{")
    w = ShardWriter(d, base(), 2)
    assert w.next_source == 3 and w.samples == 3
    assert sorted(p.name for p in d.iterdir()) == ["manifest.json", "shard-00000.safetensors",
                                                   "shard-00001.safetensors"]
    for s in (3, 4):
        w.add(sample(s))
    w.commit(next_source=5)
    w.finish()
    ds = open_dataset(d, verify="open")
    assert len(ds) == 5 and all(torch.equal(ds[i]["taps"], sample(i).taps) for i in range(5))
    assert [s["file"] for s in ds.manifest["shards"]] == [f"shard-{i:05d}.safetensors" for i in range(3)]


def test_other_arguments_or_foreign_directory_touch_nothing(tmp_path):
    d = tmp_path / "d"
    write(d, [0, 1])
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    for over, what in [({"contract": TapContract(4, (1, 2, 3)).to_dict()}, "contract.taps"),
                       ({"target": {**FP, "weights_hash": "bbbb"}}, "target.weights_hash"),
                       ({"args": {"max_len": 128}}, "args.max_len")]:
        with pytest.raises(EaglewireError, match=f"already holds data made differently.*{what}"):
            ShardWriter(d, base(**over), 2)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty"):
        ShardWriter(tmp_path / "x", base(), 2)
    with pytest.raises(UsageError, match="shard-size"):
        ShardWriter(tmp_path / "y", base(), 0)
