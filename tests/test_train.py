"""`eaglewire train` on a tiny random chat target (tests/chat_target.py): TTT alignment, metrics,
offline = online, resume after kill -9, 2 gloo processes (DDP and FSDP2), and the bad inputs."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from chat_target import CONTRACT, conversations_file, make_target
from safetensors.torch import load_file, save

from eaglewire import cli, targets
from eaglewire.checkpoint import load_draft
from eaglewire.data import shards
from eaglewire.data.datagen import run_datagen
from eaglewire.errors import EaglewireError, UsageError
from eaglewire.train import data as train_data
from eaglewire.train import metrics
from eaglewire.train.config import TrainConfig, lr_at
from eaglewire.train.trainer import train
from eaglewire.train.ttt import TTTModel, TTTSpec, soft_cross_entropy, target_side

# Fast settings: 40 conversations of ~40-70 character tokens, 8 held out.
FAST = dict(batch_tokens=512, log_every=2, eval_fraction=0.2, max_len=256, lr=3e-3)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent / "src")}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("train")


@pytest.fixture(scope="module")
def target_dir(root):
    return make_target(root / "target")


@pytest.fixture(scope="module")
def target(target_dir):
    return targets.load_target(str(target_dir), device="cpu")


@pytest.fixture(scope="module")
def prompts(root):
    return conversations_file(root / "prompts.jsonl", 40)


@pytest.fixture(scope="module")
def data(root, target, prompts):
    run_datagen(target, prompts, root / "data", CONTRACT, max_len=256, dtype="fp32", batch_size=5, progress=False)
    return root / "data"


def weights(path):
    return load_file(str(Path(path) / "model.safetensors"))


def records(path, kind):
    return [r for r in metrics.read_log(Path(path) / "train_log.jsonl") if r["kind"] == kind]


# ---- the loss, the metrics, the schedule ---------------------------------------------------------

def test_ttt_step_one_is_supervised_by_the_target_at_the_next_position(target, data):
    """TTT step 1 at position t: token x_{t+1}, fc(taps[t]), position t -> the target's softmax at t+1,
    on positions whose token x_{t+2} is an assistant token (docs/ARCHITECTURE.md, token alignment)."""
    from eaglewire.draft import DraftConfig, Eagle3Draft

    ds = shards.open_dataset(data)
    x = ds[3]
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.for_target(target.model.config, 3, None))
    head = target.model.lm_head
    T = x["input_ids"].numel()
    p, top, in_vocab = target_side(head, x["final_hidden"][None], draft.t2d, torch.arange(128), 8)
    loss, counts = TTTModel(draft, TTTSpec(steps=2)).eval()(
        x["input_ids"][None], x["loss_mask"][None], x["taps"][None], p, top, in_vocab, denom=1.0)
    # Independently, without the unroll: one plain causal draft forward.
    ids, taps, fh, lm = x["input_ids"], x["taps"], x["final_hidden"], x["loss_mask"]
    logits, _ = draft(ids[1:][None], draft.fuse(taps[:-1][None]), torch.arange(T - 1)[None])
    ref = torch.softmax(head(fh[1:]), -1)  # (T-1, V): target at t+1
    ce = -(ref * torch.log_softmax(logits[0], -1)).sum(-1)
    where = torch.zeros(T - 1, dtype=torch.bool)
    where[:T - 2] = lm[2:]
    assert counts[0, metrics.F["loss_positions"]] == where.sum() > 0
    assert torch.allclose(counts[0, metrics.F["loss_sum"]].float(), ce[where].sum(), rtol=1e-5)
    correct = (logits[0].argmax(-1) == ref.argmax(-1)) & where
    assert counts[0, metrics.F["correct"]] == correct.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_cross_entropy_matches_the_log_softmax_form_in_value_and_gradient(dtype):
    """The lse form equals EAGLE-3's -(p * log_softmax(logits)).sum(-1) (SpecForge core/eagle3.py)."""
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 5, 50, generator=g)).to(dtype).requires_grad_()
    p = torch.softmax(3 * torch.randn(3, 5, 50, generator=g), -1)
    w = torch.rand(3, 5, generator=g)
    ours = soft_cross_entropy(logits, p)
    (gours,) = torch.autograd.grad((ours * w).sum(), logits)
    ref = -(p * torch.log_softmax(logits.float(), -1)).sum(-1)
    (gref,) = torch.autograd.grad((ref * w).sum(), logits)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(gours.float(), gref.float(), rtol=tol, atol=tol)


def test_acceptance_length_from_conditional_accuracies():
    c = metrics.zeros(3, "cpu")
    c[:, metrics.F["positions"]] = 100
    c[:, metrics.F["correct"]] = torch.tensor([80.0, 60.0, 40.0])
    c[:, metrics.F["cond_positions"]] = torch.tensor([100.0, 80.0, 50.0])
    c[:, metrics.F["cond_correct"]] = torch.tensor([80.0, 50.0, 25.0])
    s = metrics.summarize(c)
    assert s["acc"] == [0.8, 0.6, 0.4] and s["cond_acc"] == [0.8, 0.625, 0.5]
    assert s["acceptance_length"] == pytest.approx(1 + 0.8 + 0.8 * 0.625 + 0.8 * 0.625 * 0.5)


def test_lr_schedule_warms_up_then_follows_a_cosine():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(cfg, s, 110) for s in range(110)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[60] == pytest.approx(0.55e-3) and lrs[-1] == pytest.approx(1e-4, rel=0.01)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_lr_schedule_linear_and_constant():
    """speculators' default decays in a straight line (transformers' get_linear_schedule_with_warmup,
    speculators/train/trainer.py `scheduler_type="linear"`); constant holds the peak after the warmup."""
    linear = TrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, schedule="linear")
    lrs = [lr_at(linear, s, 110) for s in range(110)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[35] == pytest.approx(0.775e-3) and lrs[60] == pytest.approx(0.55e-3)  # a quarter, half way down
    assert lr_at(linear, 200, 110) == pytest.approx(1e-4) and lr_at(linear, 60, 1000, horizon=110) == lrs[60]
    constant = TrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, schedule="constant")
    assert [lr_at(constant, s, 110) for s in (0, 9, 60, 109, 500)] == pytest.approx([1e-4, 1e-3, 1e-3, 1e-3, 1e-3])
    with pytest.raises(UsageError, match="schedule"):
        TrainConfig(schedule="step")


def test_epoch_plan_covers_the_split_once_within_the_token_budget():
    lengths = [int(x) for x in torch.randint(5, 200, (300,), generator=torch.Generator().manual_seed(1))]
    idx = list(range(0, 300, 2))
    plan = train_data.plan_epoch(idx, lengths, epoch=3, seed=7, batch_tokens=600, batch_size=None)
    assert sorted(i for mb in plan for i in mb) == idx
    assert all(len(mb) * train_data.padded(max(lengths[i] for i in mb)) <= 600 for mb in plan)
    assert plan == train_data.plan_epoch(idx, lengths, epoch=3, seed=7, batch_tokens=600, batch_size=None)
    assert plan != train_data.plan_epoch(idx, lengths, epoch=4, seed=7, batch_tokens=600, batch_size=None)


def test_config_refuses_bad_values_naming_the_flag():
    with pytest.raises(UsageError, match="--lr must be > 0"):
        TrainConfig(lr=0)
    with pytest.raises(UsageError, match="exclude each other"):
        TrainConfig(batch_tokens=4096, batch_size=8)
    with pytest.raises(UsageError, match="--loss must be one of"):
        TrainConfig(loss="mse")
    with pytest.raises(UsageError, match="--head must be one of"):
        TrainConfig(head="tied")
    with pytest.raises(UsageError, match="--batch-tokens 1024 is below --max-len 2048"):
        TrainConfig(batch_tokens=1024)
    assert TrainConfig.from_dict(TrainConfig(taps=(2, 4, 5)).to_dict()) == TrainConfig(taps=(2, 4, 5))


# ---- training end to end -------------------------------------------------------------------------

def test_offline_training_learns_and_writes_a_complete_checkpoint(target, data, root):
    out = root / "ckpt"
    r = train(TrainConfig(steps=40, draft_vocab_size=64, **FAST), target, data, out=out, progress=False)
    evals = records(out, "eval")
    assert evals[-1]["step"] == 40 and r.metrics["heldout"]["acc"] == pytest.approx(evals[-1]["acc"], abs=1e-5)
    assert evals[-1]["acc"][0] > evals[0]["acc"][0] + 0.2  # the draft learned the target's argmax
    assert 1.0 < r.metrics["heldout"]["acceptance_length"] <= 8.0
    draft, meta = load_draft(out)
    assert meta.contract == CONTRACT and meta.target == target.fingerprint
    assert meta.data_manifest_hash == shards.manifest_hash(shards.read_manifest(data))
    assert meta.training["config"]["draft_vocab_size"] == 64 and meta.training["steps"] == 40
    # the clock from the start: setup (target, data) before the first step, then each record's time
    assert 0 < meta.training["setup_seconds"] == r.metrics["setup_seconds"]
    times = [rec["elapsed_s"] for rec in metrics.read_log(out / "train_log.jsonl")]
    assert times == sorted(times) and times[0] > meta.training["setup_seconds"]
    assert len(meta.tap_stats["per_tap"]) == 3 and meta.metrics["heldout"]["acc"][0] == pytest.approx(
        evals[-1]["acc"][0], abs=1e-5)
    freqs = dict(shards.open_dataset(data).token_freqs)
    top = sorted(freqs, key=lambda t: (-freqs[t], t))[:63]
    chosen = draft.draft_to_target(torch.arange(64))
    assert set(top) <= set(chosen.tolist()) and draft.t2d[2]  # the most frequent tokens, and <|im_end|>
    assert torch.equal(draft.embed_tokens.weight, target.model.model.embed_tokens.weight)
    assert (out / "train_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "train_curves.png",
                                                     "train_log.jsonl"]  # no resume state left behind


def test_soft_ce_masks_out_of_vocabulary_argmax_and_kl_does_not(target, data, root):
    soft = train(TrainConfig(steps=2, draft_vocab_size=24, **FAST), target, data, out=root / "soft", progress=False)
    kl = train(TrainConfig(steps=2, draft_vocab_size=24, loss="kl", **FAST), target, data, out=root / "kl",
               progress=False)
    s, k = soft.metrics["heldout"], kl.metrics["heldout"]
    assert s["positions"] == k["positions"]
    assert 0 < s["loss_positions"] < s["positions"]  # target argmax outside the 24-token vocabulary: masked
    assert k["loss_positions"] == k["positions"]
    assert s["loss"][0] != pytest.approx(k["loss"][0])  # KL drops the target entropy, counts every position
    assert not torch.equal(weights(root / "soft")["lm_head.weight"], weights(root / "kl")["lm_head.weight"])


def test_offline_and_online_training_give_the_same_draft(target, data, prompts, root):
    cfg = TrainConfig(steps=8, **FAST)
    off = train(cfg, target, data, out=root / "off", progress=False)
    on = train(cfg, target, prompts, out=root / "on", progress=False)
    a, b = weights(root / "off"), weights(root / "on")
    assert torch.equal(a["d2t"], b["d2t"])
    for name in a:
        assert torch.allclose(a[name].float(), b[name].float(), atol=1e-5), name
    assert off.metrics["heldout"]["acc"] == pytest.approx(on.metrics["heldout"]["acc"], abs=1e-6)
    assert json.loads((root / "on" / "config.json").read_text())["training"]["data"]["mode"] == "online"


def test_offline_and_online_corpora_key_their_samples_alike(target, data, prompts):
    from eaglewire.parallel import Dist
    online = train_data.build_online(target, prompts, CONTRACT, 256, None, Dist(0, 1, torch.device("cpu"), False))
    offline = train_data.open_offline(data, target.fingerprint, CONTRACT, 256)
    assert len(set(online.keys)) == 40 and online.keys == offline.keys
    # the counts a subset's vocabulary and a data curve read: the same from either corpus, and from the token ids
    # alone (index_offline) as from the trainer's own scan; over every sample, the dataset's own frequencies
    assert train_data.index_offline(data, 256) == (offline.lengths, offline.loss_tokens, offline.keys)
    assert online.loss_tokens == offline.loss_tokens and online.lengths == offline.lengths
    some = [3, 7, 8, 30]
    assert offline.token_freqs_of(some) == online.token_freqs_of(some) != offline.token_freqs
    assert offline.token_freqs_of(range(40)) == offline.token_freqs == online.token_freqs
    cut = train_data.index_offline(data, 20)
    assert cut[0] == [min(n, 20) for n in offline.lengths] and cut[1] != offline.loss_tokens


HANG = """
import sys, time, torch
torch.set_num_threads(1)
from eaglewire import cli
from eaglewire.train import metrics
write = metrics.JsonlLog.write
def hang(self, rec):
    write(self, rec)
    if rec.get("kind") == "train" and rec["step"] == int(sys.argv[1]):
        print("hanging", flush=True)
        time.sleep(300)
metrics.JsonlLog.write = hang
sys.exit(cli.main(sys.argv[2:]))
"""


def train_args(target_dir, data, out):
    return ["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--steps", "10",
            "--batch-tokens", "512", "--log-every", "2", "--ckpt-every", "4", "--eval-every", "3",
            "--eval-fraction", "0.2", "--max-len", "256", "--lr", "3e-3", "--no-progress"]


def test_resume_after_kill_9_ends_bitwise_identical(target_dir, data, root, capsys):
    out, ref = root / "killed", root / "uninterrupted"
    script = root / "hang.py"
    script.write_text(HANG)
    proc = subprocess.Popen([sys.executable, str(script), "6", *train_args(target_dir, data, out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    line = proc.stdout.readline()
    if line.strip() != "hanging":
        proc.kill()
        pytest.fail(f"the training subprocess did not reach step 6: {proc.stderr.read()[-2000:]}")
    os.kill(proc.pid, signal.SIGKILL)  # after the resume state of step 4 and the log of step 6
    proc.wait()
    state = json.loads((out / "resume-state" / "state.json").read_text())
    assert state["step"] == 4 and records(out, "train")[-1]["step"] == 6
    assert cli.main(train_args(target_dir, data, out)) == 2  # an unfinished run needs --resume
    assert cli.main(train_args(target_dir, data, out) + ["--resume", "--lr", "1e-3"]) == 2  # other settings
    assert "differs in config.lr" in capsys.readouterr().err
    older = root / "older-split"  # a run saved before the split followed content held out other samples
    shutil.copytree(out, older)
    del state["identity"]["split"]
    (older / "resume-state" / "state.json").write_text(json.dumps(state))
    assert cli.main(train_args(target_dir, data, older) + ["--resume"]) == 2
    assert "differs in split (an older eaglewire held other samples out)" in capsys.readouterr().err
    assert cli.main(train_args(target_dir, data, out) + ["--resume"]) == 0
    assert cli.main(train_args(target_dir, data, ref)) == 0
    a, b = weights(out), weights(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    drop = {"tokens_per_s", "elapsed_s"}  # clocks
    strip = lambda rs: [{k: v for k, v in r.items() if k not in drop} for r in rs]  # noqa: E731
    assert strip(records(out, "train")) == strip(records(ref, "train"))
    assert strip(records(out, "eval")) == strip(records(ref, "eval"))
    assert not (out / "resume-state").exists()
    assert cli.main(train_args(target_dir, data, out) + ["--resume"]) == 0  # finished: nothing to do


DIST = """
import gc, os, sys, torch
import torch.distributed as dist
torch.set_num_threads(1)
from eaglewire.train.trainer import train
from eaglewire.train.config import TrainConfig
# One process group for both runs: re-creating a gloo group after destroying it can hang its first barrier.
dist.init_process_group("gloo")
for mode in ("ddp", "fsdp"):
    cfg = TrainConfig(steps=4, grad_accum=1, ckpt_every=2, fsdp=mode == "fsdp", **{FAST})
    train(cfg, sys.argv[1], sys.argv[2], out=os.path.join(sys.argv[3], mode), progress=False)
dist.barrier()  # as parallel.Dist.close does: no rank shuts its gloo pairs while the other still reads from them
gc.collect()
dist.destroy_process_group()
"""


def test_two_gloo_processes_match_one_process(target, target_dir, data, root):
    """torchrun --nproc_per_node 2 on the CPU (gloo), DDP then FSDP2: each rank one micro-batch of the
    global batch of 2; one process with grad_accum 2 trains on the same batches."""
    single = root / "single"
    train(TrainConfig(steps=4, grad_accum=2, ckpt_every=2, **FAST), target, data, out=single, progress=False)
    script = root / "dist.py"
    script.write_text(DIST.replace("{FAST}", repr(FAST)))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(script), str(target_dir), str(data), str(root / "dist")], env=ENV, capture_output=True,
                       text=True, timeout=600)  # a collective that hangs fails the test, not CI
    assert r.returncode == 0, r.stderr[-3000:]
    a = weights(single)
    for mode in ("ddp", "fsdp"):
        out = root / "dist" / mode
        b = weights(out)
        for name in a:
            assert torch.allclose(a[name].float(), b[name].float(), atol=1e-6), (mode, name)
        assert records(single, "eval")[-1]["acc"] == pytest.approx(records(out, "eval")[-1]["acc"], abs=1e-6)
        assert json.loads((out / "config.json").read_text())["training"]["world_size"] == 2


# ---- bad input: a clear error, nothing written ---------------------------------------------------

def copy_data(data, dst):
    shutil.copytree(data, dst)
    return dst


def rewrite_shard(d, fn):
    """Apply fn to shard 0's tensors and re-register it in the manifest (sha256 and size)."""
    import hashlib

    m = json.loads((d / "manifest.json").read_text())
    s = m["shards"][0]
    t = load_file(str(d / s["file"]))
    fn(t)
    raw = save(t, metadata={"format": shards.FORMAT, "samples": str(s["samples"])})
    (d / s["file"]).write_bytes(raw)
    s["sha256"], s["bytes"] = hashlib.sha256(raw).hexdigest(), len(raw)
    (d / "manifest.json").write_text(json.dumps(m))


def test_bad_data_is_refused_before_anything_is_written(target, data, root, target_dir):
    cfg = TrainConfig(steps=2, **FAST)
    other = targets.load_target(str(make_target(root / "other", seed=1)), device="cpu")
    out = root / "never"
    with pytest.raises(EaglewireError, match="made with another target: .*weights_hash"):
        train(cfg, other, data, out=out, progress=False)
    with pytest.raises(UsageError, match=r"--taps \[1, 4, 6\] differ from the taps \[2, 4, 5\]"):
        train(TrainConfig(steps=2, taps=(1, 4, 6), **FAST), target, data, out=out, progress=False)
    corrupt = copy_data(data, root / "corrupt")
    shard = corrupt / "shard-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(EaglewireError, match="sha256 differs"):
        train(cfg, target, corrupt, out=out, progress=False)
    empty = copy_data(data, root / "empty")
    m = json.loads((empty / "manifest.json").read_text())
    m["shards"], m["counts"]["samples"] = [], 0
    (empty / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(EaglewireError, match="holds no samples"):
        train(cfg, target, empty, out=out, progress=False)
    assert not out.exists()


def test_nan_hidden_states_stop_training_with_a_clear_error(target, data, root):
    nan = copy_data(data, root / "nan")
    rewrite_shard(nan, lambda t: t["taps"][7].fill_(float("nan")))
    out = root / "nan-out"
    with pytest.raises(EaglewireError, match=r"shard-00000.safetensors: sample 0 holds NaN/inf in taps"):
        train(TrainConfig(epochs=1, **FAST), target, nan, out=out, progress=False)
    assert not out.exists()
    broken = targets.load_target(str(root / "target"), device="cpu")
    with torch.no_grad():
        broken.model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(EaglewireError, match="non-finite loss, gradient or hidden state by step 1"):
        train(TrainConfig(steps=2, **{**FAST, "log_every": 1}), broken, root / "prompts.jsonl", out=out,
              progress=False)
    assert not out.exists()


def test_out_directory_is_never_overwritten(target, data, root, target_dir, capsys):
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="holds files that are not a training run's"):
        train(TrainConfig(steps=2, **FAST), target, data, out=foreign, progress=False)
    assert (foreign / "notes.txt").read_text() == "mine" and len(list(foreign.iterdir())) == 1
    done = root / "done"
    train(TrainConfig(steps=2, **FAST), target, data, out=done, progress=False)
    before = weights(done)
    with pytest.raises(UsageError, match="already holds a trained draft"):
        train(TrainConfig(steps=2, **FAST), target, data, out=done, progress=False)
    assert all(torch.equal(before[k], v) for k, v in weights(done).items())
    assert cli.main(["train", "--target", str(target_dir), "--prompts", str(data / "manifest.json"),
                     "--out", str(root / "x")]) == 2
    assert "pass --online" in capsys.readouterr().err


def test_bf16_autocast_path_runs_on_cpu_with_fp32_master_weights(target, data, root):
    """The GPU dtype policy (bf16 autocast, fp32 weights and optimizer) exercised on the CPU."""
    r = train(TrainConfig(steps=4, dtype="bf16", **FAST), target, data, out=root / "bf16", progress=False)
    w = weights(root / "bf16")
    assert w["fc.weight"].dtype == torch.float32 and all(x is not None for x in r.metrics["heldout"]["loss"])
    train(TrainConfig(steps=4, dtype="fp32", **FAST), target, data, out=root / "fp32", progress=False)
    ref = weights(root / "fp32")
    assert not torch.equal(w["fc.weight"], ref["fc.weight"])  # bf16 matmuls did run
    assert torch.allclose(w["fc.weight"], ref["fc.weight"], atol=0.02)


def test_flops_estimate_matches_counted_matmuls(target):
    """flops_per_token (behind the reported MFU) against torch's FLOP counter on one TTT fwd+bwd."""
    from torch.utils.flop_counter import FlopCounterMode

    from eaglewire.draft import DraftConfig, Eagle3Draft
    from eaglewire.train.config import flops_per_token

    T, K = 64, 3
    d = DraftConfig.for_target(target.model.config, 3, 96, intermediate_size=96)
    draft = Eagle3Draft(d)
    ids = torch.randint(128, (1, T))
    p, top, inv = target_side(target.model.lm_head, torch.randn(1, T, 32), draft.t2d, torch.arange(96), K + 1)
    model = TTTModel(draft, TTTSpec(steps=K))
    with FlopCounterMode(display=False) as fc:
        loss, _ = model(ids, torch.ones(1, T, dtype=torch.bool), torch.randn(1, T, 96), p, top, inv, denom=1.0)
        loss.backward()
    counted = fc.get_total_flops() / T
    head = 2 * 128 * 32  # the target's lm_head per token, not part of this forward
    est = flops_per_token(d, target.model, K, T, online=False) - head
    assert est == pytest.approx(counted, rel=0.15)


def test_online_regeneration_trains_on_the_targets_own_replies(target, prompts, root):
    r = train(TrainConfig(steps=2, regen=True, regen_max_new_tokens=6, regen_batch_size=16, **FAST), target, prompts,
              out=root / "regen", progress=False)
    data = json.loads((root / "regen" / "config.json").read_text())["training"]["data"]
    assert data["mode"] == "online" and data["regen"]["max_new_tokens"] == 6
    assert data["samples"] == 40
    # 8 held-out replies of <= 6 generated tokens plus <|im_end|>: not the prompt file's longer answers
    assert 0 < r.metrics["heldout"]["positions"] <= 8 * 7


def test_init_from_fine_tunes_an_existing_draft_keeping_its_vocabulary(target, data, prompts, root):
    """--init-from starts from a checkpoint's weights and draft vocabulary, not from a new draft with a
    vocabulary counted from the new data (a fine-tuned draft's d2t must stay what its head was trained on)."""
    base = train(TrainConfig(steps=6, draft_vocab_size=24, **FAST), target, data, out=root / "ft-base",
                 progress=False).checkpoint
    quiet = {**FAST, "lr": 1e-9, "warmup_steps": 0}
    tuned = train(TrainConfig(steps=2, init_from=str(base), **quiet), target, prompts, out=root / "ft",
                  progress=False)  # online, on conversations of their own: the vocabulary is still the draft's
    fresh = train(TrainConfig(steps=2, draft_vocab_size=24, **quiet), target, prompts, out=root / "ft-fresh",
                  progress=False)
    a, b = weights(base), weights(tuned.checkpoint)
    assert torch.equal(a["d2t"], b["d2t"]) and torch.equal(a["t2d"], b["t2d"])
    for name in a:
        assert torch.allclose(a[name].float(), b[name].float(), atol=1e-5), name
    assert not torch.allclose(a["fc.weight"], weights(fresh.checkpoint)["fc.weight"], atol=1e-3)
    assert tuned.metrics["heldout"]["acc"][0] > fresh.metrics["heldout"]["acc"][0]
    saved = json.loads((root / "ft" / "config.json").read_text())["training"]["config"]
    assert saved["init_from"] == str(base)


def test_init_from_refuses_a_draft_of_another_shape_or_taps(target, data, prompts, root):
    base = root / "ft-base2"
    train(TrainConfig(steps=2, draft_vocab_size=24, **FAST), target, data, out=base, progress=False)
    with pytest.raises(UsageError, match=r"--init-from .*ft-base2: its draft_vocab_size is 24, --draft-vocab-size "
                                         r"asks for 32: a fine-tuned draft keeps its shape"):
        train(TrainConfig(steps=2, init_from=str(base), draft_vocab_size=32, **FAST), target, prompts,
              out=root / "never", progress=False)
    with pytest.raises(UsageError, match=r"the draft reads taps \[2, 4, 5\], the training data \[1, 4, 6\]"):
        train(TrainConfig(steps=2, init_from=str(base), taps=(1, 4, 6), **FAST), target, prompts,
              out=root / "never", progress=False)
    with pytest.raises(UsageError, match="not an eaglewire draft checkpoint"):
        train(TrainConfig(steps=2, init_from=str(root / "nowhere"), **FAST), target, prompts, out=root / "never",
              progress=False)
    assert not (root / "never").exists()


def test_init_from_keeps_a_two_layer_draft_without_restating_its_shape(target, data, prompts, root):
    """A 2-layer draft fine-tunes as it is: --draft-layers left out means "not asked", not 1."""
    base = train(TrainConfig(steps=2, draft_layers=2, **FAST), target, data, out=root / "ft-2l",
                 progress=False).checkpoint
    tuned = train(TrainConfig(steps=2, init_from=str(base), **FAST), target, prompts, out=root / "ft-2l-tuned",
                  progress=False)
    assert json.loads((root / "ft-2l-tuned" / "config.json").read_text())["draft"]["num_layers"] == 2
    with pytest.raises(UsageError, match="its draft_layers is 2, --draft-layers asks for 1.*add layers, not remove"):
        train(TrainConfig(steps=2, init_from=str(base), draft_layers=1, **FAST), target, prompts,
              out=root / "never-2l", progress=False)
    assert tuned.metrics["heldout"]["positions"] > 0


def test_init_from_with_more_layers_deepens_the_draft_from_where_it_was(target, data, root, capsys):
    """--draft-layers above the checkpoint's adds identity layers (Eagle3Draft.deepened): training goes on from
    the checkpoint's predictions, its first layer and vocabulary kept, rather than from a new draft."""
    from safetensors.torch import load_file
    base = train(TrainConfig(steps=2, **FAST), target, data, out=root / "deepen-1l", progress=False).checkpoint
    capsys.readouterr()
    deep = train(TrainConfig(steps=2, init_from=str(base), draft_layers=3, **FAST), target, data,
                 out=root / "deepen-3l", progress=False)
    assert "deepening the draft from 1 to 3 layers" in capsys.readouterr().err
    cfg = json.loads((root / "deepen-3l" / "config.json").read_text())
    assert cfg["draft"]["num_layers"] == 3 and cfg["training"]["config"]["draft_layers"] == 3
    before, after = load_file(str(base / "model.safetensors")), load_file(str(root / "deepen-3l" / "model.safetensors"))
    assert {k for k in after if k.startswith("layers.2.")} and torch.equal(before["d2t"], after["d2t"])
    assert deep.metrics["heldout"]["positions"] > 0


def test_muon_trains_the_hidden_matrices_adamw_the_rest_and_its_state_resumes(target, data, root):
    """--optimizer muon, speculators' default (its train/trainer.py builds Muon for the draft's 2-D hidden weights,
    AdamW for the rest): the draft learns, and a resume state carries both optimizers' moments."""
    from eaglewire import parallel
    from eaglewire.train import state as train_state
    from eaglewire.train.trainer import optimizers

    r = train(TrainConfig(steps=40, draft_vocab_size=64, optimizer="muon", **FAST), target, data,
              out=root / "muon", progress=False)
    evals = records(root / "muon", "eval")
    assert evals[-1]["acc"][0] > evals[0]["acc"][0] + 0.2 and r.metrics["heldout"]["acceptance_length"] > 1.0
    assert load_draft(root / "muon")[1].training["config"]["optimizer"] == "muon"

    draft, _ = load_draft(root / "muon")
    cfg = TrainConfig(optimizer="muon", weight_decay=0.01, **FAST)
    names = {id(p): n for n, p in draft.named_parameters()}
    muon, adamw = optimizers(draft, cfg, torch.device("cpu"))
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    on_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    on_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert "fc.weight" in on_muon and any("q_proj" in n for n in on_muon)
    assert "lm_head.weight" in on_adamw and not any("norm" in n for n in on_muon)
    trained = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert on_muon | on_adamw == trained and not on_muon & on_adamw
    assert [type(o) for o in optimizers(draft, TrainConfig(**FAST), torch.device("cpu"))] == [torch.optim.AdamW]

    def step(model, opts):
        torch.manual_seed(1)
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)

    step(draft, (muon, adamw))
    model_sd, optim_sd = parallel.full_state(draft, [muon, adamw])
    train_state.save_state(root / "muon-state", model_sd, optim_sd, {"cpu": torch.get_rng_state()}, {"step": 1})
    again, _ = load_draft(root / "muon")
    opts = optimizers(again, cfg, torch.device("cpu"))
    model_sd, optim_sd, _, _ = train_state.load_state(root / "muon-state")
    parallel.load_full_state(again, opts, model_sd, optim_sd)
    step(draft, (muon, adamw))
    step(again, opts)
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), again.state_dict().values()))


def test_head_starts_from_the_targets_rows_and_target_frozen_keeps_them(target, data, root):
    """--head target / target-frozen: lm_head starts as the target's rows for the draft vocabulary (speculators
    0.9.0, model.py `_load_verifier_weights`, copies them and freezes them); random starts elsewhere."""
    from eaglewire.capture import locate

    full = locate(target.model).lm_head.weight.detach().float()

    def head_and_rows(name, **kw):
        train(TrainConfig(steps=2, draft_vocab_size=64, **kw, **FAST), target, data, out=root / name, progress=False)
        draft, meta = load_draft(root / name)
        rows = full[draft.draft_to_target(torch.arange(draft.config.draft_vocab_size))]
        return draft.lm_head.weight.detach(), rows, meta

    head, rows, meta = head_and_rows("head-frozen", head="target-frozen")
    assert torch.equal(head, rows) and meta.training["config"]["head"] == "target-frozen"
    assert "lm_head.weight" in weights(root / "head-frozen")  # the checkpoint carries it, as any head
    head, rows, _ = head_and_rows("head-target", head="target")
    near = (head - rows).abs().max()
    assert 0 < near < 0.02  # trained two steps from the target's rows
    head, rows, _ = head_and_rows("head-random")
    assert (head - rows).abs().max() > 5 * near
    with pytest.raises(UsageError, match="lm_head cannot start"):
        wider = {"hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 4}
        train(TrainConfig(steps=1, draft_vocab_size=64, head="target", draft_overrides=wider, **FAST), target, data,
              out=root / "head-narrow", progress=False)
    assert not (root / "head-narrow").exists()
