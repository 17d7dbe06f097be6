"""datagen --engine vllm on the CPU, the real vLLM replaced at its one boundary (engines.vllm.run_job) by an
engine that does what vLLM's extract_hidden_states does with eaglewire's hooks: the residual stream at vLLM's
ids (id j = tap j, id N = the last layer's output before the final norm), in layer order, one file a chunk.
What is checked is everything around it: the id translation, the split into taps and the post-norm final state
with the target's own norm (engines/host.py: no weights loaded), the shards and the manifest, which must come
out as datagen's hook capture writes them."""

import contextlib
import json

import pytest
import torch
from chat_target import CONTRACT, conversations_file, make_target
from safetensors.torch import save_file

from eaglewire import targets
from eaglewire.capture import capture
from eaglewire.data import datagen, shards
from eaglewire.engines import vllm as engine
from eaglewire.engines.host import host_target
from eaglewire.engines.vllm_datagen import run_vllm_datagen, vllm_ids
from eaglewire.taps import TapContract

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("vdg")
    make_target(d / "target")
    conversations_file(d / "convs.jsonl", 12)
    return d, targets.load_target(str(d / "target"), device="cpu")


class FakeVllm:
    """run_job's stand-in; the hooks do vLLM's part, so the two paths must agree."""

    def __init__(self, target):
        self.target, self.jobs = target, []

    def __call__(self, job, log_path=None):
        self.jobs.append(job)
        if isinstance(job, engine.RegenJob):
            gen = datagen.GenConfig(max_new_tokens=job.max_new_tokens, temperature=job.temperature, top_p=job.top_p)
            convs = datagen.regenerate(self.target, job.conversations, gen, job.max_len)
            return {"conversations": [c if isinstance(c, list) else [] for c in convs]}
        N = self.target.num_layers
        files = []
        for k, seqs in enumerate(job.chunks):
            states = []
            for s in seqs:
                got = capture(self.target.model, torch.tensor([s]), TapContract(N, tuple(job.layer_ids)))
                states.append(got.taps[0].reshape(len(s), len(job.layer_ids), -1))
            name = f"chunk-{k:05d}.safetensors"
            save_file({"hidden": torch.cat(states), "offsets": torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)},
                      f"{job.out_dir}/{name}")
            files.append(name)
        return {"files": files}


def _load(d):
    m = json.loads((d / "manifest.json").read_text())
    ds = shards.open_dataset(d)
    return m, [ds[i] for i in range(len(ds))]


def test_the_host_target_is_the_loaded_one_without_its_weights(world):
    d, target = world
    h = host_target(str(d / "target"))
    assert h.fingerprint == target.fingerprint and next(h.model.parameters()).is_meta
    x = torch.randn(5, 32)
    from eaglewire.capture import locate

    torch.testing.assert_close(h.norm(x), locate(target.model).norm(x))


def test_vllm_ids_are_the_taps_and_the_last_layer_in_layer_order():
    assert vllm_ids(TapContract(30, (2, 15, 27))) == [2, 15, 27, 30]
    assert vllm_ids(TapContract(8, (1, 4, 8))) == [1, 4, 8]  # tap N serves both


def test_an_embedding_tap_is_refused_before_vllm_is_needed(world, capsys):
    """vLLM 0.26.0 hands over the last layer's output at id 0, not the embedding (taps.py _VLLM_ID0): data captured
    there would be silently wrong, so the command refuses it in one line, vLLM installed or not."""
    from eaglewire.cli import main

    d, _ = world
    code = main(["datagen", "--target", str(d / "target"), "--prompts", str(d / "convs.jsonl"), "--out",
                 str(d / "never0"), "--engine", "vllm", "--taps", "0,4,5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "not the embedding" in err[0] and not (d / "never0").exists()


@pytest.mark.parametrize("regen", [False, True])
def test_vllm_capture_writes_the_shards_the_hooks_write(world, tmp_path, monkeypatch, regen):
    d, target = world
    fake = FakeVllm(target)
    monkeypatch.setattr(engine, "run_job", fake)
    monkeypatch.setattr(engine, "require", lambda: None)
    opts = dict(regen=regen, max_len=256, dtype="fp32", shard_size=5,
                gen=datagen.GenConfig(max_new_tokens=12) if regen else None)
    run_vllm_datagen(str(d / "target"), d / "convs.jsonl", tmp_path / "v", CONTRACT, progress=False, **opts)
    datagen.run_datagen(target, d / "convs.jsonl", tmp_path / "h", CONTRACT, progress=False, batch_size=4, **opts)
    mv, sv = _load(tmp_path / "v")
    mh, sh = _load(tmp_path / "h")
    assert mv["captured_by"] == {"engine": "vllm", "layer_ids": [2, 4, 5, 8], "tensor_parallel_size": 1}
    assert mv["args"]["capture_engine"] == "vllm" and mv["target"] == mh["target"]
    assert mv["counts"] == mh["counts"] and len(sv) == len(sh) == 12
    assert [type(j).__name__ for j in fake.jobs] == (["RegenJob"] if regen else []) + ["CaptureJob"]
    assert fake.jobs[-1].layer_ids == [2, 4, 5, 8] and [len(c) for c in fake.jobs[-1].chunks] == [5, 5, 2]
    for a, b in zip(sv, sh):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(a["taps"], b["taps"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a["final_hidden"], b["final_hidden"], rtol=1e-4, atol=1e-4)


def test_max_samples_stops_at_the_room_and_a_rerun_extends(world, tmp_path, monkeypatch):
    d, target = world
    monkeypatch.setattr(engine, "run_job", FakeVllm(target))
    monkeypatch.setattr(engine, "require", lambda: None)
    kw = dict(max_len=256, dtype="bf16", shard_size=4, progress=False)
    m = run_vllm_datagen(str(d / "target"), d / "convs.jsonl", tmp_path / "v", CONTRACT, max_samples=6, **kw)
    assert m["counts"]["samples"] == 6 and m["progress"]["next_source"] == 6
    m = run_vllm_datagen(str(d / "target"), d / "convs.jsonl", tmp_path / "v", CONTRACT, max_samples=10, **kw)
    assert m["counts"]["samples"] == 10 and m["progress"]["next_source"] == 10


def test_regen_with_max_samples_asks_replies_only_for_the_room(world, tmp_path, monkeypatch):
    d, target = world
    fake = FakeVllm(target)
    monkeypatch.setattr(engine, "run_job", fake)
    monkeypatch.setattr(engine, "require", lambda: None)
    m = run_vllm_datagen(str(d / "target"), d / "convs.jsonl", tmp_path / "v", CONTRACT, regen=True, max_samples=2,
                         max_len=256, dtype="bf16", shard_size=4, progress=False,
                         gen=datagen.GenConfig(max_new_tokens=4))
    # 2 samples + 10% + 8 spare for prompts skipped after their reply; not all 12 conversations
    assert len(fake.jobs[0].conversations) == 10 and m["counts"]["samples"] == 2


def test_the_gpu_memory_share_reaches_both_of_vllms_jobs(world, tmp_path, monkeypatch):
    """--gpu-memory-utilization is vLLM's own knob (EngineArgs.gpu_memory_utilization), passed as it is: a capture
    sharing the GPU with a training must not take the 0.8 its jobs take by default."""
    d, target = world
    fake = FakeVllm(target)
    monkeypatch.setattr(engine, "run_job", fake)
    monkeypatch.setattr(engine, "require", lambda: None)
    run_vllm_datagen(str(d / "target"), d / "convs.jsonl", tmp_path / "v", CONTRACT, regen=True, max_samples=3,
                     max_len=256, shard_size=4, progress=False, gen=datagen.GenConfig(max_new_tokens=4),
                     gpu_memory_utilization=0.25)
    assert [(type(j).__name__, j.gpu_memory_utilization) for j in fake.jobs] == [("RegenJob", 0.25),
                                                                                 ("CaptureJob", 0.25)]
    fake.jobs.clear()
    run_vllm_datagen(str(d / "target"), d / "convs.jsonl", tmp_path / "w", CONTRACT, max_samples=2, max_len=256,
                     shard_size=4, progress=False)
    assert fake.jobs[0].gpu_memory_utilization == engine.CaptureJob.__dataclass_fields__[
        "gpu_memory_utilization"].default


@pytest.mark.parametrize("extra, says", [(["--engine", "vllm", "--gpu-memory-utilization", "1.5"], "in (0, 1]"),
                                         (["--gpu-memory-utilization", "0.3"], "runs with --engine vllm")])
def test_a_gpu_memory_share_out_of_range_or_without_vllm_is_refused(world, capsys, extra, says):
    from eaglewire.cli import main

    d, _ = world
    with pytest.raises(SystemExit) if "1.5" in extra else contextlib.nullcontext():
        code = main(["datagen", "--target", str(d / "target"), "--prompts", str(d / "convs.jsonl"), "--out",
                     str(d / "never-share"), *extra])
        assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and not (d / "never-share").exists()


def test_without_vllm_datagen_names_the_extra(world, capsys):
    from eaglewire.cli import main

    if engine.available():
        pytest.skip("vLLM is installed here")
    d, _ = world
    code = main(["datagen", "--target", str(d / "target"), "--prompts", str(d / "convs.jsonl"), "--out",
                 str(d / "never"), "--engine", "vllm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "eaglewire[vllm]" in err[-1] and not (d / "never").exists()


def test_capture_engines_compares_each_tap_and_writes_the_hooks_dataset(world, tmp_path, monkeypatch):
    """benchmarks/capture_engines.py compare on a vLLM-format dataset (the engine faked by fp32 hooks): the same
    samples captured again by the hooks, each tap set against the fp32 reference. Here "vLLM" is exact fp32, so its
    distance to the reference is nil while the bf16 hooks' is not: a swapped pair or tap would show."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from capture_engines import compare

    d, _ = world
    monkeypatch.setattr(engine, "run_job", FakeVllm(world[1]))
    monkeypatch.setattr(engine, "require", lambda: None)
    run_vllm_datagen(str(d / "target"), d / "convs.jsonl", tmp_path / "v", CONTRACT, progress=False, max_len=256,
                     dtype="fp32", shard_size=5)
    r = compare(tmp_path / "v", tmp_path / "h", batch_size=4, device="cpu")
    names = [f"tap {k} (layer {t})" for k, t in enumerate(CONTRACT.taps)] + ["final (post-norm)"]
    assert r["samples"] == 12 and list(r["rows"]["vllm-fp32"]) == names
    for name in names:
        assert r["rows"]["vllm-fp32"][name]["relative"] < 1e-5
        assert r["rows"]["hooks_bf16-fp32"][name]["relative"] > 1e-4
        assert r["rows"]["vllm-hooks_bf16"][name]["relative"] == pytest.approx(
            r["rows"]["hooks_bf16-fp32"][name]["relative"], rel=0.05)
    mv, sv = _load(tmp_path / "v")
    mh, sh = _load(tmp_path / "h")
    assert mh["captured_by"]["engine"] == "eaglewire hooks" and mh["counts"]["samples"] == 12
    for a, b in zip(sv, sh):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
