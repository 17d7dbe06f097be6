"""parallel.Dist.setup: which process group a torchrun rank joins, and on which device."""

import pytest
import torch
import torch.distributed as dist

from eaglewire.errors import UsageError
from eaglewire.parallel import Dist, pick_device


def joined(monkeypatch, cuda: bool, local_rank: int):
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda: local_rank)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    return Dist.setup(None), calls


def test_nccl_rank_is_bound_to_its_gpu(monkeypatch):
    """Without device_id NCCL guesses the GPU from the global rank and warns that this can hang
    (seen on two H200s with torch 2.11, benchmarks/results/2026-11-29-run09-ddp-fine-tune.md); the rank names
    cuda:LOCAL_RANK itself."""
    d, calls = joined(monkeypatch, cuda=True, local_rank=1)
    gpu = torch.device("cuda", 1)
    assert (d.rank, d.world, d.device, d.own) == (1, 2, gpu, True)
    assert calls == [("set_device", gpu), ("nccl", {"device_id": gpu})]


def test_cpu_ranks_use_gloo_without_a_device(monkeypatch):
    d, calls = joined(monkeypatch, cuda=False, local_rank=0)
    assert (d.rank, d.world, d.device) == (0, 2, torch.device("cpu"))
    assert calls == [("gloo", {})]


def test_mfu_of_several_gpus_is_per_gpu(capsys):
    """The training tokens/s is all ranks' together, so 182,431 tok/s on two H200s (1.24 GFLOP a token;
    benchmarks/results/2026-11-29-run09-ddp-fine-tune.md) is 11.4% of each GPU's peak, not the 22.8% it first
    reported."""
    from types import SimpleNamespace

    from eaglewire.train import metrics
    from eaglewire.train.trainer import Trainer as _Run
    run = SimpleNamespace(device=torch.device("cuda"), flops=1.24e9, dist=SimpleNamespace(world=2))
    mfu = _Run._mfu(run, 182431.0)
    assert abs(mfu - 0.1144) < 1e-3
    metrics.print_summary("ckpt", {"tokens_per_s": 182431.0, "mfu": mfu, "peak_tflops": 989.0, "world_size": 2,
                                   "flops_per_token": 1.24e9})
    assert "MFU 11.4% of 989 TFLOP/s on each of 2 GPUs" in capsys.readouterr().out


def test_one_process_device(monkeypatch):
    """--device: the CPU where no CUDA is; a name torch does not know, or CUDA on a machine without it, is one
    usage error (train, generate, bench and datagen all resolve it here)."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Dist.setup(None).device == torch.device("cpu") and pick_device("cpu") == torch.device("cpu")
    for name, msg in (("gpu", "--device gpu: not a device torch knows"), ("cuda:1", "CUDA is not available")):
        with pytest.raises(UsageError, match=msg):
            Dist.setup(name)


@pytest.mark.parametrize("backend, ok, want", [
    ("gloo", True, ["barrier", "gc", "destroy"]),  # no rank shuts its pairs while a peer still reads (CI's SIGABRT)
    ("gloo", False, ["destroy"]),  # a rank that raised: a barrier would wait on it
    ("nccl", True, ["destroy"]),  # rank 0 may bench alone for longer than NCCL's barrier waits
])
def test_closing_waits_for_every_rank_on_gloo_after_a_finished_run(monkeypatch, backend, ok, want):
    import gc

    calls = []
    monkeypatch.setattr(dist, "get_backend", lambda: backend)
    monkeypatch.setattr(dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(gc, "collect", lambda: calls.append("gc"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    Dist(0, 2, torch.device("cpu"), own=True).close(ok)
    assert calls == want
    calls.clear()
    Dist(0, 2, torch.device("cpu"), own=False).close(ok)  # a group the caller made is the caller's to close
    assert calls == []
