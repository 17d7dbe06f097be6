"""parallel.Dist.setup: which process group a torchrun rank joins, and on which device."""

import torch
import torch.distributed as dist

from eaglewire.parallel import Dist


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
    (seen in the ninth H200 run, torch 2.11); the rank names cuda:LOCAL_RANK itself."""
    d, calls = joined(monkeypatch, cuda=True, local_rank=1)
    gpu = torch.device("cuda", 1)
    assert (d.rank, d.world, d.device, d.own) == (1, 2, gpu, True)
    assert calls == [("set_device", gpu), ("nccl", {"device_id": gpu})]


def test_cpu_ranks_use_gloo_without_a_device(monkeypatch):
    d, calls = joined(monkeypatch, cuda=False, local_rank=0)
    assert (d.rank, d.world, d.device) == (0, 2, torch.device("cpu"))
    assert calls == [("gloo", {})]
