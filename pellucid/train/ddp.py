"""Data-parallel training across processes: `torchrun --nproc-per-node N -m pellucid train ...`.

Every rank draws the same global batch (same seed) and trains on its own slice of rows; DDP averages
the gradients, so N processes take the same steps as one process at the same `batch_size`, up to
floating-point summation order. On CPU the backend is gloo.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of the global batch."""
        per_rank = batch_size // self.world
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)


def init_distributed(batch_size: int) -> DistInfo:
    """Join the process group torchrun described in the environment (WORLD_SIZE, RANK, ...)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistInfo()
    if batch_size % world:
        raise ValueError(f"batch_size={batch_size} must divide evenly over {world} processes")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size())


def wrap(model: nn.Module, info: DistInfo) -> nn.Module:
    return DistributedDataParallel(model) if info.world > 1 else model


def mean_across(x: Tensor, info: DistInfo) -> Tensor:
    """The mean of a scalar over all ranks (each rank's loss covers its own rows)."""
    if info.world == 1:
        return x
    x = x.detach().clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x / info.world


def barrier(info: DistInfo) -> None:
    if info.world > 1:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """Leave the process group, once every rank is here: a rank that tore it down while another
    still had a collective in flight (an FSDP checkpoint's last gather) aborted now and then,
    "terminate called without an active exception"."""
    if info.world > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def no_sync(model: nn.Module, skip: bool) -> AbstractContextManager:
    """Skip the gradient all-reduce on micro-steps before the last one of an accumulation."""
    if skip and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return nullcontext()
