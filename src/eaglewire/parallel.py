"""The device a command runs on (`--device`), and ranks for training: one process, or torchrun's world (DDP;
FSDP2 with --fsdp).

DDP averages gradients over ranks; FSDP2 (`fully_shard` per draft layer, then the root) shards
parameters, gradients and optimizer state, for drafts too big to replicate. Full (unsharded)
state dicts are gathered for resume states and the final checkpoint, so both read the same on
any world size.
"""

from __future__ import annotations

import gc
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .errors import UsageError


def pick_device(name: str | torch.device | None = None) -> torch.device:
    """--device: cuda where there is one, else cpu; one that torch does not know or this machine lacks is a
    usage error."""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise UsageError(f"--device {name}: not a device torch knows; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine")
    return device


@dataclass
class Dist:
    """This process's rank, the world size and its device (cuda:LOCAL_RANK, or the CPU on gloo)."""

    rank: int
    world: int
    device: torch.device
    own: bool  # the process group was created here (and is destroyed here)

    @classmethod
    def setup(cls, device: str | None) -> "Dist":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        cuda = torch.cuda.is_available() and (device is None or device.startswith("cuda"))
        if world == 1:
            return cls(0, 1, pick_device(device), False)
        import torch.distributed as dist

        local = int(os.environ.get("LOCAL_RANK", "0"))
        dev = torch.device("cuda", local) if cuda else torch.device("cpu")
        own = not dist.is_initialized()
        if own:
            if cuda:  # bound to its GPU up front: NCCL otherwise guesses it from the rank and warns of hangs
                torch.cuda.set_device(dev)
                dist.init_process_group("nccl", device_id=dev)
            else:
                dist.init_process_group("gloo")
        return cls(dist.get_rank(), dist.get_world_size(), dev, own)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist
            dist.all_reduce(t)
        return t

    def gather(self, obj) -> list:
        """Every rank's obj (picklable), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist
        parts: list = [None] * self.world
        dist.all_gather_object(parts, obj)
        return parts

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()

    def close(self, ok: bool) -> None:
        """Destroy the process group made here. On gloo, after a run that finished on every rank, first a barrier
        (no rank shuts its pairs while a peer still reads from them: that peer aborts) and a collection of the
        wrapped modules that still hold the group. Not on NCCL: rank 0 may still be benching alone, for longer
        than NCCL's barrier waits."""
        if self.own:
            import torch.distributed as dist
            if ok and dist.get_backend() == "gloo":
                dist.barrier()
                gc.collect()
            dist.destroy_process_group()


def wrap(inner: torch.nn.Module, dist: Dist, fsdp: bool):
    """The module the training loop calls: inner itself, DDP(inner), or inner sharded in place."""
    if dist.world == 1:
        return inner
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(dist.device.type, (dist.world,))
        for layer in inner.draft.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(inner, mesh=mesh)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(inner, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)


def grad_sync(model, dist: Dist, fsdp: bool, sync: bool):
    """Context for one micro-batch's backward: gradients are reduced only on the step's last one."""
    if dist.world == 1:
        return nullcontext()
    if fsdp:
        model.set_requires_gradient_sync(sync)
        return nullcontext()
    return nullcontext() if sync else model.no_sync()


def full_state(inner: torch.nn.Module, optim) -> tuple[dict, dict]:
    """Unsharded (model, optimizer) state dicts on the CPU, keyed by parameter name (a collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(inner, options=opts)
    return model_sd, (get_optimizer_state_dict(inner, optim, options=opts) if optim is not None else None)


def load_full_state(inner: torch.nn.Module, optim, model_sd: dict, optim_sd: dict) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(inner, model_sd, options=opts)
    set_optimizer_state_dict(inner, optim, optim_sd, options=opts)
